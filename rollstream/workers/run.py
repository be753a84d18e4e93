"""The run stage: starts the process's LLM service (backend leases through the balancer),
connects to the sandbox init made for the job, drives the task's rollout in it (the agent loop
against inference servers and tools) and forwards the trajectory to this node's eval stream."""

from __future__ import annotations

import asyncio

from rollstream.agent.llm_service import LLMService
from rollstream.messages import Envelope
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Forward, Stage


class RunStage(Stage):
    name = "run"

    async def start_services(self, worker_id: str) -> list[asyncio.Task]:
        """The LLM service, shared by the process's jobs (closed with the process's services)."""
        llm = LLMService(self.ctx.redis, self.ctx.settings, worker_id=worker_id)
        await llm.start()
        self.ctx.services.llm = llm
        return []

    async def process(self, env: Envelope, tctx: TaskContext) -> Forward:
        async with self.ctx.sandboxes.connected(env) as sandbox:
            tctx.sandbox = sandbox
            env.trajectory = await get_task(env.job.task).rollout(env, tctx)
        return Forward("eval")
