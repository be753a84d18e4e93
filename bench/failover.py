"""What surviving a Redis failover costs, and how long the pipeline stands still during one.
A real primary, two replicas and three redis-sentinels on loopback; workers and the client
reach the primary through a redis+sentinel:// URL.

    python bench/failover.py [--jobs 300] [--concurrency 16]

Two arms on the same topology, run A B B A, each with fresh worker processes (1 init, 1 run,
1 eval): replica_acks=0 (acknowledged writes may vanish in a failover) and replica_acks=1 (a
submission and every hand-off wait for a replica: Redis WAIT, four per job). Each sends JOBS/3
echo jobs one at a time (the difference of the p50 latencies, submit to result), then JOBS with
CONCURRENCY submitters, each waiting for its job's result before the next (throughput, and
pipeline time per job: 1 / jobs/s). On a busy machine both drown in noise, so the WAIT itself
is also timed: WRITES small script writes with and without WAIT 1, interleaved; a job makes
four. Then, with replica_acks=1, the primary is SIGKILLed mid-load: the seconds without a
finished job around the kill, and jobs lost and doubled (each must be 0).

Last line: RESULT {json} with jobs_per_s_acks0, jobs_per_s_acks1, p50_ms_acks0, p50_ms_acks1 (one
at a time), p50_ms_loaded_acks0/1, write_p50_ms, write_with_wait_p50_ms, wait_cost_ms_per_job
(four times the difference of those two), e2e_p50_diff_ms (the end-to-end difference, one at a
time), wait_cost_worker_ms_per_job (1/jobs/s difference), no_progress_s_during_failover,
failover_s (kill to every Sentinel naming the new primary), failover_jobs, lost, doubled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollstream.client import AsyncClient  # noqa: E402
from rollstream.config import Settings  # noqa: E402
from rollstream.messages import new_id  # noqa: E402
from rollstream.pipeline.connection import async_redis  # noqa: E402
from rollstream.pipeline.keys import Keys  # noqa: E402
from rollstream.pipeline.replication import script_then_wait  # noqa: E402
from rollstream.pipeline.wire import FastRedis  # noqa: E402
from rollstream.workers.pool import WorkerPool  # noqa: E402

SERVICE = "rs-bench"
WAITS_PER_JOB = 4  # the submission, init's and run's forwards, eval's result
# Longer than a failover: jobs held while the primary changes stay with their live workers.
TIMINGS = {"visibility_timeout_s": "10", "worker_ttl_s": "10", "heartbeat_interval_s": "0.5", "read_block_ms": "200"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)


class Topology:
    """A primary, two replicas and three Sentinels (down after 1 s) in a tmp folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.data = [_free_port() for _ in range(3)]
        self.sentinels = [_free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.sentinels)}/{SERVICE}/0"

    def _start(self, port: int, argv: list[str]) -> None:
        self.procs[port] = subprocess.Popen(argv, stdout=(self.folder / f"{port}.log").open("ab"),
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for _ in range(600):
            try:
                _client(port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"{argv[0]} on port {port} did not start; see {self.folder}")

    def start(self) -> Topology:
        primary = self.data[0]
        for port in self.data:
            (self.folder / str(port)).mkdir()
            argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                    "--dir", str(self.folder / str(port)), "--save", "", "--appendonly", "yes",
                    "--repl-diskless-sync-delay", "0"]
            self._start(port, argv + (["--replicaof", "127.0.0.1", str(primary)] if port != primary else []))
        for port in self.sentinels:
            conf = self.folder / f"sentinel-{port}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n")
            self._start(port, [shutil.which("redis-sentinel") or "redis-sentinel", str(conf)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            seen = [sum(not r["is_sdown"] for r in _client(p).sentinel_slaves(SERVICE)) for p in self.sentinels]
            others = [_client(p).sentinel_masters()[SERVICE]["num-other-sentinels"] for p in self.sentinels]
            info = _client(primary).info("replication")  # synced, not merely connected
            online = sum(info.get(f"slave{i}", {}).get("state") == "online" for i in range(2))
            if min(seen) >= 2 and min(others) >= 2 and online == 2:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"both replicas were not synced and seen by the Sentinels in 60 s; see {self.folder}")

    def primary(self) -> int:
        return int(_client(self.sentinels[0]).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])

    async def kill_primary_and_wait(self) -> tuple[int, float]:
        """SIGKILL the primary; seconds until every Sentinel names a new one that answers as one."""
        old = self.primary()
        self.procs[old].send_signal(signal.SIGKILL)
        self.procs[old].wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 60:
            named = {int(_client(p).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])
                     for p in self.sentinels}
            if (len(named) == 1 and old not in named
                    and _client(next(iter(named))).info("replication")["role"] == "master"):
                return old, time.monotonic() - killed
            await asyncio.sleep(0.1)
        raise RuntimeError(f"no failover within 60 s; see {self.folder}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait(10)


def _pool(url: str, namespace: str, acks: int, logs: Path) -> WorkerPool:
    env = {f"ROLLSTREAM_{k.upper()}": v for k, v in TIMINGS.items()}
    env.update(ROLLSTREAM_REPLICA_ACKS=str(acks), ROLLSTREAM_REPLICA_ACK_TIMEOUT_MS="2000")
    return WorkerPool(redis_url=url, namespace=namespace, node="bench", env=env, log_dir=logs,
                      data_dir=logs / "data")


def _settings(url: str, namespace: str, acks: int) -> Settings:
    return Settings(redis_url=url, namespace=namespace, replica_acks=acks, replica_ack_timeout_ms=2000,
                    **{k: float(v) for k, v in TIMINGS.items() if k != "read_block_ms"})


async def _arm(url: str, acks: int, jobs: int, concurrency: int, logs: Path) -> dict:
    """Fresh workers with replica_acks=ACKS. Latency: one job at a time (submit, wait for its
    result), so a WAIT's round trip is not hidden by other jobs. Throughput: CONCURRENCY
    submitters, each waiting for its job's result before the next."""
    namespace = f"b{uuid.uuid4().hex[:8]}"
    pool = _pool(url, namespace, acks, logs / f"acks{acks}-{namespace}")
    watcher = async_redis(url)
    try:
        pool.start_all(concurrency=concurrency * 2)
        await pool.wait_registered(watcher, Keys(namespace).workers, 3)
        latencies: list[float] = []
        waiting: dict[str, asyncio.Future] = {}
        async with AsyncClient(settings=_settings(url, namespace, acks)) as client:
            async def read() -> None:
                async for result in client.results():
                    fut = waiting.pop(result.job_id, None)
                    if fut is not None:
                        fut.set_result(None)

            async def submitter(n: int) -> None:
                for _ in range(n):
                    job_id = new_id()
                    done = waiting[job_id] = asyncio.get_running_loop().create_future()
                    start = time.perf_counter()
                    await client.submit({"job_id": job_id, "task": "echo", "instance": {"prompt": job_id}})
                    await done
                    latencies.append(time.perf_counter() - start)

            reader = asyncio.create_task(read())
            await asyncio.gather(*(submitter(10) for _ in range(concurrency)))  # warm-up
            latencies.clear()
            await submitter(max(jobs // 3, 20))
            alone = statistics.median(latencies)
            latencies.clear()
            start = time.perf_counter()
            await asyncio.gather(*(submitter(jobs // concurrency) for _ in range(concurrency)))
            elapsed = time.perf_counter() - start
            reader.cancel()
        return {"jobs_per_s": len(latencies) / elapsed, "p50_ms_alone": alone * 1000,
                "p50_ms_loaded": statistics.median(latencies) * 1000}
    finally:
        pool.stop()
        await watcher.aclose()


async def _wait_cost_per_write(url: str, writes: int) -> tuple[float, float]:
    """p50 of one small script write alone and of the same write with WAIT 1 (one round trip, as
    the pipeline sends them), interleaved so that the machine's other load falls on both alike."""
    r = async_redis(url)
    fast = FastRedis.from_client(r)
    script, key = "redis.call('SET', KEYS[1], ARGV[1]) return 1", f"bench:{uuid.uuid4().hex}"
    alone, waited = [], []
    try:
        for i in range(writes):
            start = time.perf_counter()
            await fast.evalsha(script, [key], [i])
            alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            await script_then_wait(r, fast, script, [key], [i], acks=1, timeout_ms=2000)
            waited.append(time.perf_counter() - start)
        await r.delete(key)
    finally:
        await fast.close()
        await r.aclose()
    return statistics.median(alone) * 1000, statistics.median(waited) * 1000


async def _failover(topology: Topology, concurrency: int, logs: Path) -> dict:
    """Open loop with replica_acks=1: submit batches steadily, SIGKILL the primary mid-load."""
    url = topology.url
    namespace = f"b{uuid.uuid4().hex[:8]}"
    pool = _pool(url, namespace, 1, logs / "failover")
    watcher = async_redis(url)
    acknowledged: list[str] = []
    finished: Counter = Counter()
    finish_times: list[float] = []
    try:
        pool.start_all(concurrency=concurrency * 2)
        await pool.wait_registered(watcher, Keys(namespace).workers, 3)
        stop = asyncio.Event()
        async with AsyncClient(settings=_settings(url, namespace, 1)) as client:
            async def submit() -> None:
                while not stop.is_set():
                    ids = [new_id() for _ in range(4)]
                    while True:
                        try:
                            await client.submit_many([{"job_id": j, "task": "echo", "instance": {"prompt": j}}
                                                      for j in ids])
                            break
                        except (redis.RedisError, OSError, RuntimeError):
                            await asyncio.sleep(0.1)
                    acknowledged.extend(ids)
                    await asyncio.sleep(0.02)

            async def read() -> None:
                while True:
                    try:
                        async for result in client.results(timeout_s=1):
                            finished[result.job_id] += 1
                            finish_times.append(time.monotonic())
                    except (redis.RedisError, OSError, RuntimeError):
                        await asyncio.sleep(0.1)

            submitter, reader = asyncio.create_task(submit()), asyncio.create_task(read())
            await asyncio.sleep(3.0)
            killed = time.monotonic()
            _old, failover_s = await topology.kill_primary_and_wait()
            await asyncio.sleep(3.0)
            stop.set()
            await submitter
            deadline = time.monotonic() + 120
            while set(finished) < set(acknowledged) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # a second result would come now
            reader.cancel()
        around = [t for t in finish_times if t >= killed - 1.0]
        before = max((t for t in finish_times if t < killed), default=killed)
        after = min((t for t in finish_times if t > killed), default=time.monotonic())
        gaps = [b - a for a, b in zip(around, around[1:])]
        return {"no_progress_s_during_failover": max([after - before, *gaps]), "failover_s": failover_s,
                "failover_jobs": len(acknowledged), "lost": len(set(acknowledged) - set(finished)),
                "doubled": sum(1 for n in finished.values() if n > 1)}
    finally:
        pool.stop()
        await watcher.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=300, help="Jobs per arm.")
    ap.add_argument("--concurrency", type=int, default=16, help="Submitters at a time (each awaits its result).")
    ap.add_argument("--writes", type=int, default=2000, help="Script writes timed with and without WAIT.")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rs-failover-"))
    topology = Topology(folder).start()
    try:
        print(f"topology up: {topology.url}", file=sys.stderr)
        runs: dict[int, list[dict]] = {0: [], 1: []}
        for acks in (0, 1, 1, 0):  # ABBA: drift in the machine's load falls on both arms alike
            runs[acks].append(await _arm(topology.url, acks, args.jobs, args.concurrency, folder / "logs"))
            print(f"replica_acks={acks}: {runs[acks][-1]}", file=sys.stderr)
        arms = {acks: {key: statistics.mean(run[key] for run in got) for key in got[0]}
                for acks, got in runs.items()}
        write_ms, waited_ms = await _wait_cost_per_write(topology.url, args.writes)
        fail = await _failover(topology, args.concurrency, folder / "logs")
    finally:
        topology.stop()
    result = {
        "jobs_per_s_acks0": round(arms[0]["jobs_per_s"], 1), "jobs_per_s_acks1": round(arms[1]["jobs_per_s"], 1),
        "p50_ms_acks0": round(arms[0]["p50_ms_alone"], 2), "p50_ms_acks1": round(arms[1]["p50_ms_alone"], 2),
        "p50_ms_loaded_acks0": round(arms[0]["p50_ms_loaded"], 2),
        "p50_ms_loaded_acks1": round(arms[1]["p50_ms_loaded"], 2),
        "write_p50_ms": round(write_ms, 3), "write_with_wait_p50_ms": round(waited_ms, 3),
        # A job's writes that wait: its submission and its three hand-offs.
        "wait_cost_ms_per_job": round(WAITS_PER_JOB * (waited_ms - write_ms), 3),
        "e2e_p50_diff_ms": round(arms[1]["p50_ms_alone"] - arms[0]["p50_ms_alone"], 2),
        "wait_cost_worker_ms_per_job": round(1000 / arms[1]["jobs_per_s"] - 1000 / arms[0]["jobs_per_s"], 3),
        "no_progress_s_during_failover": round(fail["no_progress_s_during_failover"], 2),
        "failover_s": round(fail["failover_s"], 2), "failover_jobs": fail["failover_jobs"],
        "lost": fail["lost"], "doubled": fail["doubled"],
    }
    print(f"{'':24}{'replica_acks=0':>16}{'replica_acks=1':>16}")
    print(f"{'jobs/s':24}{result['jobs_per_s_acks0']:>16}{result['jobs_per_s_acks1']:>16}")
    print(f"{'p50 ms, one at a time':24}{result['p50_ms_acks0']:>16}{result['p50_ms_acks1']:>16}")
    print(f"{'p50 ms, under load':24}{result['p50_ms_loaded_acks0']:>16}{result['p50_ms_loaded_acks1']:>16}")
    print(f"{'one write, p50 ms':24}{result['write_p50_ms']:>16}{result['write_with_wait_p50_ms']:>16}")
    print(f"WAIT costs {result['wait_cost_ms_per_job']} ms per job ({WAITS_PER_JOB} waited writes; end to end, "
          f"one at a time: {result['e2e_p50_diff_ms']} ms, within this machine's noise) and "
          f"{result['wait_cost_worker_ms_per_job']} ms of pipeline time per job under load")
    print(f"primary SIGKILLed mid-load ({fail['failover_jobs']} jobs): new primary after {result['failover_s']} s, "
          f"{result['no_progress_s_during_failover']} s without a finished job, "
          f"{result['lost']} lost, {result['doubled']} doubled")
    shutil.rmtree(folder, ignore_errors=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
