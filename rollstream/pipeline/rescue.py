"""Rescue of jobs stranded on a dead node. Run and eval streams are per node, so when a
whole node stops heart-beating (its Slurm array task was cancelled, the machine died) no
worker there will ever reclaim them; init workers elsewhere move them back to the shared
init stream, where they start over with a new sandbox."""

from __future__ import annotations

import logging
import time
from typing import cast

import redis.asyncio as aioredis
from pydantic import ValidationError

from rollstream.config import Settings
from rollstream.messages import NODE_STAGES, DeadLetter, Result
from rollstream.pipeline.codec import DecodeError, decode_envelope
from rollstream.pipeline.groups import ensure_group
from rollstream.pipeline.handoff import Handoff, Source
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.wire import StreamReply

log = logging.getLogger(__name__)


async def _move_back(handoff: Handoff, settings: Settings, src: Source, fields: dict, node: str) -> None:
    """Requeue one job of a dead node at init, or dead-letter it when that was its last attempt.
    Its sandbox died with the node, whose sandbox set the caller forgets."""
    try:
        env = decode_envelope(fields)
    except (DecodeError, ValidationError) as exc:
        letter = DeadLetter(job_id=None, submitter=None, stage=src.group, error=f"malformed job message: {exc}",
                            raw=fields.get(b"data") or fields.get(b"json"))
        await handoff.dead_letter(src, letter, None)
        return
    reason = f"node {node} stopped answering while the job was in {src.group}"
    if env.is_last_attempt(settings.max_deliveries):
        error = env.with_earlier_errors(reason)
        await handoff.dead_letter(src, DeadLetter.of_job(env, src.group, error), Result.failed(env, error, src.group))
        return
    await handoff.requeue(src, env.restarted(failed_with=reason), reason)


async def rescue_node(r: aioredis.Redis, keys: Keys, handoff: Handoff, settings: Settings,
                      node: str, rescuer: str, batch: int = 100) -> int:
    """Move every job held or queued on ``node``'s run and eval streams back to init."""
    moved = 0
    for stage in NODE_STAGES:
        stream = keys.stage_stream(stage, node)
        if not await r.exists(stream):
            continue
        await ensure_group(r, stream, stage)
        while True:
            resp = await r.xautoclaim(stream, stage, rescuer, 0, start_id="0-0", count=batch)
            claimed: list[tuple[bytes, dict[bytes, bytes]]] = resp[1]
            entries = [(m, f) for m, f in claimed if f]
            fresh = cast(StreamReply, await r.xreadgroup(stage, rescuer, {stream: ">"}, count=batch))
            for _s, items in fresh or []:
                entries += items
            if not entries:
                break
            for raw_id, fields in entries:
                msg_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                await _move_back(handoff, settings, Source(stream, stage, msg_id, rescuer), fields, node)
                moved += 1
    return moved


async def rescue_dead_nodes(r: aioredis.Redis, keys: Keys, handoff: Handoff, settings: Settings,
                            rescuer: str) -> int:
    cutoff = time.time() - settings.worker_ttl_s
    dead = [n.decode() for n in cast(list[bytes], await r.zrangebyscore(keys.nodes, 0, cutoff))]
    moved = 0
    for node in dead:
        if node == settings.node:
            continue
        n = await rescue_node(r, keys, handoff, settings, node, rescuer)
        if n:
            log.warning("rescued %d jobs from dead node %s back to init", n, node)
        moved += n
        await r.eval(_FORGET_NODE, 2, keys.nodes, keys.node_sandboxes(node), node, cutoff)
    return moved


# Forget a node, and the sandbox bookkeeping that died with it, only if it is still silent:
# a node that came back meanwhile keeps both.
_FORGET_NODE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) <= tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
"""
