"""Fixtures for the task tests: run a task's init and eval hooks on a real bubblewrap
sandbox without an LLM, as the stages run them (the sandbox made by init's set-up, connected
for eval, destroyed when the job leaves), standing in for the run stage with a given trajectory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from rollstream.messages import Envelope, Job
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.base import Task, TaskContext
from rollstream.trajectory import Trajectory
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes
from rollstream.workers.process import serve_stage

needs_bwrap = pytest.mark.skipif(not BwrapBackend().available(), reason="bubblewrap (bwrap) is not usable here")


@pytest.fixture
def task_ctx(tmp_path) -> TaskContext:
    return TaskContext(node="n", work_dir=tmp_path / "work")


@pytest.fixture
def node_sandboxes(sandbox_root) -> NodeSandboxes:
    return NodeSandboxes(root=str(sandbox_root))


class Episode:
    """One job through the stages' hands on a task, without Redis or an LLM: ``await
    ep.setup()`` as init does it (the sandbox included), act on ``ep.client()``, ``await
    ep.score(answer=...)`` as eval scores; the job leaves the node at the end of the test."""

    def __init__(self, task: Task, instance: dict, ctx: TaskContext, sandboxes: NodeSandboxes, job: Job | None = None):
        self.task = task
        self.ctx = ctx
        self.sandboxes = sandboxes
        self.env = Envelope(job=job or Job(task=task.name, instance=instance))

    async def setup(self) -> Episode:
        self.task.validate(self.env.job.instance)
        await set_up(self.task, self.env, self.ctx, self.sandboxes)
        return self

    def client(self) -> SandboxClient:
        return SandboxClient(self.env.sandbox.socket_path)

    async def score(self, answer=None, response_text: str = "") -> float:
        extra = {} if answer is None else {"answer": answer}
        self.env.trajectory = Trajectory(extra=extra, response_text=response_text)
        async with self.sandboxes.connected(self.env) as sandbox:
            self.ctx.sandbox, self.ctx.sandboxes = sandbox, self.sandboxes
            return await self.task.score(self.env, self.ctx)

    @property
    def reason(self) -> str:
        return self.env.trajectory.extra["eval"]["reason"]

    async def teardown(self) -> None:
        try:
            await self.task.teardown(self.env, self.ctx)
        finally:
            await self.sandboxes.destroy(self.env)


@pytest.fixture
async def episode(task_ctx, node_sandboxes):
    made: list[Episode] = []

    async def make(task: Task, instance: dict, backend: str = "auto", job: Job | None = None) -> Episode:
        """``job``: the whole job (its sandbox overrides, say) when the instance alone is not enough."""
        ep = Episode(task, instance, task_ctx, replace(node_sandboxes, backend=backend), job)
        made.append(ep)
        return await ep.setup()

    yield make
    for ep in made:
        await ep.teardown()


def data_file(name: str) -> Path:
    import rollstream

    return Path(rollstream.__file__).parent / "data" / "tasks" / name


@pytest.fixture
def pipeline_settings(settings):
    """The test's settings with a sandbox root of its own, short (Unix socket paths) and
    reachable by the sandboxes' own uids."""
    root = tempfile.mkdtemp(prefix="rs-p-", dir="/tmp")
    os.chmod(root, 0o711)
    yield settings.model_copy(update={"sandbox_root": root})
    shutil.rmtree(root, ignore_errors=True)


@contextlib.asynccontextmanager
async def workers(settings):
    """An init, a run and an eval worker in this process, for the block's duration."""
    tasks = [asyncio.create_task(serve_stage(stage, settings, 8)) for stage in ("init", "run", "eval")]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
