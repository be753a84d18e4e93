"""Interrupting jobs at work in the consumer loop. Only work inside ``Stage.process`` is
ever interrupted, and always with a reason that decides how the job ends: a cancellation
(followed here from the notice stream, with the flags as a backstop), its timeout
(deadlines.py) or the worker's shutdown."""

from __future__ import annotations

import asyncio
import logging

import redis
import redis.asyncio as aioredis

from rollstream.messages import Envelope, Job
from rollstream.pipeline import cancel
from rollstream.pipeline.connection import Outage, raise_if_cancelled, transient_problem
from rollstream.pipeline.keys import Keys

log = logging.getLogger(__name__)


class Cancellations:
    """Which in-flight jobs are at work in their stage, why any of them was interrupted, and
    what this worker knows has been cancelled (``book``)."""

    def __init__(self, r: aioredis.Redis, keys: Keys, inflight: dict[str, tuple[asyncio.Task, Envelope | None]],
                 *, outage: Outage, consumer: str, ttl_s: float, read_block_ms: int):
        self.r = r
        self.keys = keys
        self.inflight = inflight  # the consumer loop's: message id -> (its task, its envelope)
        self.outage = outage
        self.consumer = consumer
        self.read_block_ms = read_block_ms
        self.book = cancel.CancelBook(ttl_s=ttl_s)
        self.at_work: set[str] = set()  # message ids inside Stage.process
        self.reasons: dict[str, str] = {}  # message id -> why its task was cancelled

    def interrupt(self, msg_id: str, reason: str) -> None:
        """Cancel the job's work in its stage, once, for ``reason``."""
        held = self.inflight.get(msg_id)
        if held is not None and msg_id in self.at_work and msg_id not in self.reasons:
            self.reasons[msg_id] = reason
            held[0].cancel()

    async def check(self, job: Job) -> str | None:
        """For tasks that check between steps (the agent loop between turns)."""
        return self.book.reason(job) or await cancel.check(self.r, self.keys, job)

    async def catch_up(self) -> None:
        await self.book.catch_up(self.r, self.keys)

    async def follow(self, stopping: asyncio.Event) -> None:
        """Tail the cancellation notices: the book learns them within a round trip, and
        jobs already at work are interrupted at once."""
        while not stopping.is_set():
            try:
                if await self.book.catch_up(self.r, self.keys, block_ms=self.read_block_ms):
                    self._interrupt_cancelled()
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc):
                    await asyncio.sleep(self.outage.failed(exc))
                    continue
                log.warning("%s: following cancellations failed (%s); retrying in 1 s", self.consumer, exc)
                await asyncio.sleep(1.0)
            raise_if_cancelled()

    def _interruptible(self) -> list[tuple[str, Job]]:
        """(message id, job) of the jobs at work that nothing has interrupted yet."""
        return [(m, env.job) for m, (_t, env) in list(self.inflight.items())
                if env is not None and m in self.at_work and m not in self.reasons]

    def _interrupt_cancelled(self) -> None:
        for msg_id, job in self._interruptible():
            reason = self.book.reason(job)
            if reason:
                self.interrupt(msg_id, reason)

    async def watch(self) -> None:
        """Backstop to the notices: flags raised without one (by hand with redis-cli) still
        stop jobs at work within a second."""
        jobs = self._interruptible()
        if not jobs:
            return
        reasons = await cancel.check_many(self.r, self.keys, [job for _m, job in jobs])
        for (msg_id, _job), reason in zip(jobs, reasons):
            if reason:
                self.interrupt(msg_id, reason)
