"""Latency histograms kept in Redis, so every worker process adds to the same ones and the
API's /metrics exposes them in Prometheus form: per-stage durations and tool-call latency.
One hash per histogram: a counter per bucket, plus sum and count."""

from __future__ import annotations

import bisect

import redis.asyncio as aioredis

from rollstream.pipeline.keys import Keys

# Seconds: from a fast tool call to a long agent episode.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def bucket(value_s: float) -> str:
    """The bucket field an observation counts in (the hand-off script adds it, with sum and
    count, atomically with the job's result)."""
    i = bisect.bisect_left(BUCKETS_S, value_s)
    return repr(BUCKETS_S[i]) if i < len(BUCKETS_S) else "+Inf"


async def read(r: aioredis.Redis, key: str) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in (await r.hgetall(key)).items()}


def prometheus_lines(name: str, labels: str, raw: dict[str, float]) -> list[str]:
    """Cumulative buckets in exposition format; ``labels`` is 'k="v",' or ''."""
    out, total = [], 0.0
    for bound in BUCKETS_S:
        total += raw.get(repr(bound), 0.0)
        out.append(f'{name}_bucket{{{labels}le="{bound}"}} {total:g}')
    total += raw.get("+Inf", 0.0)
    out.append(f'{name}_bucket{{{labels}le="+Inf"}} {total:g}')
    out.append(f"{name}_sum{{{labels.rstrip(',')}}} {raw.get('sum', 0.0):g}")
    out.append(f"{name}_count{{{labels.rstrip(',')}}} {raw.get('count', 0.0):g}")
    return out


def stage_key(keys: Keys, stage: str) -> str:
    return keys._k("hist", "stage", stage)


def tool_key(keys: Keys, tool: str) -> str:
    return keys._k("hist", "tool", tool)
