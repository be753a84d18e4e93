"""The init stage: takes jobs from the shared init stream, lets the task set up its
sandbox on this node, and forwards the job to this node's run stream."""

from __future__ import annotations

from rollstream.messages import Envelope, job_problem
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Forward, Stage


class InitStage(Stage):
    name = "init"
    limits_by_node_sandboxes = True  # a node pulls init work only while it has sandbox slots
    rescues_dead_nodes = True
    restarts_redelivered_jobs = False  # no sandbox exists yet: a redelivered job is just set up again

    def admission_problem(self, env: Envelope) -> str | None:
        # Init is the door of a message added to its stream by hand: the bounds the client
        # and the API check at submit are checked here once.
        return job_problem(env.job)

    async def process(self, env: Envelope, tctx: TaskContext) -> Forward:
        env.node = self.ctx.node
        await get_task(env.job.task).setup(env, tctx)
        return Forward("run")
