"""Where one job's submit → result time goes, hop by hop, across the client, the three
workers and Redis: a timeline with microsecond stamps from every process, for finding
what to cut next (it found session 6's cuts: the wire codec and the corked hand-off of a
lone job).

    python bench/pipeline_trace.py [--jobs 400]

Each process records ``time.monotonic_ns()`` (one clock for all processes) at fixed points:
bytes arriving from Redis (``recv``), a command leaving (``send``), a batch admitted, the
envelope decoded, the stage's work, the hand-off and its packing. The workers are patched
at start through a ``sitecustomize`` on their PYTHONPATH; the patches wrap internals, so a
renamed method breaks this harness, not the product (tests/bench/test_pipeline_trace.py
runs it, so such a rename fails a test). Jobs go one at a time; the table is
the most common sequence of events, with the median time since the previous event and
since submit. Gaps between one process's ``send`` and the next one's ``recv`` are Redis
and the wake-up; the rest is Python. Recording costs ~1 µs an event, so totals run a
little above bench/pipeline.py's.

Last line: ``RESULT {json}`` with ``p50_ms``, ``events`` (process, event, median µs since
submit) and ``jobs_in_table``.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
EVENTS: list[tuple[int, str]] = []


def _stamp(what: str) -> None:
    EVENTS.append((time.monotonic_ns(), what))


def _around(owner, name: str, before: str, after: str) -> None:
    """Stamp ``before`` and ``after`` around a plain method or function of ``owner``."""
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        _stamp(before)
        try:
            return inner(*args, **kwargs)
        finally:
            _stamp(after)

    setattr(owner, name, wrapped)


def _around_async(owner, name: str, before: str, after: str) -> None:
    inner = getattr(owner, name)

    async def wrapped(*args, **kwargs):
        _stamp(before)
        try:
            return await inner(*args, **kwargs)
        finally:
            _stamp(after)

    setattr(owner, name, wrapped)


def arm(out_dir: str) -> None:
    """Patch this process's rollstream and write its events to ``out_dir`` at exit."""
    import atexit

    from rollstream.pipeline import handoff, wire
    from rollstream.workers import consumer, init, run
    from rollstream.workers import eval as eval_stage

    def dump() -> None:
        with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as f:
            json.dump({"events": EVENTS}, f)

    atexit.register(dump)
    received = wire._Replies.data_received
    sent = wire.FastRedis._send_all

    def data_received(self, data):
        _stamp("recv")
        received(self, data)

    def _send_all(self, commands, due):
        _stamp(f"send {commands[-1][0]}")
        return sent(self, commands, due)

    wire._Replies.data_received, wire.FastRedis._send_all = data_received, _send_all
    _around(consumer.ConsumerLoop, "_admit", "admit", "admitted")
    _around(consumer, "decode_envelope", "decode", "decoded")
    _around(handoff, "pack", "pack", "packed")
    for stage in (init.InitStage, run.RunStage, eval_stage.EvalStage):
        _around_async(stage, "process", "work", "worked")
    for name in ("forward", "finish"):
        _around_async(handoff.Handoff, name, name, f"{name} replied")


SITECUSTOMIZE = """import os, sys
sys.path.insert(0, {bench!r})
if "worker" in sys.argv:
    import pipeline_trace
    pipeline_trace.arm(os.environ["RS_TRACE_DIR"])
"""


async def _submit_one_at_a_time(settings, n: int) -> list[float]:
    from pipeline import wait_workers

    from rollstream.client import AsyncClient

    async with AsyncClient(settings=settings) as client:
        await wait_workers(client, 3)
        for _ in range(50):  # warm up
            await client.submit({"task": "echo", "instance": {"prompt": "warm"}})
            await client.collect(1, timeout_s=30)
        EVENTS.clear()
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            _stamp(f"submit {i}")
            await client.submit({"task": "echo", "instance": {"prompt": f"p{i}"}})
            async for _ in client.results(timeout_s=30, max_results=1):
                pass
            _stamp(f"result {i}")
            lat.append((time.perf_counter() - t0) * 1000)
        return lat


def timeline(out_dir: Path, stages: dict[int, str]) -> tuple[list[tuple[str, str, float, float]], int]:
    """(process, event, median µs since the previous event, median µs since submit) for
    the most common sequence of events, and how many jobs had that sequence."""
    per_process = {"client": EVENTS}
    for f in out_dir.glob("*.json"):
        pid = int(f.stem)
        if pid in stages:
            per_process[stages[pid]] = [tuple(e) for e in json.loads(f.read_text())["events"]]
    merged = sorted((t, proc, what) for proc, events in per_process.items() for t, what in events)
    times = [t for t, _p, _w in merged]
    starts = [(t, w.split()[1]) for t, w in EVENTS if w.startswith("submit ")]
    ends = {w.split()[1]: t for t, w in EVENTS if w.startswith("result ")}
    jobs = []
    for t0, i in starts:
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, ends[i])
        jobs.append([(t - t0, proc, what.split()[0] if what.startswith(("submit", "result")) else what)
                     for t, proc, what in merged[lo:hi]])
    shapes = collections.Counter(tuple((p, w) for _t, p, w in job) for job in jobs)
    shape, count = shapes.most_common(1)[0]
    same = [job for job in jobs if tuple((p, w) for _t, p, w in job) == shape]
    rows = []
    for k, (proc, what) in enumerate(shape):
        since_prev = statistics.median((job[k][0] - (job[k - 1][0] if k else 0)) / 1000 for job in same)
        rows.append((proc, what, since_prev, statistics.median(job[k][0] / 1000 for job in same)))
    return rows, count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=400)
    args = ap.parse_args()
    sys.path.insert(0, str(BENCH))
    from pipeline import run_pool  # bench/pipeline.py: the same workers, settings and tmpfs work folders

    from rollstream import eventloop
    from rollstream.config import Settings
    from rollstream.pipeline.embedded import EmbeddedRedis

    arm_dir = Path(tempfile.mkdtemp(prefix="rs-trace-"))
    (arm_dir / "hook").mkdir()
    (arm_dir / "hook" / "sitecustomize.py").write_text(SITECUSTOMIZE.format(bench=str(BENCH)))
    os.environ["RS_TRACE_DIR"] = str(arm_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(arm_dir / "hook"), os.environ.get("PYTHONPATH")]))
    arm(str(arm_dir))
    work = Path(tempfile.mkdtemp(prefix="rs-trace-work-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    with EmbeddedRedis(arm_dir / "redis") as server:
        pool = run_pool(server.url, 1, 256, work)
        try:
            s = Settings(redis_url=server.url, namespace=pool.namespace, data_dir=work, node="bench")
            lat = eventloop.run(_submit_one_at_a_time(s, args.jobs), s.event_loop)
            stages = {p.pid: stage for stage, p in pool.procs}
        finally:
            pool.stop()  # the workers write their events as they exit
    rows, count = timeline(arm_dir, stages)
    print(f"submit → result p50 {statistics.median(lat):.3f} ms over {args.jobs} jobs; the table: the "
          f"{count} jobs with the most common sequence of events")
    print(f"{'process':<8} {'event':<18} {'+µs':>6} {'at µs':>7}")
    for proc, what, since_prev, at in rows:
        print(f"{proc:<8} {what:<18} {since_prev:>6.0f} {at:>7.0f}")
    print("RESULT " + json.dumps({"p50_ms": round(statistics.median(lat), 3), "jobs_in_table": count,
                                  "events": [[p, w, round(at)] for p, w, _s, at in rows]}))


if __name__ == "__main__":
    main()
