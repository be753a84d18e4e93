"""Priorities on init work: a job's ``priority`` (0-100, default 50) ranks it in init's waiting
room, a sorted set in front of the shared init stream (lua/init_queue_common.lua). Init readers
move the best-ranked jobs onto the stream in the same write as each read, so the stream stays a
short first-in-first-out buffer and everything behind it is served by rank.

The rule: a job's rank is the time it was queued plus ``(100 - priority) * priority_aging_s``;
lower ranks go first. A priority-100 job goes before a priority-0 job queued up to
``100 * priority_aging_s`` earlier, and never later than that: however steady a flood of
urgent work, a job waits at most ``(100 - priority) * priority_aging_s`` behind later arrivals,
so nothing starves."""

from __future__ import annotations

from importlib import resources

import redis.asyncio as aioredis

from rollstream.messages import INIT_STAGE
from rollstream.pipeline.keys import Keys

PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 0, 100, 50
INIT_GROUP = INIT_STAGE  # the init stage's consumer group (the stage's name)

_LUA = resources.files("rollstream.pipeline").joinpath("lua")


def _script(name: str) -> str:
    """The common part and the script, without comment lines: the feed goes with every init read."""
    text = _LUA.joinpath("init_queue_common.lua").read_text() + "\n" + _LUA.joinpath(name).read_text()
    return "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("--"))


SUBMIT_SCRIPT = _script("submit.lua")
FEED_SCRIPT = _script("init_feed.lua")


def rank_offset_s(priority: int, priority_aging_s: float) -> float:
    """How much later than its queue time a job of ``priority`` ranks."""
    return (PRIORITY_MAX - priority) * priority_aging_s


def feed_command(keys: Keys, count: int) -> tuple:
    """The command an init reader sends just before its ``XREADGROUP ... COUNT count``: it fills
    the stream's unread entries up to ``count`` from the waiting room, best rank first. EVAL with
    the script's text, not EVALSHA: a reply of NOSCRIPT after a Redis restart would come in the
    same write as the read, whose entries would then sit unseen until reclaimed."""
    return ("EVAL", FEED_SCRIPT, 2, keys.init_stream, keys.init_waiting, INIT_GROUP, count)


async def feed(r: aioredis.Redis, keys: Keys, count: int) -> int:
    """``feed_command`` on a plain redis-py connection; returns how many jobs moved."""
    return int(await r.execute_command(*feed_command(keys, count)))


def queued_at(msg_id: str, fields: dict) -> float:
    """Unix time the entry's job was queued for its stage: the entry's own time, or for a job
    that came through the waiting room, when it entered that."""
    ms = fields.get(b"queued_ms") or fields.get("queued_ms")
    return int(ms if ms else msg_id.split("-")[0]) / 1000


async def queued_count(r: aioredis.Redis, keys: Keys) -> int:
    """Jobs queued for init and not yet done there: in the waiting room and on the stream."""
    async with r.pipeline(transaction=False) as pipe:
        pipe.zcard(keys.init_waiting)
        pipe.xlen(keys.init_stream)
        waiting, on_stream = await pipe.execute()
    return int(waiting) + int(on_stream)
