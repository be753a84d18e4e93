"""Latency histograms kept in Redis, so every worker process adds to the same ones and the
API's /metrics exposes them in Prometheus form: per-stage durations and tool-call latency.
One hash per histogram: a counter per bucket, plus sum and count. A worker gathers its
observations in memory and adds them every ``FLUSH_S`` in one transaction (as Prometheus
client libraries do): a job's hand-off carries no metrics work, because it sits on the job's
critical path; /metrics lags the results by at most ``FLUSH_S``."""

from __future__ import annotations

import bisect
from typing import cast

import redis
import redis.asyncio as aioredis

from rollstream.messages import STAGES, Result
from rollstream.pipeline.keys import Keys

# Seconds: from a fast tool call to a long agent episode.
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


_BUCKET_FIELDS = tuple(repr(b) for b in BUCKETS_S) + ("+Inf",)
FLUSH_S = 0.5


def bucket(value_s: float) -> str:
    """The bucket field an observation counts in."""
    return _BUCKET_FIELDS[bisect.bisect_left(BUCKETS_S, value_s)]


class Observations:
    """This process's observations not yet added to the shared histograms."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, float]] = {}

    def observe(self, key: str, value_s: float) -> None:
        self._add(key, {bucket(value_s): 1, "sum": value_s, "count": 1})

    def _add(self, key: str, counts: dict[str, float]) -> None:
        h = self._pending.setdefault(key, {})
        for field, n in counts.items():
            h[field] = h.get(field, 0) + n

    async def flush(self, r: aioredis.Redis) -> None:
        """Add what was observed since the last flush, all histograms in one transaction;
        if Redis is unreachable they are kept for the next flush."""
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            async with r.pipeline(transaction=True) as pipe:
                for key, h in batch.items():
                    for field, n in h.items():
                        if field == "sum":
                            pipe.hincrbyfloat(key, field, n)
                        else:
                            pipe.hincrby(key, field, int(n))
                await pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            for key, h in batch.items():
                self._add(key, h)
            raise


async def read(r: aioredis.Redis, key: str) -> dict[str, float]:
    raw = cast(dict[bytes, bytes], await r.hgetall(key))
    return {k.decode(): float(v) for k, v in raw.items()}


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


def result_latencies(keys: Keys, result: Result) -> list[tuple[str, float]]:
    """A result's stage durations and tool-call latencies for the shared histograms
    (/metrics), as (histogram key, seconds)."""
    timings = result.timings_s
    out = [(keys.stage_histogram(stage), timings[f"{stage}_s"])
           for stage in STAGES if f"{stage}_s" in timings]
    for call in result.trajectory.tool_calls if result.trajectory else []:
        if call.duration_ms > 0:
            out.append((keys.tool_histogram(call.name), call.duration_ms / 1000))
    return out
