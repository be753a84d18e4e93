"""What a task is: how its sandbox is set up (init), how the agent runs (run), and how
the result is scored (eval). Stage workers call these hooks; a task never sees a stream."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, ClassVar

from rollstream.messages import Envelope
from rollstream.trajectory import Trajectory


async def _never_cancelled() -> str | None:
    return None


@dataclass
class TaskContext:
    """What a stage hands a task's hooks: where it runs and the shared services of its
    worker process (sandbox factory, LLM session, ...), keyed by name."""

    node: str
    work_dir: Path
    cancelled: Callable[[], Awaitable[str | None]] = _never_cancelled
    services: dict[str, Any] = field(default_factory=dict)

    def service(self, name: str) -> Any:
        try:
            return self.services[name]
        except KeyError:
            raise RuntimeError(f"this worker has no '{name}' service; start it with the options "
                               f"that enable it (see 'rollstream worker --help')") from None


class Task(ABC):
    """A family of task instances. Subclasses set ``name`` and implement the hooks.

    ``setup`` may fill ``env.state`` and ``env.sandbox``; ``rollout`` returns the
    trajectory; ``score`` returns the reward; ``teardown`` frees whatever setup made and is
    called exactly when the job leaves the node (scored, cancelled, failed or restarted)."""

    name: ClassVar[str]

    def validate(self, instance: dict) -> None:
        """Raise ``InvalidJob`` with a clear message if ``instance`` cannot run."""

    @abstractmethod
    async def setup(self, env: Envelope, ctx: TaskContext) -> None: ...

    @abstractmethod
    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory: ...

    @abstractmethod
    async def score(self, env: Envelope, ctx: TaskContext) -> float: ...

    async def teardown(self, env: Envelope, ctx: TaskContext) -> None:
        """Free what ``setup`` made. Must be idempotent."""
