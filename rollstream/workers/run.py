"""The run stage: starts the process's LLM service (backend leases through the balancer),
connects to the sandbox init made for the job, drives the task's rollout in it (the agent loop
against inference servers and tools) and forwards the trajectory to this node's eval stream.
While the rollout runs, the sandbox is kept from its idle timeout: an agent that only thinks
(or a harness that waits on its model) has not left its sandbox."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import stat

from rollstream.llm.service import LLMService
from rollstream.messages import Envelope
from rollstream.pipeline.handoff import Forward
from rollstream.sandbox_spec import SandboxHandle
from rollstream.sandboxes.errors import SandboxGone, ToolError
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.stage import Stage

log = logging.getLogger(__name__)

# Pings per idle timeout: the supervisor checks its idleness once a second.
_PINGS_PER_IDLE_TIMEOUT = 4
_FALLBACK_KEEPALIVE_S = 1.0
_MAX_PLAN_BYTES = 1 << 20


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
            handle = self.ctx.sandboxes.handle(env)
            keeper = None if sandbox is None or handle is None else \
                asyncio.ensure_future(_keep_alive(sandbox, handle, env.job.job_id))
            try:
                env.trajectory = await get_task(env.job.task).rollout(env, tctx)
            finally:
                if keeper is not None:
                    keeper.cancel()
        return Forward("eval")


def _keepalive_interval_s(handle: SandboxHandle) -> float:
    """How often to ping the sandbox so that its supervisor never sees it idle: a fraction of
    the idle timeout its plan holds (the limits the job's sandbox was made with)."""
    try:
        # A regular file of bounded size, never through a link: nothing in the folder stalls the worker.
        fd = os.open(os.path.join(handle.dir, "plan.json"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as plan:
            if not stat.S_ISREG(os.fstat(plan.fileno()).st_mode):
                return _FALLBACK_KEEPALIVE_S
            idle_s = float(json.loads(plan.read(_MAX_PLAN_BYTES))["idle_timeout_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return _FALLBACK_KEEPALIVE_S
    return max(0.2, idle_s / _PINGS_PER_IDLE_TIMEOUT) if math.isfinite(idle_s) else _FALLBACK_KEEPALIVE_S


async def _keep_alive(sandbox: SandboxClient, handle: SandboxHandle, job_id: str) -> None:
    """Ping the job's sandbox while its rollout runs (cancelled when it ends)."""
    interval_s = _keepalive_interval_s(handle)
    while True:
        try:
            await sandbox.ping()
        except (SandboxGone, ToolError) as exc:  # the rollout's next tool call reports the loss
            log.warning("the job's sandbox stopped answering its keep-alive: %s", exc, extra={"job_id": job_id})
            return
        await asyncio.sleep(interval_s)
