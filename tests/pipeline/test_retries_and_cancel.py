"""Retries, dead letters after N attempts, timeouts and cancellation. Tests whose jobs are
submitted to serving workers share one pool (each its own submitter); those that queue jobs
before any worker serves start a pool of their own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollstream.client import AsyncClient
from rollstream.messages import DeadLetter
from rollstream.pipeline.codec import unpack
from rollstream.pipeline.keys import Keys


@pytest.fixture
def serving(shared_pool):
    """Settings of the module's serving pool (the three stages, as stage_workers starts them)."""
    return shared_pool("stages")


async def test_a_failing_stage_is_retried_and_then_succeeds(serving):
    async with AsyncClient(settings=serving) as client:
        await client.submit({"task": "echo", "instance": {"prompt": "a", "fail_in": "run", "fail_times": 1}})
        [res] = await client.collect(1, timeout_s=20)
    assert res.status == "completed" and res.attempts == 2


async def test_a_job_failing_every_time_is_dead_lettered_with_its_errors(serving):
    async with AsyncClient(settings=serving) as client:
        job_id = await client.submit({"task": "echo", "instance": {"prompt": "a", "fail_in": "eval"}})
        [res] = await client.collect(1, timeout_s=20)
        dead = await client.r.xrange(Keys(serving.namespace).dead)
    letters = [unpack(DeadLetter, fields[b"data"]) for _id, fields in dead]
    [letter] = [letter for letter in letters if letter.job_id == job_id]  # one, whatever other tests' jobs left
    assert res.status == "failed" and res.attempts == serving.max_deliveries
    assert "asked to fail in eval" in res.error and "earlier attempts" in res.error
    assert letter.job_id == job_id and letter.stage == "eval"


async def test_a_job_past_its_timeout_fails_with_the_reason(serving):
    async with AsyncClient(settings=serving) as client:
        await client.submit({"task": "echo", "instance": {"prompt": "a", "run_s": 30}, "timeout_s": 1})
        [res] = await client.collect(1, timeout_s=20)
    assert res.status == "failed" and "timed out in run" in res.error


async def test_each_job_times_out_at_its_own_deadline(serving):
    """One worker holds jobs with different timeouts, the shortest arriving last: each fails
    at its own deadline, in deadline order, and a job that finishes in time is untouched."""
    async with AsyncClient(settings=serving) as client:
        late = await client.submit({"task": "echo", "instance": {"prompt": "a", "run_s": 30}, "timeout_s": 4})
        in_time = await client.submit({"task": "echo", "instance": {"prompt": "b", "run_s": 0.3}, "timeout_s": 3})
        early = await client.submit({"task": "echo", "instance": {"prompt": "c", "run_s": 30}, "timeout_s": 1.5})
        results = await client.collect(3, timeout_s=30)
    order = [r.job_id for r in results]
    by_id = {r.job_id: r for r in results}
    assert by_id[in_time].status == "completed"
    assert by_id[early].status == by_id[late].status == "failed"
    assert "timeout_s=1.5" in by_id[early].error and "timeout_s=4" in by_id[late].error
    assert order.index(early) < order.index(late)


async def test_cancel_of_a_group_stops_its_queued_jobs(settings, stage_workers):
    async with AsyncClient(settings=settings) as client:
        gid, ids = await client.submit_group({"task": "echo", "instance": {"prompt": "x"}}, 8)
        _other, other_ids = await client.submit_group({"task": "echo", "instance": {"prompt": "y"}}, 4)
        await client.cancel(group_id=gid)
        async with stage_workers(settings):
            results = await client.collect(12, timeout_s=20)
    by_id = {r.job_id: r for r in results}
    assert all(by_id[j].status == "cancelled" and by_id[j].group_id == gid for j in ids)
    assert all(by_id[j].status == "completed" for j in other_ids)


async def test_cancel_of_a_running_job_interrupts_it_and_frees_its_workdir(serving, wait_for_state):
    async with AsyncClient(settings=serving) as client:
        job_id = await client.submit({"task": "echo", "instance": {"prompt": "x", "run_s": 60}})
        await wait_for_state(client, job_id, lambda s: s.stage == "run" and s.status == "running")
        await client.cancel(job_id=job_id)
        [res] = await client.collect(1, timeout_s=10)
    assert res.status == "cancelled" and res.error_stage == "run"
    assert not (Path(serving.data_dir) / "work" / job_id).exists()


async def test_cancel_everything_of_a_submitter_spares_later_jobs(settings, stage_workers):
    async with AsyncClient(settings=settings) as client:
        first = await client.submit_many([{"task": "echo", "instance": {"prompt": str(i)}} for i in range(5)])
        await client.cancel(everything=True)
        await asyncio.sleep(0.01)
        later = await client.submit({"task": "echo", "instance": {"prompt": "later"}})
        async with stage_workers(settings):
            results = {r.job_id: r for r in await client.collect(6, timeout_s=20)}
    assert all(results[j].status == "cancelled" for j in first)
    assert results[later].status == "completed"
