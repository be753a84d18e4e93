"""A worker's membership: its consumer in the stage's group, its entry in the workers list
and its hash (what ``rollstream status`` shows), kept fresh by heartbeats that also tell
reclaimers its in-flight messages are alive, and removed when it stops."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import redis

from rollstream.pipeline.connection import Outage
from rollstream.pipeline.groups import ensure_group, remove_idle_consumer
from rollstream.workers.stage import WorkerContext

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, ctx: WorkerContext, stage: str, stream: str, consumer: str, concurrency: int,
                 outage: Outage):
        self.r = ctx.redis
        self.keys = ctx.keys
        self.settings = ctx.settings
        self.node = ctx.node
        self.stage = stage
        self.stream = stream
        self.group = stage
        self.consumer = consumer
        self.concurrency = concurrency
        self.outage = outage

    async def join(self) -> None:
        """Create the stage's group (where a deleted stream took it) and announce this worker."""
        await ensure_group(self.r, self.stream, self.group)
        await self.heartbeat([], 0)

    async def heartbeat(self, inflight_ids: list[str], processed: int) -> None:
        now = time.time()
        keys = self.keys
        async with self.r.pipeline(transaction=False) as pipe:
            if inflight_ids:  # resetting idle time tells reclaimers these are alive
                pipe.xclaim(self.stream, self.group, self.consumer, 0, inflight_ids, justid=True)
            pipe.zadd(keys.workers, {self.consumer: now})
            # Workers that stopped heart-beating (killed, their machine gone) leave the list.
            pipe.zremrangebyscore(keys.workers, "-inf", now - self.settings.worker_ttl_s)
            pipe.zadd(keys.nodes, {self.node: now})
            pipe.hset(keys.worker(self.consumer), mapping={
                "stage": self.stage, "node": self.node, "pid": os.getpid(), "concurrency": self.concurrency,
                "inflight": len(inflight_ids), "processed": processed, "heartbeat_at": now,
                "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0]})
            pipe.expire(keys.worker(self.consumer), int(self.settings.worker_ttl_s * 3) + 1)
            await pipe.execute()
        self.outage.recovered()  # Redis took these writes (a read loop held by back-pressure may not tell)

    async def leave(self) -> None:
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.workers, self.consumer)
                pipe.delete(self.keys.worker(self.consumer))
                await pipe.execute()
            await remove_idle_consumer(self.r, self.stream, self.group, self.consumer)
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: could not deregister (%s)", self.consumer, exc)
