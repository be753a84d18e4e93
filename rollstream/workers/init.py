"""The init stage: takes jobs from the shared init stream (a node pulls them only while it
has sandbox slots free, best priority first), gives the job a sandbox on this node from its
task's spec (a warm one from warm_pool.py when one of that exact spec waits), lets the task
prepare it, and forwards the job to this node's run stream."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollstream.agent.harness_images import agent_spec
from rollstream.messages import Envelope, job_problem
from rollstream.pipeline.handoff import Forward
from rollstream.tasks.base import Task, TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.node_sandboxes import NodeSandboxes
from rollstream.workers.stage import Stage, WorkerContext
from rollstream.workers.warm_pool import WarmPool


class InitStage(Stage):
    name = "init"
    limits_by_node_sandboxes = True  # a node pulls init work only while it has sandbox slots
    rescues_dead_nodes = True
    serves_by_priority = True
    restarts_redelivered_jobs = False  # no sandbox exists yet: a redelivered job is just set up again

    def __init__(self, ctx: WorkerContext):
        super().__init__(ctx)
        # Sandboxes for the node's run slots that no job's sandbox fills yet.
        self.warm_pool = WarmPool(ctx.settings, ctx.redis, ctx.keys, ctx.sandboxes.root, stage=self.name,
                                  wanted=lambda slots, in_use: slots["run"] - in_use)
        if self.warm_pool.enabled:
            ctx.sandboxes = ctx.sandboxes.with_warm_pool(self.warm_pool)

    async def start_services(self, worker_id: str) -> list[asyncio.Task]:
        return [asyncio.create_task(self.warm_pool.run())] if self.warm_pool.enabled else []

    def admission_problem(self, env: Envelope) -> str | None:
        # Init is the door of a message added to its stream by hand: the bounds the client
        # and the API check at submit are checked here once.
        return job_problem(env.job)

    async def process(self, env: Envelope, tctx: TaskContext) -> Forward:
        env.node = self.ctx.node
        await set_up(get_task(env.job.task), env, tctx, self.ctx.sandboxes, self.ctx.settings.harness_preset_dirs)
        return Forward("run")


async def set_up(task: Task, env: Envelope, tctx: TaskContext, sandboxes: NodeSandboxes,
                 preset_dirs: list[Path] | None = None) -> None:
    """The job's sandbox, if its task wants one (a warm one of its exact spec if ``sandboxes``
    has a warm pool with one), then the task's own set-up in it. Should the set-up fail, the
    job's sandbox is in ``env`` already, so the stage's release destroys it."""
    tctx.sandboxes = sandboxes
    await task.prepare_environment(env, tctx)
    spec = task.sandbox_spec(env.job.instance)
    if spec is not None:
        # The agent's sandbox only: a preset job on podman/Docker starts from the harness layer of the
        # task's image (eval's fresh sandbox takes the task's spec, the pristine image).
        spec = await agent_spec(spec, sandboxes.resolved(env, spec), env.job.agent.get("harness"), preset_dirs)
        env.sandbox = await sandboxes.create(env, spec)
    async with sandboxes.connected(env) as sandbox:
        tctx.sandbox = sandbox
        await task.setup(env, tctx)
