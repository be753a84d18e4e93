"""The pipeline as an operator watches it (``rollstream status``, ``up``, ``demo``): snapshots
sampled with the jobs/s between them, rendered as rich tables."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import PipelineStatus, finished_total, snapshot


async def rate_sampler(url: str, namespace: str) -> AsyncIterator[tuple[PipelineStatus, float | None]]:
    """A snapshot each time it is asked for, with the jobs/s finished since the last one."""
    r = async_redis(url)
    keys = Keys(namespace)
    last = None
    try:
        while True:
            st = await snapshot(r, keys)
            now, done = time.monotonic(), finished_total(st)
            rate = None if last is None else (done - last[1]) / max(now - last[0], 1e-6)
            last = (now, done)
            yield st, rate
    finally:
        await r.aclose()


def render(status: PipelineStatus, jobs_per_s: float | None = None) -> Group:
    streams = Table(title="streams", title_justify="left")
    for col in ("stream", "stage", "node", "length", "pending", "lag", "consumers"):
        streams.add_column(col, justify="right" if col in ("length", "pending", "lag", "consumers") else "left",
                           overflow="fold")
    for s in status.streams:
        streams.add_row(s.stream, s.stage, s.node or "*", str(s.length), str(s.pending),
                        "-" if s.lag is None else str(s.lag), str(s.consumers))
    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "stage", "node", "in flight", "slots", "processed", "heartbeat age s"):
        # Names wrap rather than being cut: an operator copies them into redis-cli.
        workers.add_column(col, overflow="fold" if col in ("worker", "node") else "ellipsis")
    for w in status.workers:
        stage = f"{w.stage} (draining)" if w.draining else w.stage
        workers.add_row(w.worker, stage, w.node, str(w.inflight), str(w.concurrency), str(w.processed),
                        f"{w.heartbeat_age_s:.1f}")
    summary = Table.grid(padding=(0, 2))
    rate = f"{jobs_per_s:.1f}" if jobs_per_s is not None else "-"
    summary.add_row("finished", str(finished_total(status)), "jobs/s", rate, "dead letters",
                    str(status.dead_letters), "results waiting", str(status.results_waiting),
                    "policy version", str(status.policy_version))
    if status.redis_problem:  # e.g. MISCONF: a full disk under Redis's AOF stops every worker's writes
        return Group(Text(f"Redis: {status.redis_problem}", style="bold red"), streams, workers, summary)
    return Group(streams, workers, summary)
