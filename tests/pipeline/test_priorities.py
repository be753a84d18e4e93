"""Priorities on init work (pipeline/priorities.py): higher priorities first, nobody starved
under a steady flood of urgent work, every job still done exactly once, bounds refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

import pytest

from rollstream.client import AsyncClient
from rollstream.errors import InvalidJob
from rollstream.pipeline.priorities import queued_count

from .conftest import serve_all, stop_all


def _echo(i: int, priority: int) -> dict:
    return {"task": "echo", "instance": {"prompt": f"p{i}"}, "priority": priority}


async def test_higher_priority_jobs_queued_later_are_served_first(settings):
    async with AsyncClient(settings=settings) as client:
        low = await client.submit_many([_echo(i, 10) for i in range(30)])
        high = await client.submit_many([_echo(100 + i, 90) for i in range(5)])
        assert (await client.status(high[0])).priority == 90
        tasks = await serve_all(settings, concurrency=1)
        try:
            results = await client.collect(35, timeout_s=120)
        finally:
            await stop_all(tasks)
    order = [r.job_id for r in results]
    assert set(order) == set(low) | set(high) and all(r.ok for r in results)
    # The first low job met an empty queue and went straight onto the stream; every later
    # one waited behind the five urgent jobs that came after it.
    assert set(order[:6]) >= set(high), order[:8]
    assert order.index(low[-1]) > max(order.index(h) for h in high)


async def test_a_low_priority_job_is_served_under_a_steady_high_priority_flood(settings, wait_until):
    """Aging: with priority_aging_s = 0.02 a priority-0 job ranks at most 2 s behind later
    priority-100 jobs, so it is served while urgent work still waits."""
    settings = settings.model_copy(update={"priority_aging_s": 0.02})
    tasks = await serve_all(settings, concurrency=1)
    flooding = asyncio.Event()
    try:
        async with AsyncClient(settings=settings, submitter="flood") as flood, \
                AsyncClient(settings=settings, submitter="patient") as patient:

            async def keep_flooding() -> None:
                n = 0
                while True:
                    if await queued_count(flood.r, flood.keys) < 200:
                        await flood.submit_many([_echo(n + i, 100) for i in range(50)])
                        n += 50
                        flooding.set()
                    await asyncio.sleep(0.02)

            flooder = asyncio.create_task(keep_flooding())
            try:
                await asyncio.wait_for(flooding.wait(), 30)
                job_id = await patient.submit(_echo(-1, 0))
                [result] = await patient.collect(1, timeout_s=120)
                still_waiting = await flood.r.zcard(flood.keys.init_waiting)
            finally:
                flooder.cancel()
                await asyncio.gather(flooder, return_exceptions=True)
    finally:
        await stop_all(tasks)
    assert result.job_id == job_id and result.ok
    assert still_waiting > 0, "the flood had drained: this shows nothing about starvation"


async def test_jobs_of_every_priority_complete_exactly_once_when_an_init_worker_is_killed(settings, worker_pool):
    pool = worker_pool()
    pool.start("run", concurrency=64)
    pool.start("eval", concurrency=64)
    [doomed] = pool.start("init", concurrency=8)
    async with AsyncClient(settings=settings) as client:
        ids = await client.submit_many([_echo(i, (i * 37) % 101) for i in range(400)])
        while (await client.r.hget(client.keys.stats("init"), "forwarded")) is None:
            await asyncio.sleep(0.01)
        doomed.kill()  # mid-batch: what it held is reclaimed by the next init worker
        pool.start("init", concurrency=64)
        results = await client.collect(400, timeout_s=180)
        extra = [r async for r in client.results(timeout_s=1.0)]
        left = await queued_count(client.r, client.keys)
    counts = Counter(r.job_id for r in results)
    assert set(counts) == set(ids) and max(counts.values()) == 1 and not extra
    assert all(r.ok for r in results) and left == 0


async def test_a_priority_outside_0_to_100_is_refused_before_anything_is_queued(settings):
    async with AsyncClient(settings=settings) as client:
        for bad in (-1, 101, "high"):
            with pytest.raises(InvalidJob, match="priority"):
                await client.submit(_echo(0, bad))
        assert await queued_count(client.r, client.keys) == 0


def test_cli_submit_priority_is_checked_and_carried(settings, cli_env, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task": "echo", "instance": {"prompt": "hi"}}\n')
    cmd = [sys.executable, "-m", "rollstream", "submit", str(tasks), "--submitter", "cli"]
    refused = subprocess.run([*cmd, "--priority", "101"], env=cli_env, capture_output=True, text=True, timeout=120,
                             check=False)
    assert refused.returncode != 0 and "--priority" in refused.stderr
    done = subprocess.run([*cmd, "--priority", "80"], env=cli_env, capture_output=True, text=True, timeout=120,
                          check=True)
    [job_id] = done.stdout.split()

    async def state():
        async with AsyncClient(settings=settings) as client:
            return await client.status(job_id)
    assert asyncio.run(state()).priority == 80


async def test_the_http_api_checks_and_carries_a_jobs_priority(settings, asgi_server):
    import httpx

    from rollstream.api.app import asgi

    auth = {"Authorization": "Bearer prio-token"}
    with asgi_server(asgi(settings, token="prio-token")) as base:
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=30) as http:
            refused = await http.post("/v1/jobs", json={"task": "echo", "instance": {"prompt": "x"}, "priority": 101})
            taken = await http.post("/v1/jobs", json={"task": "echo", "instance": {"prompt": "x"}, "priority": 7})
            [job_id] = taken.json()["job_ids"]
            state = (await http.get(f"/v1/jobs/{job_id}")).json()
    assert refused.status_code == 422 and "priority" in refused.text
    assert taken.status_code == 200 and state["priority"] == 7
