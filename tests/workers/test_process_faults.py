"""Worker processes that die or are stopped, and a Redis that restarts: nothing lost, nothing doubled."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter

from rollstream.client import AsyncClient
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.pipeline.keys import Keys


def _echo(i, **knobs):
    return {"task": "echo", "instance": {"prompt": f"p{i}", **knobs}}


async def _running_in(client, job_id, stage):
    st = await client.status(job_id)
    return st is not None and st.stage == stage and st.status == "running"


async def test_killed_run_worker_job_is_reclaimed_and_completes_once(settings, worker_pool, wait_until):
    pool = worker_pool()
    pool.start("init")
    pool.start("eval")
    [victim] = pool.start("run")
    async with AsyncClient(settings=settings) as client:
        job_id = await client.submit(_echo(0, run_s=1.5))
        await wait_until(lambda: _running_in(client, job_id, "run"), what="job running in run")
        os.kill(victim.pid, signal.SIGKILL)
        pool.start("run")
        [res] = await client.collect(1, timeout_s=60)
        late = [r async for r in client.results(timeout_s=3)]
    assert res.job_id == job_id and res.status == "completed" and res.reward == 1.0
    assert res.attempts == 2 and not late


async def test_sigterm_drains_in_flight_jobs_before_exit(settings, worker_pool, wait_until):
    pool = worker_pool()
    pool.start_all(concurrency=8)
    run_proc = next(p for s, p in pool.procs if s == "run")
    async with AsyncClient(settings=settings) as client:
        ids = await client.submit_many([_echo(i, run_s=1.0) for i in range(4)])
        await wait_until(lambda: _all_running(client, ids), what="all jobs running")
        run_proc.send_signal(signal.SIGTERM)
        results = await client.collect(4, timeout_s=30)
        code = await asyncio.get_running_loop().run_in_executor(None, run_proc.wait, 15)
    assert code == 0
    assert sorted(r.job_id for r in results) == sorted(ids)
    assert all(r.status == "completed" and r.attempts == 1 for r in results)


async def _all_running(client, ids):
    states = [await client.status(j) for j in ids]
    return all(s and s.stage == "run" and s.status == "running" for s in states)


async def test_sigterm_past_the_grace_period_hands_jobs_back(settings, worker_pool, wait_until):
    pool = worker_pool(shutdown_grace_s=0.3)
    pool.start("init")
    pool.start("eval")
    [run_proc] = pool.start("run")
    async with AsyncClient(settings=settings) as client:
        job_id = await client.submit(_echo(0, run_s=3.0))
        await wait_until(lambda: _running_in(client, job_id, "run"), what="job running")
        run_proc.send_signal(signal.SIGTERM)
        await asyncio.get_running_loop().run_in_executor(None, run_proc.wait, 15)
        state = await client.status(job_id)
        assert "handed back" in state.last_error
        pool.start("run")
        [res] = await client.collect(1, timeout_s=30)
    assert res.status == "completed"


async def test_redis_restart_with_aof_loses_no_queued_job(settings, worker_pool, tmp_path):
    server = EmbeddedRedis(tmp_path / "aof-redis").start()
    s = settings.model_copy(update={"redis_url": server.url})
    pool = worker_pool(redis_url=server.url)
    try:
        async with AsyncClient(settings=s) as client:
            ids = await client.submit_many([_echo(i, run_s=0.02) for i in range(300)])
        pool.start_all(concurrency=16)
        await asyncio.sleep(1.0)  # part of the jobs are through, part are in flight or queued
        server.stop()
        server.start()
        async with AsyncClient(settings=s, submitter=client.submitter) as client:
            results = await client.collect(300, timeout_s=90)
            late = [r async for r in client.results(timeout_s=2)]
        counts = Counter(r.job_id for r in results + late)
        assert set(counts) == set(ids) and max(counts.values()) == 1
        assert all(r.status == "completed" for r in results)
    finally:
        # The workers first, while their Redis answers: stopped after it, each waits out the
        # outage before it leaves (seconds of teardown, nothing shown).
        pool.stop(timeout_s=15)
        server.stop()


async def test_jobs_stranded_on_a_dead_node_are_rescued_to_another(settings, worker_pool, wait_until):
    keys = Keys(settings.namespace)
    doomed = worker_pool(node="n2")
    # n2 has init but no run workers: as many jobs as init may queue ahead of run (no run slots)
    # pile up on rs:jobs:run:n2; the rest wait in the shared init stream.
    doomed.start("init")
    async with AsyncClient(settings=settings) as client:
        ids = await client.submit_many([_echo(i) for i in range(20)])

        async def piled():
            return await client.r.xlen(keys.run_stream("n2")) == settings.init_run_ahead

        await wait_until(piled, what="jobs queued on node n2")
        await asyncio.sleep(1.0)  # and no more
        assert await client.r.xlen(keys.run_stream("n2")) == settings.init_run_ahead
        for _s, proc in doomed.procs:
            proc.kill()
        healthy = worker_pool(node="n1")
        healthy.start_all()
        results = await client.collect(20, timeout_s=60)
    assert sorted(r.job_id for r in results) == sorted(ids)
    assert all(r.status == "completed" for r in results)
    assert sorted(r.attempts for r in results) == [1] * (20 - settings.init_run_ahead) + [2] * settings.init_run_ahead


async def test_a_pool_whose_worker_cannot_start_fails_with_its_output(settings, worker_pool):
    """A benchmark or a deployment on a machine missing a dependency (a GPU node with another
    Python) must say why at once, not wait in silence for workers that never register."""
    from rollstream.workers.pool import WorkerProcessExited

    pool = worker_pool()
    pool.program = [sys.executable, "-c", "import sys; sys.exit('no module named missing_dependency')"]
    pool.start("run")
    async with AsyncClient(settings=settings) as client:
        try:
            await pool.wait_registered(client.r, client.keys.workers, 1, timeout_s=60)
        except WorkerProcessExited as exc:
            message = str(exc)
        else:
            raise AssertionError("wait_registered returned for a worker that exited")
    assert "exited with 1" in message and "no module named missing_dependency" in message


async def test_a_started_pool_is_waited_for_until_its_workers_register(settings, worker_pool):
    pool = worker_pool()
    pool.start_all()
    async with AsyncClient(settings=settings) as client:
        await pool.wait_registered(client.r, client.keys.workers, 3, timeout_s=120)
        assert await client.r.zcard(client.keys.workers) >= 3
