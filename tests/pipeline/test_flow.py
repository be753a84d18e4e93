"""Jobs pass through all three stages and come back exactly once."""

from __future__ import annotations

from collections import Counter

from rollstream.client import AsyncClient
from rollstream.pipeline.keys import RESULTS_GROUP

from .conftest import serve_all, stop_all


async def test_echo_job_passes_all_three_stages(settings):
    tasks = await serve_all(settings)
    try:
        async with AsyncClient(settings=settings) as client:
            job_id = await client.submit({"task": "echo", "instance": {"prompt": "hello"}})
            [result] = await client.collect(1, timeout_s=20)
            state = await client.status(job_id)
    finally:
        await stop_all(tasks)
    assert result.job_id == job_id and result.status == "completed" and result.reward == 1.0
    assert result.trajectory.response_text == "hello"
    assert {"init_s", "run_s", "eval_s"} <= set(result.timings_s)
    assert state.stage == "done" and state.status == "completed" and state.ttl_s > 0


async def test_thousand_jobs_yield_thousand_results_none_doubled(settings, worker_pool):
    worker_pool().start_all(concurrency=128)
    async with AsyncClient(settings=settings) as client:
        ids = await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}"}} for i in range(1000)])
        results = await client.collect(1000, timeout_s=120)
        extra = [r async for r in client.results(timeout_s=0.5)]
    counts = Counter(r.job_id for r in results)
    assert set(counts) == set(ids) and max(counts.values()) == 1 and not extra
    assert all(r.status == "completed" and r.reward == 1.0 for r in results)


async def test_results_read_one_at_a_time_are_acknowledged_with_the_next_submit(settings):
    """A client that submits, reads one result, submits again...: each result it has read
    is acknowledged (and removed) by the next submission's write, the last one at close,
    and a later reader of the same results stream gets none of them again."""
    tasks = await serve_all(settings)
    try:
        async with AsyncClient(settings=settings, submitter="stepper") as client:
            stream, seen, owed = client.keys.results("stepper"), [], []
            for i in range(5):
                await client.submit({"task": "echo", "instance": {"prompt": f"p{i}"}})
                owed.append((await client.r.xpending(stream, RESULTS_GROUP))["pending"])
                async for result in client.results(timeout_s=20, max_results=1):
                    seen.append(result.job_id)
            # Each submission acknowledged the result read before it: none was owed after it.
            assert owed == [0] * 5 and len(seen) == 5
            assert (await client.r.xpending(stream, RESULTS_GROUP))["pending"] == 1
        async with AsyncClient(settings=settings, submitter="stepper") as again:
            assert (await again.r.xpending(stream, RESULTS_GROUP))["pending"] == 0
            assert await again.r.xlen(stream) == 0
            assert [r async for r in again.results(timeout_s=0.5)] == []
    finally:
        await stop_all(tasks)
