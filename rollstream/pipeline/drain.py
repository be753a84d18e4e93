"""Draining a node: the request (``rollstream drain NODE``, ``POST /v1/nodes/{node}/drain``) is
a key holding the time by which the node's workers must have let go of their jobs; they read
it with their heartbeats (workers/membership.py). Init there stops taking work at once, run
and eval finish what the node holds, and whatever is left at the deadline goes back to init
for another node. Then the workers leave and the node leaves the live list."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from rollstream.messages import STAGES
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.workerstate import WorkerRecord


class DrainStarted(BaseModel):
    node: str
    deadline: float = Field(description="Unix time by which the node's workers hand back what they still hold.")
    grace_s: float
    workers: list[str] = Field(description="The node's live workers when the drain was asked for.")


@dataclass(frozen=True)
class Member:
    name: str
    stage: str
    draining: bool  # stopping (SIGTERM) or its node drains


async def node_members(r: aioredis.Redis, keys: Keys, node: str, worker_ttl_s: float) -> list[Member]:
    """``node``'s live workers (those that heart-beat within worker_ttl_s)."""
    live = cast(list[bytes | str], await r.zrangebyscore(keys.workers, time.time() - worker_ttl_s, "+inf"))
    names = [n.decode() if isinstance(n, bytes) else n for n in live]
    if not names:
        return []
    async with r.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.worker(name))
        records = [WorkerRecord.parse(raw) for raw in await pipe.execute()]
    return [Member(name, rec.stage, rec.draining) for name, rec in zip(names, records)
            if rec is not None and rec.node == node]


async def node_workers(r: aioredis.Redis, keys: Keys, node: str, worker_ttl_s: float,
                       stages: tuple[str, ...] = STAGES) -> list[str]:
    """Names of ``node``'s live workers of ``stages``."""
    return [m.name for m in await node_members(r, keys, node, worker_ttl_s) if m.stage in stages]


async def request_drain(r: aioredis.Redis, keys: Keys, node: str, grace_s: float, *,
                        worker_ttl_s: float) -> DrainStarted:
    """Ask ``node``'s workers to drain within ``grace_s``. ``LookupError`` if it has no live
    worker (a misspelt node, or one already gone). Asking again moves the deadline. The request
    lapses once the node is gone, so workers started later under the same name serve."""
    workers = await node_workers(r, keys, node, worker_ttl_s)
    if not workers:
        raise LookupError(f"node {node!r} has no live worker; 'rollstream status' lists the nodes and their workers")
    deadline = time.time() + grace_s
    # Kept past the deadline for as long as a worker may take to notice and hand back.
    await r.set(keys.drain(node), repr(deadline), ex=int(grace_s + 3 * worker_ttl_s) + 60)
    return DrainStarted(node=node, deadline=deadline, grace_s=grace_s, workers=workers)


async def drain_deadline(r: aioredis.Redis, keys: Keys, node: str) -> float | None:
    raw = await r.get(keys.drain(node))
    return float(raw) if raw else None
