"""Init's back-pressure for jobs without a sandbox (workers/sandbox_slots.py): a node's init
takes no more of them than its run slots (plus ``init_run_ahead``) can serve, so the rest wait
in the shared init stream and a node that joins later gets its share, instead of one node
hoarding every job on its run stream while another idles."""

from __future__ import annotations

import asyncio
import time

from rollstream.client import AsyncClient
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys
from rollstream.workers.process import serve_stage


async def _serve_node(settings, node: str, run_slots: int) -> list[asyncio.Task]:
    """Init, run and eval of ``node`` in this loop, returned once all three are registered."""
    on_node = settings.model_copy(update={"node": node, "data_dir": settings.data_dir / node})
    keys, r = Keys(settings.namespace), async_redis(settings.redis_url)
    before = await r.zcard(keys.workers)
    tasks = [asyncio.create_task(serve_stage(stage, on_node, concurrency))
             for stage, concurrency in (("init", 16), ("run", run_slots), ("eval", 16))]
    try:
        deadline = time.monotonic() + 60
        while await r.zcard(keys.workers) < before + 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await r.aclose()
    return tasks


async def test_init_takes_no_more_sandboxless_jobs_than_run_serves_and_leaves_the_rest_for_another_node(settings):
    settings = settings.model_copy(update={"init_run_ahead": 1})
    jobs, run_slots = 12, 2
    tasks = await _serve_node(settings, "n1", run_slots)
    peak = 0
    try:
        async with AsyncClient(settings=settings) as client:
            run_stream = client.keys.run_stream("n1")
            ids = await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}", "run_s": 2.5}}
                                            for i in range(jobs)])
            collected = asyncio.create_task(client.collect(jobs, timeout_s=120))
            started = time.monotonic()
            while time.monotonic() - started < 1.0:  # n1 alone, before any job leaves run: the rest waits
                peak = max(peak, await client.r.xlen(run_stream))
                await asyncio.sleep(0.01)
            states = [await client.r.hget(client.keys.job(job_id), "node") for job_id in ids]
            on_n1_alone = sum(state == b"n1" for state in states)
            tasks += await _serve_node(settings, "n2", run_slots)
            while not collected.done():
                peak = max(peak, await client.r.xlen(run_stream))
                await asyncio.sleep(0.01)
            results = collected.result()
            nodes = [(await client.r.hget(client.keys.job(job_id), "node")).decode() for job_id in ids]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert sorted(res.job_id for res in results) == sorted(ids) and all(res.ok for res in results)
    # Run's 2 slots plus 1 ahead; init's own in-flight jobs count against the same bound.
    assert 1 <= peak <= run_slots + 1
    assert on_n1_alone <= run_slots + 1  # what its slots serve and one ahead, not all twelve
    assert nodes.count("n2") >= 2, f"the node that joined later got {nodes.count('n2')} of {jobs} jobs"
