"""Init's warm pool (workers/warm_pool.py) on real bubblewrap sandboxes: a job gets a ready
sandbox of its exact spec, a spec never asked for is never warmed, idle ones go after their time
to live, the pool is destroyed when its worker stops, and a killed worker's pool is reaped by the
node's reaper once its lease runs out (never before); the pool plans each sandbox at what the
node's job sandboxes measure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest
from pipeline.conftest import serve_all, stop_all  # tests/pipeline (the tests folder is on sys.path)

from rollstream.client import AsyncClient
from rollstream.messages import Envelope
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.drain import request_drain
from rollstream.pipeline.keys import Keys
from rollstream.sandbox_spec import SandboxLimits, SandboxSpec
from rollstream.sandboxes import SandboxClient, capacity, create_sandbox, destroy_sandbox
from rollstream.sandboxes.roots import namespace_root_dir
from rollstream.tasks.base import TaskContext
from rollstream.tasks.echo import EchoTask
from rollstream.tasks.registry import register_task
from rollstream.workers.node_reaper import reap_node
from rollstream.workers.process import serve_stage
from rollstream.workers.warm_pool import (
    WarmPool,
    measure_job_sandboxes,
    planned_sandbox_mb,
    spec_key,
    warm_pool_cap,
)

SEEN: dict[str, str] = {}  # job id -> the id of the sandbox its setup ran in


@register_task
class _WarmEcho(EchoTask):
    """Echo in a bubblewrap sandbox: setup writes a note, score reads it back."""

    name = "test-warm-echo"
    memory_mb = 4096

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(backend="bwrap", limits=SandboxLimits(memory_mb=self.memory_mb))

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        SEEN[env.job.job_id] = env.sandbox.id
        await ctx.sandbox.write_file("note.txt", env.job.job_id)
        await super().setup(env, ctx)

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        note = (await ctx.sandbox.read_file("note.txt")).decode()
        return await super().score(env, ctx) if note == env.job.job_id else 0.0


@register_task
class _WarmEchoOtherLimits(_WarmEcho):
    name = "test-warm-echo-other-limits"
    memory_mb = 2048


def _job(task: str = _WarmEcho.name) -> dict:
    return {"task": task, "instance": {"prompt": "p"}}


def _sandboxes_on_disk(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if not name.startswith(".")) if os.path.isdir(root) else []


@pytest.fixture
def warm_settings(settings, sandbox_root):
    return settings.model_copy(update={"sandbox_root": sandbox_root, "warm_pool_max_per_node": 2,
                                       "warm_pool_check_s": 0.2})


async def test_a_job_gets_a_ready_sandbox_of_its_exact_spec_and_no_other(warm_settings, wait_until):
    root = namespace_root_dir(warm_settings.namespace, warm_settings.sandbox_root)
    tasks = await serve_all(warm_settings, concurrency=4)
    try:
        async with AsyncClient(settings=warm_settings) as client:
            leases = client.keys.node_warm(warm_settings.node)
            await asyncio.sleep(1.0)  # a pool never asked for a spec warms nothing
            assert await client.r.zcard(leases) == 0 and _sandboxes_on_disk(root) == []
            first = await client.submit(_job())
            [r1] = await client.collect(1, timeout_s=120)
            await wait_until(lambda: _count(client.r, leases, 2), 120, "the pool warmed two sandboxes of the spec")
            second = await client.submit(_job())
            other = await client.submit(_job(_WarmEchoOtherLimits.name))
            results = {r.job_id: r for r in await client.collect(2, timeout_s=120)}
    finally:
        await stop_all(tasks)
    assert r1.ok and r1.reward == 1.0 and not SEEN[first].startswith("warm-")  # the first ask is a miss
    assert results[second].ok and results[second].reward == 1.0 and SEEN[second].startswith("warm-")
    assert results[other].ok and not SEEN[other].startswith("warm-")  # other limits: never a warm one
    assert _sandboxes_on_disk(root) == []  # jobs' sandboxes destroyed by eval, the pool's at shutdown


async def _count(r, key, at_least):
    return await r.zcard(key) >= at_least


@contextlib.asynccontextmanager
async def _pipeline_with_a_warm_sandbox(settings, wait_until):
    """The three stages, after one job taught init's pool the spec and it warmed a sandbox:
    yields (stage tasks, client, the lease key, the sandbox root)."""
    tasks = await serve_all(settings, concurrency=4)
    try:
        async with AsyncClient(settings=settings) as client:
            leases = client.keys.node_warm(settings.node)
            await client.submit(_job())
            await client.collect(1, timeout_s=120)
            await wait_until(lambda: _count(client.r, leases, 1), 120, "a warm sandbox")
            yield tasks, client, leases, namespace_root_dir(settings.namespace, settings.sandbox_root)
    finally:
        await stop_all(tasks)


async def test_idle_warm_sandboxes_go_after_their_time_to_live(warm_settings, wait_until):
    settings = warm_settings.model_copy(update={"warm_pool_idle_ttl_s": 3.0})
    async with _pipeline_with_a_warm_sandbox(settings, wait_until) as (_tasks, client, leases, root):
        async def all_gone():
            return await client.r.zcard(leases) == 0 and _sandboxes_on_disk(root) == []
        await wait_until(all_gone, 60, "idle warm sandboxes destroyed, and the spec no longer warmed")


async def test_a_draining_node_destroys_its_warm_sandboxes(warm_settings, wait_until):
    async with _pipeline_with_a_warm_sandbox(warm_settings, wait_until) as (tasks, client, leases, root):
        await request_drain(client.r, client.keys, warm_settings.node, 30.0, worker_ttl_s=warm_settings.worker_ttl_s)

        async def drained():
            return all(t.done() for t in tasks) and _sandboxes_on_disk(root) == [] and not await client.r.zcard(leases)
        await wait_until(drained, 120, "the node's workers gone and their warm sandboxes destroyed")


async def test_a_killed_workers_pool_is_spared_while_its_lease_lasts_then_reaped(warm_settings, wait_until):
    """The pool is left as a SIGKILL leaves it: sandboxes running, nobody renewing the leases."""
    settings = warm_settings.model_copy(update={"worker_ttl_s": 3.0})
    keys = Keys(settings.namespace)
    root = namespace_root_dir(settings.namespace, settings.sandbox_root)
    run = asyncio.create_task(serve_stage("run", settings, 4))  # the run slots the pool fills
    r = async_redis(settings.redis_url)
    pool = WarmPool(settings, r, keys, root, stage="init", wanted=lambda slots, in_use: slots["run"] - in_use)
    try:
        await wait_until(lambda: r.zcard(keys.workers), 60, "the run worker")
        spec = SandboxSpec(backend="bwrap")
        assert await pool.take(spec, "job-1") is None  # the ask the pool learns from

        async def warmed():
            await pool.tick()
            return sum(len(s.idle) for s in pool.shelves.values()) >= 2
        await wait_until(warmed, 120, "two warm sandboxes")
        held = sorted(w.handle.id for w in pool.shelves[spec_key(spec)].idle)
        pool._starts.clear()  # killed: nothing of the pool runs any more
        assert await reap_node(r, keys, settings.node, root) == []  # leased: not orphans
        assert _sandboxes_on_disk(root) == held
        lease_ends = max(score for _id, score in await r.zrange(keys.node_warm(settings.node), 0, -1, withscores=True))
        await asyncio.sleep(max(0.0, lease_ends - time.time()) + 0.1)
        assert sorted(await reap_node(r, keys, settings.node, root)) == held
        assert _sandboxes_on_disk(root) == [] and await r.zcard(keys.node_warm(settings.node)) == 0
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        await r.aclose()


def test_the_cap_is_what_is_wanted_within_the_setting_and_the_node():
    assert warm_pool_cap(wanted=64 - 60, sandboxes_in_use=60, max_warm=16, node_capacity=1000) == 4
    assert warm_pool_cap(wanted=64, sandboxes_in_use=0, max_warm=16, node_capacity=1000) == 16
    assert warm_pool_cap(wanted=54, sandboxes_in_use=10, max_warm=16, node_capacity=13) == 3
    assert warm_pool_cap(wanted=8 - 9, sandboxes_in_use=9, max_warm=16, node_capacity=1000) == 0
    assert warm_pool_cap(wanted=64, sandboxes_in_use=0, max_warm=0) == 0  # off
    assert 0 <= warm_pool_cap(wanted=64, sandboxes_in_use=0, max_warm=16) <= 16  # the node's measured capacity


async def test_the_pool_plans_a_sandbox_at_what_the_nodes_job_sandboxes_measure(sandbox_root, monkeypatch):
    monkeypatch.setattr(capacity, "_measured", {})  # this test's figures only, none left for later tests
    root = sandbox_root
    job_sandbox = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="job-a", owner="job-a", root_dir=root)
    warm_sandbox = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="warm-x-i1", owner="warm-x",
                                        root_dir=root)
    try:
        assert measure_job_sandboxes(root) < capacity.sandbox_mb("kernel")  # bash alone so far
        assert planned_sandbox_mb() == capacity.sandbox_mb("kernel")  # never planned below a live kernel
        # The job's agent holds 300 MiB in its kernel; the pool's own warm sandbox, unused, is no job's.
        async with SandboxClient(job_sandbox.socket_path) as sb:
            assert (await sb.ipython("held = bytearray(300 * 2**20); len(held)")).result == str(300 * 2**20)
        async with SandboxClient(warm_sandbox.socket_path) as sb:
            assert (await sb.ipython("held = bytearray(600 * 2**20); len(held)")).result == str(600 * 2**20)
        measured = measure_job_sandboxes(root)
        assert 300 < measured < 600
        assert planned_sandbox_mb() == measured
        # So the pool sizes itself by it: 10 such sandboxes' worth of memory left holds 10 more.
        assert capacity.node_capacity("kernel", live_sandboxes=2, reserve_mb=0, available_mb=10.5 * measured,
                                      per_sandbox_mb=planned_sandbox_mb()) == 2 + 10
        assert warm_pool_cap(wanted=64, sandboxes_in_use=0, max_warm=64) <= int(
            capacity.mem_available_mb() / measured) + 2
    finally:
        await asyncio.gather(destroy_sandbox(job_sandbox), destroy_sandbox(warm_sandbox))
    assert measure_job_sandboxes(root) is None  # nothing left to measure: the figure stands
    assert planned_sandbox_mb() == measured
