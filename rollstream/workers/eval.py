"""The eval stage: scores the trajectory (often by running tests in the sandbox), tears
the sandbox down, and delivers the result to the submitter's results stream."""

from __future__ import annotations

from rollstream.messages import Envelope, Result
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Stage, completed_result


class EvalStage(Stage):
    name = "eval"

    async def process(self, env: Envelope, tctx: TaskContext) -> Result:
        task = get_task(env.job.task)
        try:
            reward = float(await task.score(env, tctx))
        finally:
            await task.teardown(env, tctx)
        return completed_result(env, reward)
