"""Which event loop rollstream's own processes run on: uvloop by default (a core dependency
on Linux), asyncio's own when asked; both serve the same pipeline."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from rollstream import eventloop
from rollstream.client import AsyncClient, Client
from rollstream.config import Settings
from rollstream.pipeline.keys import Keys


async def _registered(client, keys, n):
    return await client.r.zcard(keys.workers) >= n


def test_auto_takes_uvloop_and_asyncio_can_be_chosen():
    assert eventloop.loop_factory("auto") is uvloop.new_event_loop
    assert eventloop.loop_factory("uvloop") is uvloop.new_event_loop
    assert eventloop.loop_factory("asyncio") is asyncio.new_event_loop

    async def running_loop():
        return type(asyncio.get_running_loop())

    assert eventloop.run(running_loop()) is uvloop.Loop
    assert eventloop.run(running_loop(), "asyncio").__module__.startswith("asyncio")


def test_an_unknown_choice_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'auto', 'uvloop' or 'asyncio'"):
        eventloop.loop_factory("trio")
    with pytest.raises(ValueError):
        Settings(event_loop="trio")


def test_the_sync_client_runs_on_the_chosen_loop(settings):
    for choice, module in (("auto", "uvloop"), ("asyncio", "asyncio")):
        client = Client(settings=settings.model_copy(update={"event_loop": choice}))
        try:
            assert type(client._loop).__module__.split(".")[0] == module
        finally:
            client.close()


async def test_workers_on_either_loop_serve_the_same_jobs(settings, worker_pool, wait_until):
    worker_pool().start_all()  # the default loop: uvloop
    worker_pool(event_loop="asyncio").start_all()
    keys = Keys(settings.namespace)
    async with AsyncClient(settings=settings) as client:
        await wait_until(lambda: _registered(client, keys, 6), what="six workers registered")
        await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}"}} for i in range(40)])
        results = await client.collect(40, timeout_s=60)
        loops = {}
        for worker in await client.r.zrange(keys.workers, 0, -1):
            info = await client.r.hgetall(keys.worker(worker.decode()))
            loops.setdefault(info[b"stage"].decode(), set()).add(info[b"event_loop"].decode())
    assert sorted(r.job_id for r in results) == sorted({r.job_id for r in results}) and len(results) == 40
    assert all(r.status == "completed" for r in results)
    assert loops == {stage: {"uvloop", "asyncio"} for stage in ("init", "run", "eval")}
