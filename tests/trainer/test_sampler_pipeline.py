"""Dynamic sampling on the real pipeline: in-process init/run/eval workers on the session
redis-server, a task whose jobs each hold a bubblewrap sandbox. When the batch is full the
redundant groups are cancelled in Redis and their sandboxes are torn down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.messages import Envelope
from rollstream.sandboxes import SandboxSpec
from rollstream.tasks.base import Task, TaskContext
from rollstream.tasks.registry import register_task
from rollstream.trainer.sampler import DynamicSampler, SamplerConfig
from rollstream.trainer.source import ClientRolloutSource
from rollstream.trajectory import Trajectory
from rollstream.workers.process import serve_stage

SUPERVISORS: dict[str, int] = {}  # job id -> sandbox supervisor pid, filled by setup


@register_task
class SandboxedLotteryTask(Task):
    """Each job holds a sandbox from init until it leaves the node; its rollout lasts `run_s`;
    its reward is drawn from the job id, so the members of a group (almost surely) differ."""

    name = "trainer-sandboxed-lottery"

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(backend=instance.get("backend", "auto"), allow_unisolated=True)

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        SUPERVISORS[env.job.job_id] = env.sandbox.supervisor_pid

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        await asyncio.sleep(float(env.job.instance["run_s"]))
        return Trajectory(prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], logprobs=[-0.5, -0.5])

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        return (int(env.job.job_id, 16) % 1000) / 1000


@contextlib.asynccontextmanager
async def _workers(settings: Settings):
    tasks = [asyncio.create_task(serve_stage(stage, settings, 64)) for stage in ("init", "run", "eval")]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def sandbox_root():
    root = Path(tempfile.mkdtemp(prefix="rs-tr-", dir="/tmp"))  # short: unix socket paths are limited
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(120)
async def test_full_batch_cancels_redundant_jobs_in_redis_and_their_sandboxes_are_gone(settings, sandbox_root):
    root = sandbox_root
    backend = "auto" if os.path.exists("/usr/bin/bwrap") else "local"
    settings = settings.model_copy(update={"sandbox_root": root})  # the workers' sandboxes, in the test's folder
    fast = [{"run_s": 0.1, "backend": backend}] * 3
    slow = [{"run_s": 60, "backend": backend}] * 4
    config = SamplerConfig(groups_per_batch=2, group_size=2, max_in_flight_groups=7, initial_keep_rate=0.2,
                           result_timeout_s=60)
    async with AsyncClient(settings=settings, submitter="trainer-test") as client, _workers(settings):
        source = ClientRolloutSource(client, SandboxedLotteryTask.name, poll_timeout_s=1.0)
        sampler = DynamicSampler(source, fast + slow, config)
        batch = await sampler.next_batch(policy_version=0)
        assert len(batch.groups) == 2
        assert all(g.prompt_index < 3 for g in batch.groups)  # only fast prompts can have finished
        assert batch.stats.submitted == 7 and batch.stats.cancelled == 5
        kept = {g.group_id for g in batch.groups}

        # every job of a cancelled slow group ends 'cancelled', in the results and in its state hash
        results = []
        async for result in client.results(timeout_s=20):
            results.append(result)
            slow_done = [r for r in results if r.group_id not in kept and r.status == "cancelled"]
            if len(slow_done) >= 8:
                break
        cancelled_jobs = [r.job_id for r in results if r.status == "cancelled"]
        assert len(cancelled_jobs) >= 8
        for job_id in cancelled_jobs:
            state = await client.status(job_id)
            assert state is not None and state.status == "cancelled"

        # ... and no sandbox (folder or supervisor process) is left behind once the
        # stages have finished with the cancelled jobs
        for _ in range(300):
            leftovers = [p for p in root.iterdir() if not p.name.startswith(".")] if root.exists() else []
            if not leftovers:
                break
            await asyncio.sleep(0.1)
        assert leftovers == []
    assert set(cancelled_jobs) & set(SUPERVISORS), "cancelled jobs never had a sandbox: the test proves nothing"
    for _ in range(50):
        if not any(_alive(SUPERVISORS[j]) for j in cancelled_jobs if j in SUPERVISORS):
            break
        await asyncio.sleep(0.1)
    assert not [j for j in cancelled_jobs if j in SUPERVISORS and _alive(SUPERVISORS[j])]
