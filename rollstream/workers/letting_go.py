"""How a worker lets go of its jobs when SIGTERM comes (what scancel sends) or its node drains
(pipeline/drain.py): init takes no more work at once; run and eval serve on while the node's
earlier stages still hand them jobs, so a node stopped whole finishes what it holds; what is
still held at the deadline goes back to init (the consumer loop's shutdown)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis

from rollstream.pipeline.connection import transient_problem
from rollstream.workers.membership import Membership

log = logging.getLogger(__name__)

# Workers of the node's earlier stages, signalled at the same moment, say they drain first.
_SETTLE_S = 0.3
_CHECK_S = 0.2


class LettingGo:
    def __init__(self, membership: Membership, consumer: str, stopping: asyncio.Event, stop: Callable[[], None],
                 heartbeat: Callable[[], Awaitable[None]], inflight: dict):
        self.membership = membership
        self.consumer = consumer
        self.stopping, self.stop, self.heartbeat, self.inflight = stopping, stop, heartbeat, inflight
        self.deadline: float | None = None  # unix time by which the jobs are let go
        self.node_drains = False
        self.tasks: list[asyncio.Task] = []

    @property
    def draining(self) -> bool:
        return self.stopping.is_set() or self.deadline is not None

    def grace_s(self, default_s: float) -> float:
        """How long in-flight jobs may still run once the worker stopped reading."""
        return default_s if self.deadline is None else max(0.0, self.deadline - time.time())

    def node_drain_heard(self, deadline: float) -> None:
        if not self.node_drains:
            self.node_drains = True
            log.warning("%s: node %s drains", self.consumer, self.membership.node)
            self.by(deadline)

    def by(self, deadline: float) -> None:
        """Take no more work once nothing more can come from this node's earlier stages (init: at
        once); finish what is held by ``deadline``."""
        first = self.deadline is None
        self.deadline = deadline if self.deadline is None else min(deadline, self.deadline)
        if not first or self.stopping.is_set():
            return
        log.info("%s: letting go of its jobs within %.1f s", self.consumer, max(0.0, deadline - time.time()))
        self.tasks.append(asyncio.create_task(self._beat_now()))  # the node's others see it draining at once
        if not self.membership.upstream:
            self.stop()
        else:
            self.tasks.append(asyncio.create_task(self._stop_when_nothing_more_comes()))

    async def _beat_now(self) -> None:
        try:
            await self.heartbeat()
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: could not say it drains (%s); its next heartbeat will", self.consumer, exc)

    async def _stop_when_nothing_more_comes(self) -> None:
        await asyncio.sleep(_SETTLE_S)
        while not self.stopping.is_set():
            try:
                if self.deadline is not None and time.time() >= self.deadline:
                    log.info("%s: drain deadline reached with %d jobs in flight", self.consumer, len(self.inflight))
                    self.stop()
                elif await self.membership.nothing_more_comes(node_drains=self.node_drains):
                    log.info("%s: nothing more comes to %s on this node; stopping", self.consumer,
                             self.membership.stage)
                    self.stop()
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc) is None:
                    raise
            try:
                await asyncio.wait_for(self.stopping.wait(), _CHECK_S)
            except TimeoutError:
                pass
