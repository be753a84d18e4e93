"""Consumer groups: creating them idempotently (with their stream) before anyone reads, and
removing a consumer that leaves."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def remove_idle_consumer(r: aioredis.Redis, stream: str, group: str, consumer: str) -> None:
    """Remove `consumer` from the group if nothing is pending with it: deleting a consumer
    drops its pending entries, so one that still holds messages stays for reclaim."""
    if not await r.xpending_range(stream, group, "-", "+", 1, consumername=consumer):
        await r.xgroup_delconsumer(stream, group, consumer)


async def autoclaim(r: aioredis.Redis, stream: str, group: str, consumer: str, min_idle_ms: int,
                    count: int) -> tuple[list[tuple], list]:
    """XAUTOCLAIM up to `count` messages idle longer than `min_idle_ms` for `consumer`:
    (the claimed (id, fields) that still have an entry, the ids whose entries were deleted)."""
    resp = await r.xautoclaim(stream, group, consumer, min_idle_ms, start_id="0-0", count=count)
    deleted = resp[2] if len(resp) > 2 else []
    return [(m, f) for m, f in resp[1] if f], deleted
