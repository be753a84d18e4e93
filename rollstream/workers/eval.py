"""The eval stage: connects to the job's sandbox, lets the task score the trajectory (a task that
runs tests verifies in a fresh sandbox it makes in the job's place: tasks/verification.py),
destroys the sandbox and delivers the result to the submitter's results stream. Its workers also
reap the node's sandboxes that no job wants any more."""

from __future__ import annotations

import asyncio
import logging

from rollstream.messages import Envelope, Result
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.node_reaper import reap_node
from rollstream.workers.stage import Stage, WorkerContext, completed_result

log = logging.getLogger(__name__)


class EvalStage(Stage):
    name = "eval"

    async def start_services(self, worker_id: str) -> list[asyncio.Task]:
        """The node's sandbox reaper: the eval pool tears sandboxes down, so it also reaps
        those whose jobs timed out or were orphaned."""
        return [asyncio.create_task(_reap_forever(self.ctx))]

    async def process(self, env: Envelope, tctx: TaskContext) -> Result:
        try:
            async with self.ctx.sandboxes.connected(env) as sandbox:
                tctx.sandbox, tctx.sandboxes = sandbox, self.ctx.sandboxes
                reward = float(await get_task(env.job.task).score(env, tctx))
        finally:
            await self.release(env, tctx)  # the job leaves the node: its task's teardown, then its sandbox
        return completed_result(env, reward)


async def _reap_forever(ctx: WorkerContext) -> None:
    while True:
        await asyncio.sleep(ctx.settings.reap_interval_s)
        try:
            await reap_node(ctx.redis, ctx.keys, ctx.node, ctx.sandboxes.root)
        except Exception:  # a failed round is retried next interval
            log.exception("sandbox reaping failed")
