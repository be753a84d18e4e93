"""The services a worker process shares among its jobs' hooks (``TaskContext.services``): the
run stage's LLM service, and for harness jobs the door server. Here beside the door that starts
it, so the agent names them without importing the tasks; a task's context imports this module,
which loads neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # names for the fields' types only: importing a task must not load the HTTP clients
    from rollstream.agent.gateway import Gateway
    from rollstream.llm.service import LLMService


@dataclass
class ProcessServices:
    """The services a worker process shares among its jobs' hooks: the LLM service that the run
    stage starts, and for harness jobs the door server, started on first use
    (agent/door_service.py). Init and eval workers leave them empty."""

    llm: LLMService | None = None
    gateway: Gateway | None = None

    def need_llm(self) -> LLMService:
        """The LLM service, or an error that says how to have one."""
        if self.llm is None:
            raise RuntimeError("this worker has no LLM service: only run workers start one "
                               "(see 'rollstream worker --help')")
        return self.llm

    async def aclose(self) -> None:
        """Close the LLM service's clients; the door server's socket goes with the process (closing
        it waits for connections a harness may still hold open)."""
        if self.llm is not None:
            await self.llm.aclose()
