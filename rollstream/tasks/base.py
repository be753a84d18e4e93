"""What a task is: the sandbox its jobs need, if any (``sandbox_spec``), and the hooks the
stages call: ``setup`` (init), ``rollout`` (run), ``score`` (eval) and ``teardown`` (whichever
stage the job leaves the node from). The stages own the sandbox's life: init creates it from
the spec, run and eval connect to it and hand the hooks the connected client as
``ctx.sandbox``, and the job's last stage on the node destroys it. A task never sees a stream."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from rollstream.agent.services import ProcessServices
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxHandle, SandboxSpec
from rollstream.trajectory import Trajectory

if TYPE_CHECKING:
    from rollstream.sandboxes.sandbox_client import SandboxClient


class Sandboxes(Protocol):
    """The node's sandboxes as a task reaches them (the stages' are workers/node_sandboxes.py):
    the backend a spec that leaves it to the node gets, a job's sandbox, and a fresh one for it."""

    @property
    def backend(self) -> str: ...

    def handle(self, env: Envelope) -> SandboxHandle | None:
        """The job's sandbox, or None if it has none."""

    async def create(self, env: Envelope, spec: SandboxSpec) -> SandboxHandle:
        """A sandbox for this attempt of the job, from the task's spec."""

    async def destroy(self, env: Envelope) -> None:
        """Stop the job's sandbox and remove its folder; idempotent."""


async def _never_cancelled() -> str | None:
    return None


@dataclass
class TaskContext:
    """What a stage hands a task's hooks: where it runs, the job's sandbox (connected by the
    stage; None for a task without one), the shared services of its worker process, and the
    node's sandboxes (set by eval: a task that verifies in a fresh sandbox makes it there)."""

    node: str
    work_dir: Path
    cancelled: Callable[[], Awaitable[str | None]] = _never_cancelled
    services: ProcessServices = field(default_factory=ProcessServices)
    sandbox: SandboxClient | None = None
    sandboxes: Sandboxes | None = None


class Task(ABC):
    """A family of task instances. Subclasses set ``name`` and implement the hooks.

    ``setup`` may fill ``env.state``; ``rollout`` returns the trajectory; ``score`` returns
    the reward; ``teardown`` frees whatever ``setup`` made outside the sandbox and is called
    exactly when the job leaves the node (scored, cancelled, failed or restarted)."""

    name: ClassVar[str]

    def validate(self, instance: dict) -> None:
        """Raise ``InvalidJob`` with a clear message if ``instance`` cannot run."""

    def sandbox_spec(self, instance: dict) -> SandboxSpec | None:
        """The sandbox a job of this instance runs in, or None for a task that needs none."""
        return None

    async def prepare_environment(self, env: Envelope, ctx: TaskContext) -> None:
        """Make what ``sandbox_spec`` names exist on this node (an environment image built once),
        before init creates the sandbox; ``ctx.sandboxes`` is the node's. Blocking work goes to a
        thread."""

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        """Prepare the job on this node, once its sandbox (if any) runs."""

    @abstractmethod
    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory: ...

    @abstractmethod
    async def score(self, env: Envelope, ctx: TaskContext) -> float: ...

    async def teardown(self, env: Envelope, ctx: TaskContext) -> None:
        """Free what ``setup`` made outside the sandbox (the stage destroys the sandbox). Must
        be idempotent."""
