"""What the run stage gives every harness job, whichever kind (a Python callable, agent/harness.py;
a command in the sandbox, agent/sandbox_harness.py): the worker process's door server, the job's
LLM session behind it, and where the operator keeps presets of their own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.agent.backend_link import PooledVLLMClient
from rollstream.agent.gateway import Gateway
from rollstream.agent.llm_service import LLMService
from rollstream.agent.session import LLMSession
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import VLLMClient
from rollstream.messages import Job

if TYPE_CHECKING:  # the tasks' context names the services; the agent does not import the tasks
    from rollstream.tasks.base import ProcessServices


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


def job_session(llm: LLMService, services: ProcessServices, job: Job, settings: AgentSettings) -> LLMSession:
    """The job's LLM session (the run worker's balancer, so job and group affinity hold),
    speaking to vLLM-API backends through the door's pooled link (agent/backend_link.py)."""
    options: dict[str, Any] = {"max_backend_attempts": settings.max_backend_attempts,
                               "request_timeout_s": settings.request_timeout_s,
                               "backend_wait_s": settings.backend_wait_s}
    if type(llm.client) is not VLLMClient:  # another API (SGLang): its own client
        return llm.session(job.job_id, job.group_id, **options)
    if services.backend_link is None:
        services.backend_link = PooledVLLMClient(model=llm.client.model)
    return LLMSession(services.backend_link, job.job_id, job.group_id, balancer=llm.balancer, **options)
