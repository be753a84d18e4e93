"""What the run stage gives every harness job, whichever kind (a Python callable, agent/harness.py;
a command in the sandbox, agent/sandbox_harness.py): the worker process's door server, the job's
LLM session behind it, and where the operator keeps presets of their own."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.agent.gateway import Gateway, JobDoor
from rollstream.agent.services import ProcessServices
from rollstream.episode_settings import AgentSettings, agent_settings
from rollstream.llm.service import LLMService
from rollstream.llm.session import LLMSession
from rollstream.messages import Envelope
from rollstream.trajectory import Trajectory


def preset_dirs(services: ProcessServices) -> list[Path]:
    """The operator's preset folders (``harness_preset_dirs``), from the run worker's settings."""
    settings = services.llm.settings if services.llm is not None else None
    return list(getattr(settings, "harness_preset_dirs", None) or [])


async def worker_gateway(services: ProcessServices) -> Gateway:
    """The worker process's door server, started on first use."""
    if services.gateway is None:
        settings = services.llm.settings if services.llm is not None else None
        services.gateway = Gateway() if settings is None else Gateway(
            max_connections=settings.door_max_connections, read_timeout_s=settings.door_read_timeout_s,
            keepalive_s=settings.door_keepalive_s)
    return await services.gateway.start()


@dataclass
class HarnessDoor:
    """A harness run's door (a Python harness or a preset in the sandbox): the job's LLM session
    behind it, the limits it holds, and the trajectory its record becomes."""

    llm: LLMService
    settings: AgentSettings
    gateway: Gateway
    session: LLMSession
    door: JobDoor
    version_at_start: int
    started: float = field(default_factory=time.monotonic)

    async def close(self) -> None:
        self.gateway.close(self.door)
        await self.session.close()

    def trajectory(self, harness: str, finish: str, detail: str | None, answer: Any) -> Trajectory:
        """The door's exact record of the harness's calls, with how and why it ended."""
        door = self.door
        traj = door.recorder.trajectory()
        traj.finish_reason = finish  # type: ignore[assignment]
        if detail:
            traj.extra["finish_detail"] = detail
        if answer is not None:
            traj.extra["answer"] = answer
        traj.extra["harness"] = harness
        traj.extra["door"] = {"requests": door.requests, "refused": door.refused}
        traj.backend = self.session.backend
        if traj.policy_version == 0 and "policy_versions" not in traj.extra:
            traj.policy_version = self.version_at_start
        traj.response_text = self.llm.tokenizer.decode(traj.response_ids, skip_special_tokens=False)
        traj.timings_s.update({"llm_s": round(door.llm_s, 6), "total_s": round(time.monotonic() - self.started, 6)})
        return traj


async def open_harness_door(env: Envelope, services: ProcessServices) -> HarnessDoor:
    """Open the job's door on the worker's door server, with its session and settings."""
    job = env.job
    llm = services.need_llm()
    settings = agent_settings(job.agent, job.sampling)
    version_at_start = await llm.policy_version()
    gateway = await worker_gateway(services)
    session = llm.session(job.job_id, job.group_id, pooled=True, max_backend_attempts=settings.max_backend_attempts,
                          request_timeout_s=settings.request_timeout_s, backend_wait_s=settings.backend_wait_s)
    door = gateway.open(job.job_id, session, llm.tokenizer, settings)
    return HarnessDoor(llm, settings, gateway, session, door, version_at_start)
