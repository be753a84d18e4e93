"""How the stages reach the sandboxes of this node: init creates a job's sandbox here
(workers/init.py; warm_pool.py keeps some ready), run and eval connect to it, and the stage a job
leaves the node from destroys it. A handle read from a stream is never trusted: its paths are rebuilt from its id."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rollstream.config import Settings
from rollstream.errors import JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxHandle, SandboxSpec
from rollstream.sandboxes.errors import SandboxServiceFailed, SandboxSetupError
from rollstream.sandboxes.lifecycle import checked_handle, create_sandbox, destroy_sandbox
from rollstream.sandboxes.paths import sandbox_id_for
from rollstream.sandboxes.policy import OverridePolicy
from rollstream.sandboxes.roots import namespace_root_dir
from rollstream.sandboxes.sandbox_client import SandboxClient

if TYPE_CHECKING:
    from rollstream.workers.warm_pool import WarmPool


@dataclass(frozen=True)
class NodeSandboxes:
    """Where this node keeps its jobs' sandboxes (``root``), the backend for task specs that
    leave it to the node, and the operator's policy over what a job's overrides may change."""

    root: str
    backend: str = "auto"
    policy: OverridePolicy = field(default_factory=OverridePolicy)
    warm_pool: WarmPool | None = field(default=None, compare=False)  # the stage's, when it keeps one

    @classmethod
    def from_settings(cls, settings: Settings) -> NodeSandboxes:
        return cls(
            namespace_root_dir(settings.namespace, settings.sandbox_root),
            settings.sandbox_backend,
            OverridePolicy.from_settings(settings),
        )

    def with_warm_pool(self, pool: WarmPool) -> NodeSandboxes:
        return replace(self, warm_pool=pool)

    def handle(self, env: Envelope) -> SandboxHandle | None:
        """The job's sandbox, its folder and socket rebuilt from its id under ``root``."""
        return checked_handle(env.sandbox, self.root) if env.sandbox is not None else None

    def connected(self, env: Envelope) -> SandboxClient | NoSandbox:
        """``async with`` it: a client connected to the job's sandbox for the duration, or None
        if it has none (every stage hop of a sandbox-less job passes here: no generator-based
        context manager, whose set-up costs more than the rest of such a hop's stage work)."""
        handle = self.handle(env)
        return NO_SANDBOX if handle is None else SandboxClient(handle.socket_path)

    async def create(self, env: Envelope, spec: SandboxSpec) -> SandboxHandle:
        """The sandbox of this attempt of the job from the task's spec (``resolved``): a ready one
        of exactly that spec from the stage's warm pool, else one started now."""
        spec = self.resolved(env, spec)
        if self.warm_pool is not None:
            warm = await self.warm_pool.take(spec, env.job.job_id)
            if warm is not None:
                return warm
        return await self.start(env, spec)

    def resolved(self, env: Envelope, spec: SandboxSpec) -> SandboxSpec:
        """The spec the job's sandbox is made from: the task's spec on the node's backend (where
        the spec leaves it to the node), with the job's overrides as the operator's policy allows
        them (a refused override fails the job at once: InvalidJob)."""
        if spec.backend == "auto" and self.backend != "auto":
            spec = spec.model_copy(update={"backend": self.backend})
        return self.policy.apply(spec, env.job.sandbox)

    async def start(self, env: Envelope, spec: SandboxSpec) -> SandboxHandle:
        """Start the sandbox of this attempt of the job from a ``resolved`` spec."""
        try:
            return await create_sandbox(
                spec, sandbox_id=sandbox_id_for(env.job.job_id, env.attempt), owner=env.job.job_id, root_dir=self.root
            )
        except SandboxSetupError as exc:  # the job's own environment recipe fails: not the service's fault
            raise JobFailed(str(exc), failure="job") from exc
        except SandboxServiceFailed as exc:  # the task's own service exited or stayed unhealthy: again, it would too
            raise JobFailed(str(exc), retryable=False, failure="task") from exc

    async def destroy(self, env: Envelope) -> None:
        """Stop the job's sandbox and remove its folder; idempotent."""
        handle = self.handle(env)
        if handle is not None:
            await destroy_sandbox(handle)


class NoSandbox:
    """What ``connected`` gives for a job without a sandbox: entered, it is None."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


NO_SANDBOX = NoSandbox()
