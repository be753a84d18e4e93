"""A snapshot of the whole pipeline for operators: every stream's length, pending count and
consumers, live workers, dead letters and per-stage counters. ``rollstream status`` and
``GET /v1/status`` print it; ``redis-cli`` shows the same numbers (see the README)."""

from __future__ import annotations

import time
from typing import cast

import redis
import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from rollstream.messages import INIT_STAGE, NODE_STAGES, STAGES
from rollstream.pipeline.connection import refused_write, transient_problem
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.workerstate import WorkerRecord

# Workers whose heartbeat is older than this are left out (and dropped from the workers set)
# when the caller does not say: the default worker_ttl_s.
DEFAULT_WORKER_TTL_S = 20.0


class StreamStatus(BaseModel):
    stream: str
    stage: str
    node: str | None = None
    length: int = 0
    pending: int = 0
    lag: int | None = None
    consumers: int = 0
    waiting: int = Field(0, description="Init only: jobs in its waiting room, served by priority before they "
                         "reach the stream (pipeline/priorities.py).")


class WorkerStatus(BaseModel):
    worker: str
    stage: str = ""
    node: str = ""
    inflight: int = 0
    processed: int = 0
    concurrency: int = 0
    heartbeat_age_s: float = 0.0
    draining: bool = Field(False, description="Stopping (SIGTERM) or its node drains: it takes no new work and "
                           "leaves the list once its jobs are done or handed back.")


class PipelineStatus(BaseModel):
    at: float = Field(default_factory=time.time)
    redis_problem: str | None = Field(None, description="What is wrong with Redis, if it refuses writes "
                                      "(MISCONF: full disk; READONLY; OOM; LOADING); None when it takes them.")
    streams: list[StreamStatus] = Field(default_factory=list)
    workers: list[WorkerStatus] = Field(default_factory=list)
    dead_letters: int = 0
    results_waiting: int = 0
    counters: dict[str, dict[str, int]] = Field(default_factory=dict)
    policy_version: int = 0


async def _stream_status(r: aioredis.Redis, stream: str, stage: str, node: str | None) -> StreamStatus:
    st = StreamStatus(stream=stream, stage=stage, node=node)
    try:
        st.length = await r.xlen(stream)
        for group in await r.xinfo_groups(stream):
            st.pending += group.get("pending", 0)
            st.consumers += group.get("consumers", 0)
            lag = group.get("lag")
            st.lag = (st.lag or 0) + lag if isinstance(lag, int) else st.lag
    except redis.ResponseError:
        pass  # no such stream yet
    return st


async def redis_problem(r: aioredis.Redis, keys: Keys, *, terse: bool = False) -> str | None:
    """What is wrong with Redis, in words, or None: a write probe (a key that expires), since
    a Redis with a full disk still answers PING and reads but refuses every write. ``terse``:
    an unreachable Redis is named by the error's type only (for the unauthenticated /health:
    no socket paths or hosts)."""
    try:
        await r.set(keys.health_probe, time.time(), px=60_000)
    except (redis.RedisError, OSError) as exc:
        if refused_write(exc) or not terse:
            return transient_problem(exc) or f"{type(exc).__name__}: {exc}"
        return f"Redis unreachable: {type(exc).__name__}"
    return None


async def snapshot(r: aioredis.Redis, keys: Keys, *, worker_ttl_s: float = DEFAULT_WORKER_TTL_S) -> PipelineStatus:
    """Reads only (it works while Redis refuses writes, and says so in ``redis_problem``)."""
    status = PipelineStatus(redis_problem=await redis_problem(r, keys))
    status.streams.append(await _stream_status(r, keys.init_stream, INIT_STAGE, None))
    status.streams[0].waiting = await r.zcard(keys.init_waiting)
    nodes = sorted(n.decode() for n in cast(list[bytes], await r.zrange(keys.nodes, 0, -1)))
    for node in nodes:
        for stage in NODE_STAGES:
            status.streams.append(await _stream_status(r, keys.stage_stream(stage, node), stage, node))
    now = time.time()
    if status.redis_problem is None:  # workers dead for worker_ttl_s leave the list
        await r.zremrangebyscore(keys.workers, "-inf", now - worker_ttl_s)
    live = cast(list[tuple[bytes, float]],
                await r.zrangebyscore(keys.workers, now - worker_ttl_s, "+inf", withscores=True))
    for worker, beat in live:
        name = worker.decode()
        rec = WorkerRecord.parse(cast(dict[bytes, bytes], await r.hgetall(keys.worker(name))))
        age_s = round(now - beat, 1)
        status.workers.append(WorkerStatus(worker=name, heartbeat_age_s=age_s) if rec is None else WorkerStatus(
            worker=name, stage=rec.stage, node=rec.node, inflight=rec.inflight, processed=rec.processed,
            concurrency=rec.concurrency, heartbeat_age_s=age_s, draining=rec.draining))
    status.dead_letters = await r.xlen(keys.dead)
    for submitter in cast(list[bytes], await r.zrange(keys.submitters, 0, -1)):
        status.results_waiting += await r.xlen(keys.results(submitter.decode()))
    for counted in (*STAGES, "client"):
        raw = cast(dict[bytes, bytes], await r.hgetall(keys.stats(counted)))
        if raw:
            status.counters[counted] = {k.decode(): int(v) for k, v in raw.items()}
    status.policy_version = int(await r.get(keys.policy_version) or 0)
    return status


def finished_total(status: PipelineStatus) -> int:
    """Jobs that have left the pipeline (completed, cancelled or dead-lettered), any stage."""
    return sum(c.get(k, 0) for c in status.counters.values() for k in ("completed", "cancelled", "dead"))
