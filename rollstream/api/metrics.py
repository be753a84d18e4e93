"""Prometheus exposition of the pipeline: queue depths, pending and consumers per stream,
live workers and their in-flight jobs, stage counters, dead letters, backend in-flight."""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis

from rollstream.llm.balancer import list_backends
from rollstream.messages import STAGES
from rollstream.pipeline import histograms
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import snapshot


def _labels(**kw: str | None) -> str:
    parts = [f'{k}="{(v or "").replace(chr(34), "")}"' for k, v in kw.items()]
    return "{" + ",".join(parts) + "}"


async def render_metrics(r: aioredis.Redis, keys: Keys) -> str:
    st = await snapshot(r, keys)
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {value}" for labels, value in samples)

    metric("rollstream_stream_length", "gauge", "Entries in a stage stream (queued + in flight).",
           [(_labels(stage=s.stage, node=s.node or "*"), s.length) for s in st.streams])
    metric("rollstream_stream_pending", "gauge", "Messages delivered to a worker and not yet acknowledged.",
           [(_labels(stage=s.stage, node=s.node or "*"), s.pending) for s in st.streams])
    metric("rollstream_stream_consumers", "gauge", "Consumers in the stage's group.",
           [(_labels(stage=s.stage, node=s.node or "*"), s.consumers) for s in st.streams])
    metric("rollstream_worker_inflight", "gauge", "Jobs in flight per worker.",
           [(_labels(worker=w.worker, stage=w.stage, node=w.node), w.inflight) for w in st.workers])
    metric("rollstream_worker_heartbeat_age_seconds", "gauge", "Seconds since the worker's last heartbeat.",
           [(_labels(worker=w.worker, stage=w.stage, node=w.node), w.heartbeat_age_s) for w in st.workers])
    metric("rollstream_jobs_total", "counter", "Jobs leaving each stage, by outcome.",
           [(_labels(stage=stage, outcome=outcome), n) for stage, c in st.counters.items() for outcome, n in c.items()])
    metric("rollstream_dead_letters", "gauge", "Entries in the dead-letter stream.", [("", st.dead_letters)])
    metric("rollstream_results_waiting", "gauge", "Results not yet consumed by their submitters.",
           [("", st.results_waiting)])
    metric("rollstream_policy_version", "gauge", "Policy version new trajectories carry.", [("", st.policy_version)])
    out.append("# HELP rollstream_stage_duration_seconds Time a job spent in each stage's work.")
    out.append("# TYPE rollstream_stage_duration_seconds histogram")
    for stage in STAGES:
        raw = await histograms.read(r, keys.stage_histogram(stage))
        out.extend(histograms.prometheus_lines("rollstream_stage_duration_seconds", f'stage="{stage}",', raw))
    out.append("# HELP rollstream_tool_call_seconds Latency of the agents' tool calls, by tool.")
    out.append("# TYPE rollstream_tool_call_seconds histogram")
    for key in sorted(k.decode() for k in cast(list[bytes], await r.keys(keys.tool_histogram("*")))):
        tool = key.rsplit(":", 1)[-1]
        out.extend(histograms.prometheus_lines("rollstream_tool_call_seconds", f'tool="{tool}",',
                                               await histograms.read(r, key)))
    if st.counters:
        metric("rollstream_jobs_finished_total", "counter", "Jobs that left the pipeline, by outcome.",
               [(_labels(outcome=o), sum(c.get(o, 0) for c in st.counters.values()))
                for o in ("completed", "cancelled", "dead")])
    backends = await _backend_samples(r, keys)
    metric("rollstream_backend_inflight", "gauge", "In-flight requests per inference backend.", backends)
    return "\n".join(out) + "\n"


async def _backend_samples(r: aioredis.Redis, keys: Keys) -> list[tuple[str, float]]:
    return [(_labels(backend=b.url, healthy=str(b.healthy).lower()), b.in_flight)
            for b in await list_backends(r, keys.namespace)]
