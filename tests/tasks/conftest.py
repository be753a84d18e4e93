"""Fixtures for the task tests: run a task's init and eval hooks on a real bubblewrap
sandbox without an LLM, standing in for the run stage with a given trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.messages import Envelope, Job
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.tasks.base import Task, TaskContext
from rollstream.trajectory import Trajectory

needs_bwrap = pytest.mark.skipif(not BwrapBackend().available(), reason="bubblewrap (bwrap) is not usable here")


@pytest.fixture
def task_ctx(sandbox_root, tmp_path) -> TaskContext:
    return TaskContext(node="n", work_dir=tmp_path / "work", services={"sandbox_root": sandbox_root})


class Episode:
    """One job through a task's hooks: ``await ep.setup()``, act on ``ep.sandbox()``,
    ``await ep.score(answer=...)``; teardown always runs at the end of the test."""

    def __init__(self, task: Task, instance: dict, ctx: TaskContext):
        self.task = task
        self.ctx = ctx
        self.env = Envelope(job=Job(task=task.name, instance=instance))

    async def setup(self) -> "Episode":
        self.task.validate(self.env.job.instance)
        await self.task.setup(self.env, self.ctx)
        return self

    def client(self):
        from rollstream.sandboxes import SandboxClient

        return SandboxClient(self.env.sandbox.socket_path)

    async def score(self, answer=None, response_text: str = "") -> float:
        extra = {} if answer is None else {"answer": answer}
        self.env.trajectory = Trajectory(extra=extra, response_text=response_text)
        return await self.task.score(self.env, self.ctx)

    @property
    def reason(self) -> str:
        return self.env.trajectory.extra["eval"]["reason"]

    async def teardown(self) -> None:
        await self.task.teardown(self.env, self.ctx)


@pytest.fixture
async def episode(task_ctx):
    made: list[Episode] = []

    async def make(task: Task, instance: dict) -> Episode:
        ep = Episode(task, instance, task_ctx)
        made.append(ep)
        return await ep.setup()

    yield make
    for ep in made:
        await ep.teardown()


def data_file(name: str) -> Path:
    import rollstream

    return Path(rollstream.__file__).parent / "data" / "tasks" / name
