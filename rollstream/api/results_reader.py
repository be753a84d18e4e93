"""Results over HTTP: a submitter's results stream read through its consumer group, so a
result stays deliverable until the HTTP client acknowledges it (the cursor of the page it
came in). A client that crashes mid-response gets the same results again. Results are
encoded as JSON here, one by one: an entry that cannot be read or encoded goes to the dead
letters and the page goes on without it, so one poison result never blocks the rest."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import cast

import redis.asyncio as aioredis
from pydantic_core import PydanticSerializationError

from rollstream.pipeline.connection import MAX_BLOCK_MS
from rollstream.pipeline.groups import ensure_group
from rollstream.pipeline.keys import RESULTS_GROUP, Keys
from rollstream.pipeline.poison import UNREADABLE, dead_letter_result, read_result
from rollstream.pipeline.wire import StreamReply

HTTP_CONSUMER = "http"


def _id(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _le(a: str, b: str) -> bool:
    ma, sa = a.split("-")
    mb, sb = b.split("-")
    return (int(ma), int(sa)) <= (int(mb), int(sb))


class ResultsReader:
    def __init__(self, r: aioredis.Redis, keys: Keys, *, dead_maxlen: int = 100_000):
        self.r = r
        self.keys = keys
        self.dead_maxlen = dead_maxlen

    async def _ack_through(self, stream: str, cursor: str) -> None:
        pending = await self.r.xpending_range(stream, RESULTS_GROUP, "-", cursor, 10_000, consumername=HTTP_CONSUMER)
        ids = [_id(p["message_id"]) for p in pending if _le(_id(p["message_id"]), cursor)]
        if ids:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.xack(stream, RESULTS_GROUP, *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()

    async def page(self, submitter: str, *, ack: str | None, wait_s: float, count: int) -> tuple[list[str], str | None]:
        """Up to ``count`` results as JSON texts, and the cursor that acknowledges them."""
        stream = self.keys.results(submitter)
        await ensure_group(self.r, stream, RESULTS_GROUP)
        if ack:
            await self._ack_through(stream, ack)
        # Unacknowledged deliveries first (a client that lost a response), then new ones.
        resp = cast(StreamReply, await self.r.xreadgroup(RESULTS_GROUP, HTTP_CONSUMER, {stream: "0"}, count=count))
        entries = resp[0][1] if resp and resp[0][1] else []
        deadline = time.monotonic() + wait_s
        while not entries:
            left_ms = int((deadline - time.monotonic()) * 1000)
            block = min(MAX_BLOCK_MS, left_ms) if left_ms >= 1 else None
            resp = cast(StreamReply, await self.r.xreadgroup(RESULTS_GROUP, HTTP_CONSUMER, {stream: ">"}, count=count,
                                                             block=block))
            entries = resp[0][1] if resp else []
            if block is None:
                break
        texts = []
        for msg_id, fields in entries:
            if not fields:
                continue  # deleted after delivery: acknowledged already
            try:
                texts.append(read_result(fields).model_dump_json())
            except (*UNREADABLE, PydanticSerializationError) as exc:
                await dead_letter_result(self.r, self.keys, submitter, msg_id, fields,
                                         f"{type(exc).__name__}: {exc}", dead_maxlen=self.dead_maxlen)
        return texts, (_id(entries[-1][0]) if entries else None)

    async def stream(self, submitter: str, *, idle_timeout_s: float) -> AsyncIterator[str]:
        """Results as they come, as JSON texts, each acknowledged once it has been handed on."""
        last = time.monotonic()
        while time.monotonic() - last < idle_timeout_s:
            wait = min(5.0, max(0.05, idle_timeout_s - (time.monotonic() - last)))
            items, cursor = await self.page(submitter, ack=None, wait_s=wait, count=100)
            if items:
                last = time.monotonic()
            for item in items:
                yield item
            if cursor:
                await self._ack_through(self.keys.results(submitter), cursor)
