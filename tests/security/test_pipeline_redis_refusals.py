"""Hole 7's other refusals, each produced by a real redis-server: OOM (over its maxmemory) and
READONLY (turned into a replica). Workers wait them out, the client and the status snapshot
say which, and once Redis takes writes again every job ends with exactly one result."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.client import AsyncClient
from rollstream.errors import RedisRefusesWrites
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import snapshot

from .pipeline_workers import alive, stage_tasks

REFUSALS = {  # how to make Redis refuse writes, how to end it, what it answers
    "oom": (("CONFIG", "SET", "maxmemory", "1"), ("CONFIG", "SET", "maxmemory", "0"), "OOM"),
    "readonly": (("REPLICAOF", "127.0.0.1", "1"), ("REPLICAOF", "NO", "ONE"), "READONLY"),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
async def test_workers_wait_out_a_refusing_redis_and_every_job_gets_one_result(kind, settings, tmp_path):
    start, end, code = REFUSALS[kind]
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        settings = settings.model_copy(update={"redis_url": server.url})
        async with AsyncClient(settings=settings, submitter="refused") as client, stage_tasks(settings) as tasks:
            ids = await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}", "run_s": 0.3 * (i % 3)}}
                                            for i in range(8)])
            await client.r.execute_command(*start)
            with pytest.raises(RedisRefusesWrites, match=code):
                await client.submit({"task": "echo", "instance": {"prompt": "late"}})
            assert code in (await snapshot(client.r, Keys(settings.namespace))).redis_problem
            await asyncio.sleep(2.0)  # reads, heartbeats and hand-offs meet the refusal
            assert alive(tasks) == []
            await client.r.execute_command(*end)
            results = await client.collect(len(ids), timeout_s=60)
            assert sorted(r.job_id for r in results) == sorted(ids)
            assert all(r.status == "completed" for r in results), [r.error for r in results if not r.ok]
            assert [r async for r in client.results(timeout_s=1.0)] == []
            assert alive(tasks) == []
