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
from rollstream.workers.stage import Stage, WorkerContext
from rollstream.workers.warm_pool import WarmPool

log = logging.getLogger(__name__)


class EvalStage(Stage):
    name = "eval"

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        # Fresh sandboxes for tasks that verify in one (tasks/verification.py), started while
        # the agents still work, so verification only copies the changes in and runs the tests.
        # As many as the node's jobs in progress, each of which may verify; a taken one takes the
        # place of the job's own sandbox (destroyed just before) in the count and the job's state.
        self.warm_pool = WarmPool(ctx.settings, ctx.redis, ctx.keys, ctx.sandboxes.root, stage=self.name,
                                  wanted=lambda slots, in_use: in_use, replaces_job_sandbox=True)
        if self.warm_pool.enabled:
            ctx.sandboxes = ctx.sandboxes.with_warm_pool(self.warm_pool)

    async def start_services(self, worker_id: str) -> list[asyncio.Task]:
        """The node's sandbox reaper: the eval pool tears sandboxes down, so it also reaps
        those whose jobs timed out or were orphaned; and its warm pool."""
        tasks = [asyncio.create_task(_reap_forever(self.ctx))]
        if self.warm_pool.enabled:
            tasks.append(asyncio.create_task(self.warm_pool.run()))
        return tasks

    async def process(self, env: Envelope, tctx: TaskContext) -> Result:
        try:
            async with self.ctx.sandboxes.connected(env) as sandbox:
                tctx.sandbox, tctx.sandboxes = sandbox, self.ctx.sandboxes
                reward = float(await get_task(env.job.task).score(env, tctx))
        finally:
            await self.release(env, tctx)  # the job leaves the node: its task's teardown, then its sandbox
        return Result.completed(env, reward)


async def _reap_forever(ctx: WorkerContext) -> None:
    while True:
        await asyncio.sleep(ctx.settings.reap_interval_s)
        try:
            await reap_node(ctx.redis, ctx.keys, ctx.node, ctx.sandboxes.root)
        except Exception:  # a failed round is retried next interval
            log.exception("sandbox reaping failed")
