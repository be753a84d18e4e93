"""A worker process: connects to Redis, builds its stage and the services the stage's
tasks need, and serves until SIGTERM/SIGINT (then drains within the grace period)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from rollstream import eventloop
from rollstream.config import Settings
from rollstream.errors import RedisUnavailable
from rollstream.pipeline.connection import async_redis, check_async
from rollstream.pipeline.handoff import Handoff
from rollstream.pipeline.keys import Keys
from rollstream.sandboxes.roots import ensure_root, namespace_root_dir
from rollstream.workers.consumer import ConsumerLoop
from rollstream.workers.eval import EvalStage
from rollstream.workers.init import InitStage
from rollstream.workers.run import RunStage
from rollstream.workers.stage import Stage, WorkerContext

log = logging.getLogger(__name__)

STAGES: dict[str, type[Stage]] = {stage.name: stage for stage in (InitStage, RunStage, EvalStage)}


def make_context(settings: Settings, redis_url: str) -> WorkerContext:
    r = async_redis(redis_url)
    keys = Keys(settings.namespace)
    handoff = Handoff(r, keys, state_ttl_s=settings.job_state_ttl_s, results_maxlen=settings.results_maxlen,
                      dead_maxlen=settings.dead_maxlen, replica_acks=settings.replica_acks,
                      replica_ack_timeout_ms=settings.replica_ack_timeout_ms)
    return WorkerContext(settings=settings, redis=r, keys=keys, handoff=handoff)


async def serve_stage(stage: str, settings: Settings, concurrency: int, *, consumer: str | None = None) -> None:
    """Run one stage's consumer loop in this event loop until stopped by a signal."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage '{stage}'; choose one of {', '.join(STAGES)}")
    if not settings.redis_url:
        raise ValueError("a worker needs settings.redis_url")
    # UnsafeSandboxRoot: no worker on a sandbox root that another user could change.
    ensure_root(namespace_root_dir(settings.namespace, settings.sandbox_root))
    ctx = make_context(settings, settings.redis_url)
    await _wait_for_redis(ctx, settings, settings.redis_url)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    loop = ConsumerLoop(STAGES[stage](ctx), ctx, concurrency, consumer=consumer)
    background = await loop.stage.start_services(loop.consumer)
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, loop.terminate)
    try:
        await loop.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            aloop.remove_signal_handler(sig)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await ctx.services.aclose()
        await ctx.redis.aclose()


async def _wait_for_redis(ctx: WorkerContext, settings: Settings, url: str) -> None:
    """Workers may start before Redis (a restarting server, a head job still loading its
    AOF): wait for it, saying so, up to ``redis_wait_s``."""
    deadline = time.monotonic() + settings.redis_wait_s
    while True:
        try:
            await check_async(ctx.redis, url)
            return
        except RedisUnavailable as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("waiting for Redis: %s", exc)
            await asyncio.sleep(1.0)


def run_worker(stage: str, settings: Settings, concurrency: int) -> None:
    """The worker process's whole life (``rollstream worker``, whose imports cli/main.py's ``main`` froze)."""
    eventloop.run(serve_stage(stage, settings, concurrency), settings.event_loop)
