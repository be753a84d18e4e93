"""How throughput scales with run-worker processes when the run stage is I/O-bound, and how
much a single Redis can feed. A tiny real HTTP server stands in for an inference server
(fixed latency per request); each job makes TURNS requests to it from the run stage.

    python bench/scaling.py [--workers auto|1,2,4,8] [--latency-ms 50] [--turns 4] [--concurrency 4]

--workers auto (the default) doubles the run processes from 1 up to twice the CPUs and stops one
step after the CPU saturation point, so a 2-core laptop and a 16-core GPU node both reach it.

For each worker count: 1 init + 1 eval process (never the bottleneck) and W run processes,
each with CONCURRENCY jobs in flight; steady-state jobs/s is measured between the 10th and
90th percentile of completion times. Efficiency is jobs/s(W) / (W x jobs/s(1)), the
baseline being one run process in the same run. The CPU saturation point is the first W
where the benchmark's own processes use ≥ 85 % of the CPUs or efficiency falls below 0.85
(the machine-wide CPU figure is printed too: on a shared machine other load takes cores).
Then Redis's own stream throughput (pipelined XADD / XREADGROUP+XACK) and the Redis
commands the pipeline spends per job give how many jobs/s, and nodes, one Redis feeds.

Last line: RESULT {json} with jobs_per_s and efficiency by worker count, cpu_percent,
saturation_workers, ideal_jobs_per_s_per_worker, redis_xadd_per_s, redis_xread_ack_per_s,
redis_cmds_per_job, redis_jobs_per_s_capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from machine import describe, require, say

if __name__ == "__main__" and not {"--worker", "--serve-http"} & set(sys.argv):
    # what rollstream's pools import, and a Redis: said before anything starts, not as a silent exit
    require("bench/scaling.py", ["psutil", "redis", "msgpack", "ormsgpack", "pydantic", "pydantic_settings", "httpx",
                                 "typer", "rich"], ("redis-server",))

import psutil  # noqa: E402
import redis  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollstream.client import AsyncClient  # noqa: E402
from rollstream.config import Settings  # noqa: E402
from rollstream.messages import Envelope  # noqa: E402
from rollstream.pipeline.embedded import EmbeddedRedis  # noqa: E402
from rollstream.tasks.base import Task, TaskContext  # noqa: E402
from rollstream.trajectory import Trajectory  # noqa: E402
from rollstream.workers.pool import WorkerPool  # noqa: E402


# -- the simulated inference server ------------------------------------------------------
async def _serve_http(port: int, latency_s: float, host: str = "127.0.0.1") -> None:
    """HTTP/1.1 with keep-alive on asyncio streams: read a request, sleep, answer. Costs
    almost no CPU, so the workers' own cost is what the benchmark sees."""
    body = b'{"choices": [{"text": "ok", "token_ids": [1, 2, 3]}]}'
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
             + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                await asyncio.sleep(latency_s)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


# -- the run-stage task that calls it ----------------------------------------------------
class SimulatedLLMTask(Task):
    """A multi-turn rollout whose every turn is one HTTP request to the simulated server."""

    name = "bench-simulated-llm"
    _client = None

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        return None

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        import httpx

        if SimulatedLLMTask._client is None:  # one keep-alive pool per worker process
            SimulatedLLMTask._client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1024))
        inst = env.job.instance
        for turn in range(inst["turns"]):
            resp = await SimulatedLLMTask._client.post(inst["url"], json={"prompt_token_ids": [1, 2, 3], "turn": turn})
            resp.raise_for_status()
        return Trajectory(response_text="ok", num_turns=inst["turns"])

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        return 1.0


def worker_main(stage: str, concurrency: int) -> None:
    """Entry of a worker process: the stock consumer loop with the bench task registered."""
    from rollstream.tasks.registry import register_task
    from rollstream.workers.process import serve_stage

    register_task(SimulatedLLMTask)
    asyncio.run(serve_stage(stage, Settings(), concurrency))


# -- the driver ---------------------------------------------------------------------------
def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def redis_calls(r: redis.Redis) -> int:
    return sum(v["calls"] for k, v in r.info("commandstats").items())


async def run_config(url: str, data_dir: Path, workers: int, args, server_url: str, other_pids: list[int]) -> dict:
    ns = f"scale{workers}-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": url, "ROLLSTREAM_NAMESPACE": ns, "ROLLSTREAM_NODE": "bench",
           "ROLLSTREAM_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO)}
    log_dir = data_dir / f"logs-{workers}"
    log_dir.mkdir(parents=True, exist_ok=True)
    pool = WorkerPool(redis_url=url, namespace=ns, node="bench", data_dir=data_dir, env=env, log_dir=log_dir,
                      program=[sys.executable, __file__, "--worker"])
    settings = Settings(redis_url=url, namespace=ns, node="bench", data_dir=data_dir)
    ideal = args.concurrency / (args.turns * args.latency_ms / 1000)
    n_jobs = max(100, int(ideal * workers * args.seconds))
    try:
        pool.start("init", concurrency=256)
        pool.start("eval", concurrency=256)
        pool.start("run", processes=workers, concurrency=args.concurrency)
        async with AsyncClient(settings=settings, validate_tasks=False) as client:
            await pool.wait_registered(client.r, client.keys.workers, workers + 2, timeout_s=args.start_timeout_s)
            say(f"  {workers} run worker(s) registered; {n_jobs} jobs")
            sync_r = redis.Redis.from_url(url)
            calls0 = redis_calls(sync_r)
            pids = [os.getpid(), *other_pids, *(p.pid for _stage, p in pool.procs)]
            psutil.cpu_percent(interval=None)
            own0, t0 = cpu_seconds(pids), time.perf_counter()
            jobs = [{"task": SimulatedLLMTask.name, "instance": {"url": server_url, "turns": args.turns}}
                    for _ in range(n_jobs)]
            for start in range(0, n_jobs, 500):
                await client.submit_many(jobs[start:start + 500])
            results = await collect_watching(client, pool, n_jobs, args.collect_timeout_s)
            cpu = psutil.cpu_percent(interval=None)
            # CPU of this benchmark's own processes, as a share of the whole machine: the
            # machine may be shared, so the system-wide figure alone would mislead.
            own = (cpu_seconds(pids) - own0) / ((time.perf_counter() - t0) * psutil.cpu_count()) * 100
            calls = redis_calls(sync_r) - calls0
            sync_r.close()
    finally:
        pool.stop()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    done = sorted(r.finished_at for r in results)
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    return {"workers": workers, "jobs": n_jobs, "jobs_per_s": (hi - lo) / (done[hi] - done[lo]),
            "cpu_percent": cpu, "own_cpu_percent": own, "ideal_jobs_per_s": ideal * workers,
            "redis_cmds_per_job": calls / n_jobs}


def saturated(rows: list[dict], base: float) -> bool:
    """Whether the row before the last already saturated the CPUs (see the module docstring)."""
    row = rows[-2]
    return row["own_cpu_percent"] >= 85 or row["jobs_per_s"] / (row["workers"] * base) < 0.85


async def collect_watching(client: AsyncClient, pool: WorkerPool | list[WorkerPool], n: int,
                           timeout_s: float) -> list:
    """All ``n`` results, checking between batches that no worker died (whose jobs would
    otherwise wait out the visibility timeout in silence) and saying how far it got."""
    results: list = []
    deadline = time.monotonic() + timeout_s
    last_said = time.monotonic()
    pools = pool if isinstance(pool, list) else [pool]
    while len(results) < n:
        for each in pools:
            each.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(results)} of {n} results after {timeout_s:.0f} s; worker logs are kept "
                               f"in {[each.log_dir for each in pools]}")
        async for result in client.results(timeout_s=2.0, max_results=n - len(results)):
            results.append(result)
        if time.monotonic() - last_said > 10:
            say(f"    {len(results)} of {n} results")
            last_said = time.monotonic()
    return results


def redis_stream_throughput(url: str, n: int = 200_000, batch: int = 1000) -> dict:
    """Pipelined single-client XADD, then XREADGROUP + XACK, on the same server."""
    r = redis.Redis.from_url(url)
    stream = f"bench:stream:{uuid.uuid4().hex[:6]}"
    payload = {"data": os.urandom(200)}  # about a job message's size
    r.xgroup_create(stream, "g", id="0", mkstream=True)
    t0 = time.perf_counter()
    for _ in range(n // batch):
        pipe = r.pipeline(transaction=False)
        for _ in range(batch):
            pipe.xadd(stream, payload)
        pipe.execute()
    xadd = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    consumed = 0
    while consumed < n:
        resp = r.xreadgroup("g", "c", {stream: ">"}, count=batch)
        ids = [m for m, _ in resp[0][1]] if resp else []
        if not ids:
            break
        r.xack(stream, "g", *ids)
        consumed += len(ids)
    read_ack = consumed / (time.perf_counter() - t0)
    r.delete(stream)
    out = {"xadd_per_s": xadd, "xread_ack_per_s": read_ack}
    bench_bin = shutil.which("redis-benchmark")
    sock = url.removeprefix("unix://")
    if bench_bin and url.startswith("unix://"):
        # 50 clients, pipeline 16: what many workers together get from one server.
        proc = subprocess.run([bench_bin, "-s", sock, "-c", "50", "-P", "16", "-n", str(n), "-q",
                               "XADD", f"bench:rb:{uuid.uuid4().hex[:6]}", "MAXLEN", "~", "100000", "*", "f", "v"],
                              capture_output=True, text=True, timeout=300)
        found = re.search(r"([\d.]+) requests per second", proc.stdout)
        if found:
            out["redis_benchmark_xadd_per_s"] = float(found.group(1))
    r.close()
    return out


async def main(args) -> None:
    if args.workers == "auto":
        counts = [1]
        while counts[-1] < 2 * (psutil.cpu_count() or 1):
            counts.append(counts[-1] * 2)
    else:
        counts = [int(x) for x in args.workers.split(",")]
    port = args.port
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-http", str(port), "--latency-ms", str(args.latency_ms)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    data_dir = Path(tempfile.mkdtemp(prefix="rs-bench-scaling-"))
    say(f"bench/scaling.py on {describe()}; run workers {counts}; work folder {data_dir}")
    rows = []
    failed = True
    import socket

    for _ in range(200):  # the simulated server answers before any worker calls it
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the simulated inference server exited with {server.returncode} at start") from None
            time.sleep(0.05)
    try:
        with EmbeddedRedis(data_dir / "redis") as redis_server:
            say(f"  redis-server {redis_server.url}")
            for workers in counts:
                if args.workers == "auto" and len(rows) >= 2 and saturated(rows, rows[0]["jobs_per_s"]):
                    break  # one step past saturation is measured; more would only queue
                rows.append(await run_config(redis_server.url, data_dir, workers, args,
                                             f"http://127.0.0.1:{port}/v1/completions",
                                             [server.pid, redis_server.proc.pid if redis_server.proc else 0]))
                print(f"  {workers} run worker(s): {rows[-1]['jobs_per_s']:.1f} jobs/s, "
                      f"cpu {rows[-1]['own_cpu_percent']:.0f}% ours, {rows[-1]['cpu_percent']:.0f}% machine",
                      file=sys.stderr, flush=True)
            say("  Redis stream throughput")
            streams = redis_stream_throughput(redis_server.url, n=args.stream_messages)
        failed = False
    finally:
        server.terminate()
        server.wait(10)
        if failed:
            say(f"bench/scaling.py failed; the workers' logs are kept in {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)

    base = rows[0]["jobs_per_s"] / rows[0]["workers"]
    for row in rows:
        row["efficiency"] = row["jobs_per_s"] / (row["workers"] * base)
    # Saturated: our own processes use ≥ 85 % of the machine's CPUs, or one more step of
    # workers stopped paying (on a shared machine, other load takes cores first).
    saturation = next((row["workers"] for row in rows
                       if row["own_cpu_percent"] >= 85 or row["efficiency"] < 0.85), None)
    cmds_per_job = max(row["redis_cmds_per_job"] for row in rows)
    # Conservative: the single-client pipelined rate, not redis-benchmark's many-client one.
    redis_ops = min(streams["xadd_per_s"], streams["xread_ack_per_s"])
    capacity = redis_ops / cmds_per_job

    ideal_one = args.concurrency / (args.turns * args.latency_ms / 1000)
    print(f"\nrun stage: {args.turns} turns x {args.latency_ms} ms simulated inference, "
          f"{args.concurrency} jobs in flight per run process (ideal {ideal_one:.1f} jobs/s per process); "
          f"{psutil.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other processes share them)\n")
    print(f"{'run procs':>9} {'jobs':>6} {'jobs/s':>9} {'ideal':>9} {'efficiency':>10} {'our cpu %':>9} "
          f"{'machine cpu %':>13} {'redis cmd/job':>13}")
    for row in rows:
        print(f"{row['workers']:>9} {row['jobs']:>6} {row['jobs_per_s']:>9.1f} {row['ideal_jobs_per_s']:>9.1f} "
              f"{row['efficiency']:>10.2f} {row['own_cpu_percent']:>9.0f} {row['cpu_percent']:>13.0f} "
              f"{row['redis_cmds_per_job']:>13.1f}")
    efficiency = next((r["efficiency"] for r in rows if r["workers"] == saturation), None)
    print(f"\nCPU saturation point: {saturation or 'not reached'} run processes"
          + (f" (efficiency {efficiency:.2f})" if saturation else ""))
    print(f"\nRedis streams, one client pipelined: XADD {streams['xadd_per_s']:,.0f}/s, "
          f"XREADGROUP+XACK {streams['xread_ack_per_s']:,.0f} msgs/s"
          + (f"; redis-benchmark XADD (50 clients, -P 16): {streams['redis_benchmark_xadd_per_s']:,.0f}/s"
             if "redis_benchmark_xadd_per_s" in streams else ""))
    print(f"The pipeline spends ~{cmds_per_job:.0f} Redis commands per job (all stages, heartbeats included): "
          f"one Redis feeds ~{capacity:,.0f} jobs/s.")

    result = {
        "jobs_per_s": {str(r["workers"]): round(r["jobs_per_s"], 2) for r in rows},
        "efficiency": {str(r["workers"]): round(r["efficiency"], 3) for r in rows},
        "cpu_percent": {str(r["workers"]): round(r["cpu_percent"], 1) for r in rows},
        "own_cpu_percent": {str(r["workers"]): round(r["own_cpu_percent"], 1) for r in rows},
        "saturation_workers": saturation,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "ideal_jobs_per_s_per_worker": round(ideal_one, 2),
        "latency_ms": args.latency_ms, "turns": args.turns, "concurrency": args.concurrency,
        "redis_xadd_per_s": round(streams["xadd_per_s"]),
        "redis_xread_ack_per_s": round(streams["xread_ack_per_s"]),
        "redis_benchmark_xadd_per_s": streams.get("redis_benchmark_xadd_per_s"),
        "redis_cmds_per_job": round(cmds_per_job, 1),
        "redis_jobs_per_s_capacity": round(capacity),
        "machine": describe(),
    }
    print("RESULT " + json.dumps(result))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="auto",
                   help="run-worker process counts to measure, or auto (1, 2, 4, ... up to 2 x CPUs, stopping one "
                        "step past saturation)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="simulated inference latency per request")
    p.add_argument("--turns", type=int, default=4, help="inference requests per job")
    p.add_argument("--concurrency", type=int, default=4, help="jobs in flight per run process")
    p.add_argument("--seconds", type=float, default=8.0, help="target length of each measurement")
    p.add_argument("--port", type=int, default=0, help="simulated server port (0: pick a free one)")
    p.add_argument("--start-timeout-s", type=float, default=120.0,
                   help="how long worker processes may take to register before the run fails with their logs")
    p.add_argument("--stream-messages", type=int, default=200_000,
                   help="messages per Redis stream throughput measurement (a smoke run may take fewer)")
    p.add_argument("--collect-timeout-s", type=float, default=600.0, help="how long one measurement may take")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--serve-http", type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve-host", default="127.0.0.1", help=argparse.SUPPRESS)
    return p.parse_args()


if __name__ == "__main__":
    a = parse()
    if a.worker:
        worker_main(a.worker, a.concurrency)
    elif a.serve_http:
        asyncio.run(_serve_http(a.serve_http, a.latency_ms / 1000, a.serve_host))
    else:
        if not a.port:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                a.port = s.getsockname()[1]
        asyncio.run(main(a))
