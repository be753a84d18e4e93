"""A submission retried after a lost reply (Redis or the API restarting) must not double
the work: job ids chosen by the client make submitting idempotent, through both doors."""

from __future__ import annotations

import asyncio

from rollstream.client import AsyncClient


async def test_the_same_job_ids_submitted_twice_run_once(settings, worker_pool):
    worker_pool().start_all(concurrency=16)
    jobs = [{"job_id": f"retry-{i}", "task": "echo", "instance": {"prompt": f"p{i}"}} for i in range(50)]
    async with AsyncClient(settings=settings) as client:
        await client.submit_many(jobs)
        await client.submit_many(jobs[:30] + [{"job_id": "retry-new", "task": "echo", "instance": {"prompt": "n"}}])
        results = await client.collect(51, timeout_s=60)
        extra = [r async for r in client.results(timeout_s=1.5)]
        assert await client.r.xlen(client.keys.init_stream) <= 51
    ids = [r.job_id for r in results + extra]
    assert sorted(ids) == sorted([f"retry-{i}" for i in range(50)] + ["retry-new"])
