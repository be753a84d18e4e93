"""Consumer groups: creating them idempotently (with their stream) before anyone reads."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> None:
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
