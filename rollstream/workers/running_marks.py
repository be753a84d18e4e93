"""The "running" mark in a job's state hash, for observers (status, tests, the reaper): sent
only for jobs still in their stage ``MARK_RUNNING_AFTER_S`` after the consumer loop admitted
them, in one batch that nobody waits for. Shorter stage work never needs the mark (its
hand-off writes the stage's start time and worker), which spares a Redis script call per
stage and job; observers see the mark this late."""

from __future__ import annotations

import asyncio
import logging

import redis
import redis.asyncio as aioredis

from rollstream.pipeline.connection import Outage, transient_problem
from rollstream.pipeline.jobstate import RunningMark, RunningMarks
from rollstream.pipeline.keys import Keys

log = logging.getLogger(__name__)

MARK_RUNNING_AFTER_S = 0.02


class LateRunningMarks:
    def __init__(self, r: aioredis.Redis, keys: Keys, *, outage: Outage, consumer: str):
        self.marks = RunningMarks(r, keys)
        self.outage = outage
        self.consumer = consumer
        # message id -> its mark: the marks not yet sent. The loop adds a batch's marks here,
        # then calls ``send_soon``.
        self.unsent: dict[str, RunningMark] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()  # sent without awaiting; kept from GC

    def send_soon(self) -> None:
        if self.unsent and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(MARK_RUNNING_AFTER_S, self._send)

    def left(self, msg_id: str) -> None:
        """The job left its stage: its mark, if still unsent, is not needed."""
        if self.unsent.pop(msg_id, None) is not None and not self.unsent and self._timer is not None:
            self._timer.cancel()  # every job of the batch left in time: no mark at all
            self._timer = None

    def _send(self) -> None:
        """Mark "running" the jobs admitted before now that are still at work (one batch)."""
        self._timer = None
        if self.unsent:
            batch, self.unsent = list(self.unsent.values()), {}
            task = asyncio.create_task(self._guarded(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _guarded(self, batch: list[RunningMark]) -> None:
        """A failure is logged, never raised: the marks are for observers."""
        try:
            await self.marks.mark(batch)
        except (redis.RedisError, OSError) as exc:
            if transient_problem(exc):
                self.outage.failed(exc)
            else:
                log.warning("%s: marking jobs running failed: %s", self.consumer, exc)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    async def aclose(self) -> None:
        await asyncio.gather(*self._sending, return_exceptions=True)
        await self.marks.aclose()
