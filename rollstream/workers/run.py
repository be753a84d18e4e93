"""The run stage: drives the task's rollout (the agent loop against inference servers and
tools) in the sandbox init made, and forwards the trajectory to this node's eval stream."""

from __future__ import annotations

from rollstream.messages import Envelope
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Forward, Stage


class RunStage(Stage):
    name = "run"

    async def process(self, env: Envelope, tctx: TaskContext) -> Forward:
        env.trajectory = await get_task(env.job.task).rollout(env, tctx)
        return Forward("eval")
