"""Job timeouts in the consumer loop: a job's ``timeout_s`` counts its time at work in
stages (not in queues, see ``fate.active_s``), so each stage starts a job with what is left
of it as a deadline, and interrupts it when that runs out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# The interrupt reason of a job whose timeout_s ran out while its stage worked on it.
TIMED_OUT = "timed out"


class Deadlines:
    """When each job at work runs out of its time (loop time), and the one timer that serves
    them all (a timer per job would cost more than a fast job's stage). ``on_due(msg_id)`` is
    called for each job whose deadline passes before it is cleared."""

    def __init__(self, on_due: Callable[[str], None]):
        self._on_due = on_due
        self._due: dict[str, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def set(self, msg_id: str, remaining_s: float) -> None:
        loop = asyncio.get_running_loop()
        due = self._due[msg_id] = loop.time() + remaining_s
        timer = self._timer
        if timer is None or due < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(due, self._expire)

    def clear(self, msg_id: str) -> None:
        self._due.pop(msg_id, None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        """Report the jobs whose time ran out; wait for the next deadline."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now, earliest = loop.time(), None
        for msg_id, due in list(self._due.items()):
            if due > now:
                earliest = due if earliest is None else min(earliest, due)
                continue
            del self._due[msg_id]
            self._on_due(msg_id)
        if earliest is not None:
            self._timer = loop.call_at(earliest, self._expire)
