"""Rendering a pipeline snapshot as a rich table (``rollstream status``, ``up``, ``demo``)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rollstream.pipeline.status import PipelineStatus, finished_total


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
        workers.add_row(w.worker, w.stage, w.node, str(w.inflight), str(w.concurrency), str(w.processed),
                        f"{w.heartbeat_age_s:.1f}")
    summary = Table.grid(padding=(0, 2))
    rate = f"{jobs_per_s:.1f}" if jobs_per_s is not None else "-"
    summary.add_row("finished", str(finished_total(status)), "jobs/s", rate, "dead letters",
                    str(status.dead_letters), "results waiting", str(status.results_waiting),
                    "policy version", str(status.policy_version))
    if status.redis_problem:  # e.g. MISCONF: a full disk under Redis's AOF stops every worker's writes
        return Group(Text(f"Redis: {status.redis_problem}", style="bold red"), streams, workers, summary)
    return Group(streams, workers, summary)
