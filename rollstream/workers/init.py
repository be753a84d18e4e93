"""The init stage: takes jobs from the shared init stream, lets the task set up its
sandbox on this node, and forwards the job to this node's run stream."""

from __future__ import annotations

from rollstream.messages import Envelope
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Forward, Stage


class InitStage(Stage):
    name = "init"

    async def process(self, env: Envelope, tctx: TaskContext) -> Forward:
        env.node = self.ctx.node
        await get_task(env.job.task).setup(env, tctx)
        return Forward("run")
