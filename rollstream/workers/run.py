"""The run stage: drives the task's rollout (the agent loop against inference servers and
tools) in the sandbox init made, and forwards the trajectory to this node's eval stream."""

from __future__ import annotations

import asyncio

from rollstream.messages import Envelope
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Forward, Stage


class RunStage(Stage):
    name = "run"

    async def start_services(self, worker_id: str) -> list[asyncio.Task]:
        """The LLM service: backend leases through the balancer, shared by the process's jobs."""
        from rollstream.workers.llm_service import LLMService

        llm = LLMService(self.ctx.redis, self.ctx.settings, worker_id=worker_id)
        await llm.start()
        self.ctx.services["llm"] = llm
        return []

    async def process(self, env: Envelope, tctx: TaskContext) -> Forward:
        env.trajectory = await get_task(env.job.task).rollout(env, tctx)
        return Forward("eval")
