"""Rescue of jobs stranded on a dead node. Run and eval streams are per node, so when a
whole node stops heart-beating (its Slurm array task was cancelled, the machine died) no
worker there will ever reclaim them; init workers elsewhere move them back to the shared
init stream, where they start over with a new sandbox."""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from pydantic import ValidationError

from rollstream.config import Settings
from rollstream.messages import INIT_STAGE, NODE_STAGES, DeadLetter, Result
from rollstream.pipeline.codec import DecodeError, decode_envelope
from rollstream.pipeline.groups import ensure_group
from rollstream.pipeline.handoff import Handoff, Source
from rollstream.pipeline.keys import Keys

log = logging.getLogger(__name__)


async def _move_back(handoff: Handoff, keys: Keys, settings: Settings, src: Source, fields: dict,
                     node: str) -> None:
    try:
        env = decode_envelope(fields)
    except (DecodeError, ValidationError) as exc:
        letter = DeadLetter(job_id=None, submitter=None, stage=src.group, error=f"malformed job message: {exc}",
                            raw=fields.get(b"data") or fields.get(b"json"))
        await handoff.dead_letter(src, letter, None)
        return
    reason = f"node {node} stopped answering while the job was in {src.group}"
    if env.attempt + 1 >= settings.max_deliveries:
        error = reason + (("; earlier attempts: " + " | ".join(env.errors)) if env.errors else "")
        letter = DeadLetter(job_id=env.job.job_id, submitter=env.job.submitter, stage=src.group,
                            error=error, envelope=env)
        result = Result(job_id=env.job.job_id, group_id=env.job.group_id, submitter=env.job.submitter,
                        task=env.job.task, status="failed", error=error, error_stage=src.group,
                        failure="infrastructure", attempts=env.attempt + 1, metadata=env.job.metadata)
        await handoff.dead_letter(src, letter, result)
        return
    env = env.model_copy(update={"attempt": env.attempt + 1, "sandbox": None, "state": {}, "trajectory": None,
                                 "node": None, "errors": [*env.errors, reason]})
    await handoff.requeue(src, env, keys.init_stream, INIT_STAGE, reason)


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
            entries = [(m, f) for m, f in resp[1] if f]
            fresh = await r.xreadgroup(stage, rescuer, {stream: ">"}, count=batch)
            for _s, items in fresh or []:
                entries += items
            if not entries:
                break
            for msg_id, fields in entries:
                msg_id = msg_id.decode() if isinstance(msg_id, bytes) else msg_id
                await _move_back(handoff, keys, settings, Source(stream, stage, msg_id, rescuer), fields, node)
                moved += 1
    return moved


async def rescue_dead_nodes(r: aioredis.Redis, keys: Keys, handoff: Handoff, settings: Settings,
                            rescuer: str) -> int:
    cutoff = time.time() - settings.worker_ttl_s
    dead = [n.decode() for n in await r.zrangebyscore(keys.nodes, 0, cutoff)]
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
