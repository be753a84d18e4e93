"""Pipeline overhead and throughput with the echo task (no LLM, no sandbox): what the
broker itself costs. Starts a private redis-server (AOF on, as the embedded default) and
real worker processes.

    python bench/pipeline.py [--jobs 5000] [--latency-jobs 300]

Prints a table, then `RESULT {json}` with overhead_p50_ms, overhead_p99_ms,
jobs_per_s_1proc, jobs_per_s_2proc (and cpu_ms_per_job: CPU time of workers, client and
Redis per job in the one-at-a-time run, which a loaded machine inflates far less than
wall-clock latency; the load average is printed with it). Targets (2-core machine):
p50 ≤ 2 ms, ≥ 1,000 jobs/s. Baseline: the figures before the one-round-trip hop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.workers.pool import WorkerPool


# bench/README.md before this change (quiet machine): 2 round trips + a wake-up per hop.
BASELINE = {"overhead_p50_ms": 4.7, "overhead_p99_ms": 6.9, "jobs_per_s_1proc": 1062, "jobs_per_s_2proc": 906}


def cpu_s(pids: list[int]) -> float:
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def wait_workers(client: AsyncClient, n: int) -> None:
    while await client.r.zcard(client.keys.workers) < n:
        await asyncio.sleep(0.05)


async def measure_overhead(settings: Settings, n: int, pids: list[int]) -> tuple[list[float], float]:
    """Submit one job at a time and time submit → result, in ms; and the CPU ms per job
    of the processes ``pids``."""
    async with AsyncClient(settings=settings) as client:
        await wait_workers(client, 3)
        for _ in range(20):  # warm up connections and code paths
            await client.submit({"task": "echo", "instance": {"prompt": "warm"}})
            await client.collect(1, timeout_s=30)
        lat = []
        cpu0 = cpu_s(pids)
        for i in range(n):
            t0 = time.perf_counter()
            await client.submit({"task": "echo", "instance": {"prompt": f"p{i}"}})
            async for _res in client.results(timeout_s=30, max_results=1):
                pass
            lat.append((time.perf_counter() - t0) * 1000)
        return lat, (cpu_s(pids) - cpu0) * 1000 / n


async def measure_throughput(settings: Settings, n: int, procs: int) -> float:
    async with AsyncClient(settings=settings) as client:
        await wait_workers(client, 3 * procs)
        t0 = time.perf_counter()
        chunk = 500
        for start in range(0, n, chunk):
            await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}"}}
                                      for i in range(start, min(n, start + chunk))])
        got = 0
        async for res in client.results(timeout_s=60):
            got += 1
            if got == n:
                break
        elapsed = time.perf_counter() - t0
        if got < n:
            raise SystemExit(f"only {got} of {n} results arrived")
        return n / elapsed


def run_pool(url: str, procs: int, concurrency: int, data_dir: Path) -> WorkerPool:
    ns = f"b{uuid.uuid4().hex[:6]}"
    pool = WorkerPool(redis_url=url, namespace=ns, node="bench", data_dir=data_dir,
                      env={"ROLLSTREAM_READ_BLOCK_MS": "1000"})
    pool.start_all(processes=procs, concurrency=concurrency)
    return pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=5000)
    ap.add_argument("--latency-jobs", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=256)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rs-bench-"))
    # The echo task makes and removes a work folder per job; on this machine's disk that is
    # ~1 ms of syscalls, which would measure the disk, not the broker. Work folders go to tmpfs.
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="rs-bench-work-", dir=shm if shm.is_dir() else None))
    rows = []
    with EmbeddedRedis(tmp / "redis") as server:
        out: dict = {}
        pool = run_pool(server.url, 1, args.concurrency, work)
        try:
            s = Settings(redis_url=server.url, namespace=pool.namespace, data_dir=work, node="bench")
            pids = [p.pid for _stage, p in pool.procs] + [os.getpid(), server.proc.pid]
            lat, cpu_ms = asyncio.run(measure_overhead(s, args.latency_jobs, pids))
            out["overhead_p50_ms"] = round(statistics.median(lat), 3)
            out["overhead_p99_ms"] = round(pct(lat, 99), 3)
            out["cpu_ms_per_job"] = round(cpu_ms, 3)
            rows.append(("submit→result, 1 job at a time", f"p50 {out['overhead_p50_ms']} ms",
                         f"p99 {out['overhead_p99_ms']} ms", "≤ 2 ms p50",
                         f"{BASELINE['overhead_p50_ms']} / {BASELINE['overhead_p99_ms']} ms"))
            rows.append(("  CPU, all processes, per job", f"{out['cpu_ms_per_job']} ms", "", "", ""))
            out["jobs_per_s_1proc"] = round(asyncio.run(measure_throughput(s, args.jobs, 1)), 1)
            rows.append((f"{args.jobs} jobs, 1 process per stage", f"{out['jobs_per_s_1proc']} jobs/s", "", "≥ 1000",
                         str(BASELINE["jobs_per_s_1proc"])))
        finally:
            pool.stop()
        pool = run_pool(server.url, 2, args.concurrency, work)
        try:
            s = Settings(redis_url=server.url, namespace=pool.namespace, data_dir=work, node="bench")
            out["jobs_per_s_2proc"] = round(asyncio.run(measure_throughput(s, args.jobs, 2)), 1)
            rows.append((f"{args.jobs} jobs, 2 processes per stage", f"{out['jobs_per_s_2proc']} jobs/s", "", "≥ 1000",
                         str(BASELINE["jobs_per_s_2proc"])))
        finally:
            pool.stop()
    load = os.getloadavg()
    out["load_avg_1m"] = round(load[0], 2)
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores "
          "(latency is only comparable on a quiet machine)")
    print(f"{'measure':<38} {'value':<20} {'':<16} {'target':<12} baseline")
    for row in rows:
        print(f"{row[0]:<38} {row[1]:<20} {row[2]:<16} {row[3]:<12} {row[4]}")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
