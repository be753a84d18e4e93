"""The node's reaping duty, run by eval workers: which of this node's sandboxes a job still
wants, by the jobs' state in Redis. A sandbox is wanted only while its job is on this node's
run or eval stream with that very sandbox (or still in init, briefly), or while init's warm pool
holds it under a lease. Everything else —
sandboxes of finished, failed, cancelled or restarted jobs, and what a killed worker or a
crashed supervisor left — is torn down by sandboxes/reaper.py."""

from __future__ import annotations

import asyncio
import logging
import time

from rollstream.messages import INIT_STAGE, NODE_STAGES
from rollstream.pipeline.jobstate import parse_state
from rollstream.pipeline.keys import Keys
from rollstream.sandboxes.reaper import Reaper

log = logging.getLogger(__name__)

INIT_GRACE_S = 600.0  # a sandbox whose job is still in init may be mid-creation


async def reap_node(r, keys: Keys, node: str, root_dir: str | None) -> list[str]:
    reaper = Reaper(root_dir)
    records = await asyncio.to_thread(reaper.sandboxes)
    async with r.pipeline(transaction=False) as pipe:
        for rec in records:
            pipe.hgetall(keys.job(rec.owner))
        states = await pipe.execute()
    now = time.time()
    # Warm-pool sandboxes (workers/warm_pool.py) while their lease lasts: a killed worker's run out.
    warm_key = keys.node_warm(node)
    await r.zremrangebyscore(warm_key, "-inf", now)
    wanted = {v.decode() for v in await r.zrangebyscore(warm_key, now, "+inf")}
    for rec, raw in zip(records, states):
        state = parse_state(rec.owner, raw)
        if (state.stage in NODE_STAGES and state.node == node and state.sandbox == rec.id
                or state.stage == INIT_STAGE and now - rec.created_at < INIT_GRACE_S):
            wanted.add(rec.id)
    reaped = await asyncio.to_thread(reaper.reap, lambda sandbox_id, _owner: sandbox_id in wanted)
    # Counts drift when a worker dies between a sandbox's end and the bookkeeping; the
    # sandboxes on disk are the truth for init's back-pressure.
    live_key = keys.node_sandboxes(node)
    counted = {v.decode() for v in await r.smembers(live_key)}
    gone = counted - {rec.id for rec in records if rec.id not in reaped}
    if gone:
        await r.srem(live_key, *gone)
    if reaped:
        log.info("reaped %d sandboxes no job wants: %s", len(reaped), ", ".join(reaped[:10]))
    return reaped
