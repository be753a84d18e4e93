"""Hole 8 at the Python client: a result is acknowledged only once the caller has finished
with it (came back for the next one); an exception raised inside ``for r in client.results()``
leaves that result to be delivered again by the next call. Re-submitting a known job id says
so (``.duplicate`` and its status). A worker's heartbeat drops workers dead for worker_ttl_s."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollstream.client import AsyncClient, Client
from rollstream.messages import Result
from rollstream.pipeline.codec import pack
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys

from .pipeline_workers import stage_tasks


class Boom(Exception):
    pass


async def _deliver(settings, submitter: str, n: int) -> list[str]:
    r = async_redis(settings.redis_url)
    try:
        ids = []
        for i in range(n):
            result = Result(job_id=f"r{i}", submitter=submitter, task="echo", status="completed", reward=1.0)
            await r.xadd(Keys(settings.namespace).results(submitter), {"data": pack(result)})
            ids.append(result.job_id)
        return ids
    finally:
        await r.aclose()


def test_an_exception_in_the_sync_results_loop_does_not_acknowledge_that_result(settings):
    with Client(settings=settings, submitter="sync-ack") as client:
        client._run(client._client._ensure_results_group())
        client._run(_deliver(settings, "sync-ack", 3))
        seen = []
        with pytest.raises(Boom):
            for result in client.results(timeout_s=1):
                seen.append(result.job_id)
                if result.job_id == "r1":
                    raise Boom  # the caller did not finish with r1
        assert seen == ["r0", "r1"]
        again = [r.job_id for r in client.results(timeout_s=0.5)]
        assert again == ["r1", "r2"]
    with Client(settings=settings, submitter="sync-ack") as later:
        assert list(later.results(timeout_s=0.3)) == []  # every one was acknowledged once finished


async def test_an_exception_in_the_async_results_loop_does_not_acknowledge_that_result(settings):
    async with AsyncClient(settings=settings, submitter="async-ack") as client:
        await client._ensure_results_group()
        await _deliver(settings, "async-ack", 3)
        with pytest.raises(Boom):
            async for result in client.results(timeout_s=1):
                if result.job_id == "r0":
                    raise Boom
        assert [r.job_id async for r in client.results(timeout_s=0.5)] == ["r0", "r1", "r2"]
        assert [r async for r in client.results(timeout_s=0.2)] == []


async def test_resubmitting_a_finished_job_id_is_marked_duplicate(settings):
    async with AsyncClient(settings=settings, submitter="dup") as client:
        first = await client.submit({"task": "echo", "instance": {"prompt": "x"}, "job_id": "once"})
        assert first == "once" and not first.duplicate
        async with stage_tasks(settings):
            assert [r.job_id for r in await client.collect(1, timeout_s=20)] == ["once"]
        again = await client.submit({"task": "echo", "instance": {"prompt": "x"}, "job_id": "once"})
        assert again == "once" and again.duplicate and again.status == "completed"
        ids = await client.submit_many([{"task": "echo", "instance": {"prompt": "x"}, "job_id": j}
                                        for j in ("once", "new")])
        assert [(i, i.duplicate) for i in ids] == [("once", True), ("new", False)]


async def test_a_heartbeat_drops_workers_dead_for_worker_ttl_s(settings):
    keys = Keys(settings.namespace)
    r = async_redis(settings.redis_url)
    try:
        await r.zadd(keys.workers, {"n9:init:1:dead": time.time() - settings.worker_ttl_s - 1})
        async with stage_tasks(settings):
            deadline = time.monotonic() + 10
            while await r.zscore(keys.workers, "n9:init:1:dead") is not None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await r.zscore(keys.workers, "n9:init:1:dead") is None
            assert await r.zcard(keys.workers) == 3
    finally:
        await r.aclose()
