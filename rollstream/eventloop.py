"""Which event loop rollstream's own processes run on. uvloop where it is installed: a stage
hop is a few wake-ups and callbacks, and uvloop's loop spends about a fifth less CPU per job
than asyncio's (bench/pipeline.py). A library caller's loop is never replaced: this applies
to worker processes, the CLI and the synchronous client, which own their loops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """A new-loop function for ``choice`` ('auto', 'uvloop' or 'asyncio')."""
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event_loop must be 'auto', 'uvloop' or 'asyncio', not {choice!r}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise RuntimeError("event_loop='uvloop' but uvloop is not installed: pip install uvloop, "
                                   "or set ROLLSTREAM_EVENT_LOOP=auto") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run`` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
