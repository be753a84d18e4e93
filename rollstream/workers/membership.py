"""A worker's membership: its consumer in the stage's group, its entry in the workers list
and its hash (what ``rollstream status`` shows, draining or not), kept fresh by heartbeats that
also tell reclaimers its in-flight messages are alive and bring back a drain request for its
node (pipeline/drain.py), and removed when it stops; the last worker of a node to leave hands
what is still queued there back to init. And the reclaim of messages that consumers which
stopped heart-beating left pending."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import cast

import redis
from redis.typing import StreamIdT

from rollstream.messages import STAGES, StageName
from rollstream.pipeline.connection import Outage
from rollstream.pipeline.drain import node_members, node_workers
from rollstream.pipeline.groups import autoclaim, ensure_group, remove_idle_consumer
from rollstream.pipeline.rescue import rescue_node
from rollstream.pipeline.workerstate import WorkerRecord
from rollstream.workers.stage import WorkerContext

log = logging.getLogger(__name__)


def message_id(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class Membership:
    def __init__(self, ctx: WorkerContext, stage: StageName, stream: str, consumer: str, concurrency: int,
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

    async def heartbeat(self, inflight_ids: list[str], processed: int, draining: bool = False) -> float | None:
        """Refresh this worker's liveness and in-flight messages; returns the deadline of a drain
        of its node, if one was asked for."""
        now = time.time()
        keys = self.keys
        async with self.r.pipeline(transaction=False) as pipe:
            if inflight_ids:  # resetting idle time tells reclaimers these are alive
                # redis-py types message_ids as an invariant list of its id union: a list[str] is one
                pipe.xclaim(self.stream, self.group, self.consumer, 0, cast(list[StreamIdT], inflight_ids), justid=True)
            pipe.zadd(keys.workers, {self.consumer: now})
            # Workers that stopped heart-beating (killed, their machine gone) leave the list.
            pipe.zremrangebyscore(keys.workers, "-inf", now - self.settings.worker_ttl_s)
            pipe.zadd(keys.nodes, {self.node: now})
            event_loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
            record = WorkerRecord(stage=self.stage, node=self.node, pid=os.getpid(), concurrency=self.concurrency,
                                  inflight=len(inflight_ids), processed=processed, heartbeat_at=now,
                                  draining=draining, event_loop=event_loop)
            pipe.hset(keys.worker(self.consumer), mapping=record.hash_fields())
            pipe.expire(keys.worker(self.consumer), int(self.settings.worker_ttl_s * 3) + 1)
            pipe.get(keys.drain(self.node))
            replies = await pipe.execute()
        self.outage.recovered()  # Redis took these writes (a read loop held by back-pressure may not tell)
        return float(replies[-1]) if replies[-1] else None

    @property
    def upstream(self) -> tuple[str, ...]:
        """The stages that feed this one on this node (none for init: its stream is shared)."""
        return STAGES[:STAGES.index(self.stage)] if self.stage in STAGES else ()

    async def nothing_more_comes(self, *, node_drains: bool) -> bool:
        """Whether a stopping worker of a stage fed by earlier ones on this node may stop reading:
        another worker of its stage here serves on; or no earlier stage's worker here will still
        hand it jobs (while the node drains, any live one may; otherwise those that are stopping
        themselves and finish theirs) and its stream holds nothing undelivered."""
        members = await node_members(self.r, self.keys, self.node, self.settings.worker_ttl_s)
        if any(m.stage == self.stage and m.name != self.consumer and not m.draining for m in members):
            return True
        if any(m.stage in self.upstream and (node_drains or m.draining) for m in members):
            return False
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.xlen(self.stream)
            pipe.xpending(self.stream, self.group)
            length, pending = await pipe.execute()
        return length - pending["pending"] <= 0  # hand-offs delete what they acknowledge

    async def reclaim(self, count: int) -> list[tuple[str, dict, int]]:
        """Up to ``count`` messages left idle past the visibility timeout (their consumer died
        or hung), now pending with this one, as (id, fields, deliveries so far)."""
        claimed, deleted = await autoclaim(self.r, self.stream, self.group, self.consumer,
                                           int(self.settings.visibility_timeout_s * 1000), count)
        if deleted:
            await self.r.xack(self.stream, self.group, *deleted)
        if not claimed:
            return []
        ids = [message_id(m) for m, _fields in claimed]
        # Delivery counts of everything claimed, in one round trip (off the critical path).
        async with self.r.pipeline(transaction=False) as pipe:
            for msg_id in ids:
                pipe.xpending_range(self.stream, self.group, min=msg_id, max=msg_id, count=1)
            infos = await pipe.execute()
        entries = []
        for msg_id, (_m, fields), info in zip(ids, claimed, infos):
            deliveries = info[0]["times_delivered"] if info else self.settings.max_deliveries + 1
            log.info("%s reclaimed %s (delivery %d)", self.consumer, msg_id, deliveries)
            entries.append((msg_id, fields, deliveries))  # autoclaim keeps only entries with fields
        return entries

    async def leave(self) -> None:
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.workers, self.consumer)
                pipe.delete(self.keys.worker(self.consumer))
                await pipe.execute()
            await remove_idle_consumer(self.r, self.stream, self.group, self.consumer)
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: could not deregister (%s)", self.consumer, exc)

    async def hand_back_node_if_last(self, ctx: WorkerContext) -> None:
        """After leaving: if no worker of this node is left, move what is still queued or held on
        its run and eval streams back to init at once (rather than once the node's heartbeat is
        worker_ttl_s old), and take the node off the live list."""
        try:
            if await node_workers(self.r, self.keys, self.node, self.settings.worker_ttl_s):
                return
            moved = await rescue_node(self.r, self.keys, ctx.handoff, self.settings, self.node, f"{self.consumer}:last")
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.nodes, self.node)
                pipe.delete(self.keys.node_sandboxes(self.node), self.keys.drain(self.node))
                await pipe.execute()
            log.info("%s: the last worker of node %s left%s", self.consumer, self.node,
                     f"; {moved} jobs queued there went back to init" if moved else "")
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: node %s not handed back (%s); init workers elsewhere rescue it once its heartbeat "
                        "is worker_ttl_s old", self.consumer, self.node, exc)
