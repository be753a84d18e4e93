from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from rollstream.workers.process import serve_stage


@pytest.fixture
def inproc_workers():
    """Start stage workers as asyncio tasks in the test's loop: ``async with inproc_workers(settings):``."""

    @contextlib.asynccontextmanager
    async def run(settings, stages=("init", "run", "eval"), concurrency=64):
        tasks = [asyncio.create_task(serve_stage(stage, settings, concurrency)) for stage in stages]
        try:
            yield tasks
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
