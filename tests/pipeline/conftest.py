from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys
from rollstream.workers.process import serve_stage


@pytest.fixture
def stage_workers(worker_pool):
    """The three stages as real worker processes: ``async with stage_workers(settings):``."""

    @contextlib.asynccontextmanager
    async def run(settings, stages=("init", "run", "eval"), concurrency=64):
        pool = worker_pool(**{k: getattr(settings, k) for k in ("redis_url", "namespace", "data_dir", "node")})
        for stage in stages:
            pool.start(stage, concurrency=concurrency)
        # Tests time their jobs from submission: start them only once every stage serves.
        r = async_redis(settings.redis_url)
        try:
            deadline = time.monotonic() + 60
            while await r.zcard(Keys(settings.namespace).workers) < len(stages) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await r.aclose()
        try:
            yield pool
        finally:
            await asyncio.get_running_loop().run_in_executor(None, pool.stop)

    return run


@pytest.fixture
def wait_for_state():
    """``await wait_for_state(client, job_id, predicate)`` polls the job's state hash."""
    return _wait_for_state


async def _wait_for_state(client, job_id, predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await client.status(job_id)
        if state is not None and predicate(state):
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached the expected state; last: {await client.status(job_id)}")


async def serve_all(settings, concurrency=64):
    """The three stages as tasks in this event loop (cheaper than processes), returned once
    every stage has registered; stop them with ``stop_all``."""
    tasks = [asyncio.create_task(serve_stage(stage, settings, concurrency)) for stage in ("init", "run", "eval")]
    r = async_redis(settings.redis_url)
    try:
        deadline = time.monotonic() + 30
        while await r.zcard(Keys(settings.namespace).workers) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await r.aclose()
    return tasks


async def stop_all(tasks):
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
