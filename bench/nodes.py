"""Rollouts per second per node, and how they scale with nodes, over a real network: each
rollout node is a host of its own (a network namespace with a veth port on a bridge,
chaos/netns.py) running one init, one run and one eval process; Redis and a simulated
inference server (bench/scaling.py's: fixed latency per request, almost no CPU) each sit on
a host of their own, and the driver submits from the machine's own namespace. Every hand-off,
heartbeat and inference request crosses real TCP between hosts.

    python bench/nodes.py [--nodes 1,2,4,8] [--latency-ms 50] [--turns 4] [--concurrency 8]
                          [--delay-ms 0] [--loss-percent 0]

--delay-ms and --loss-percent shape every node's cable (Network.shape: netem, or on a kernel
without it the userspace wire of chaos/wire.py): what a node sends (hand-offs, heartbeats,
inference requests) waits and is lost as on a slow, lossy network, TCP retransmitting.

Efficiency(N) = jobs/s(N) / (N x jobs/s(1)), the baseline being one node in the same run.
On one machine the nodes share its CPUs: the table prints the benchmark's own CPU use, and
where that nears the machine's capacity, efficiency measures the machine, not the system.
Needs root (namespaces). Last line: RESULT {json} with node_efficiency ({nodes: efficiency}),
busiest_node_share ({nodes: the busiest node's jobs over an even share}),
jobs_per_s and jobs_per_s_per_node by node count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import scaling  # noqa: E402  (bench/scaling.py: the simulated server and task)

from chaos.netns import Network  # noqa: E402
from rollstream.client import AsyncClient  # noqa: E402
from rollstream.config import Settings  # noqa: E402
from rollstream.workers.pool import WorkerPool  # noqa: E402

REDIS_PORT = 6379
SERVER_PORT = 8000


async def run_nodes(net: Network, nodes: int, redis_url: str, server_url: str, folder: Path, args,
                    other_pids: list[int]) -> dict:
    ns = f"nodes{nodes}-{uuid.uuid4().hex[:6]}"
    settings = Settings(redis_url=redis_url, namespace=ns, data_dir=folder / "driver")
    pools: list[WorkerPool] = []
    ideal_one = args.concurrency / (args.turns * args.latency_ms / 1000)
    n_jobs = max(100, int(ideal_one * nodes * args.seconds))
    try:
        for i in range(nodes):
            host = net.hosts[f"n{i + 1}"]
            pool = WorkerPool(redis_url=redis_url, namespace=ns, node=f"n{i + 1}", data_dir=folder / f"n{i + 1}",
                              env={"PYTHONPATH": str(REPO)}, log_dir=folder / f"logs-{nodes}" / f"n{i + 1}",
                              program=host.command([sys.executable, str(REPO / "bench" / "scaling.py"), "--worker"]))
            pool.start("init", concurrency=256)
            pool.start("eval", concurrency=256)
            pool.start("run", concurrency=args.concurrency)
            pools.append(pool)
        async with AsyncClient(settings=settings, validate_tasks=False) as client:
            for pool in pools:
                await pool.wait_registered(client.r, client.keys.workers, 3 * nodes, timeout_s=args.start_timeout_s)
            scaling.say(f"  {nodes} node(s) registered; {n_jobs} jobs")
            pids = [os.getpid(), *other_pids, *(p.pid for pool in pools for _s, p in pool.procs)]
            psutil.cpu_percent(interval=None)
            own0, t0 = scaling.cpu_seconds(pids), time.perf_counter()
            jobs = [{"task": scaling.SimulatedLLMTask.name, "instance": {"url": server_url, "turns": args.turns}}
                    for _ in range(n_jobs)]
            for start in range(0, n_jobs, 500):
                await client.submit_many(jobs[start:start + 500])
            results = await scaling.collect_watching(client, pools, n_jobs, args.collect_timeout_s)
            machine = psutil.cpu_percent(interval=None)
            own = (scaling.cpu_seconds(pids) - own0) / ((time.perf_counter() - t0) * psutil.cpu_count()) * 100
            async with client.r.pipeline(transaction=False) as pipe:  # the node each job ran on
                for result in results:
                    pipe.hget(client.keys.job(result.job_id), "node")
                by_node = Counter(node.decode() for node in await pipe.execute() if node)
    finally:
        for pool in pools:
            pool.stop()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    done = sorted(r.finished_at for r in results)
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    rate = (hi - lo) / (done[hi] - done[lo])
    return {"nodes": nodes, "jobs": n_jobs, "jobs_per_s": rate, "jobs_per_s_per_node": rate / nodes,
            "ideal_jobs_per_s": ideal_one * nodes, "own_cpu_percent": own, "machine_cpu_percent": machine,
            # The busiest node's share of the jobs against an even one (1.0: even; init's
            # back-pressure keeps a node from taking more than its run slots serve).
            "busiest_node_share": max(by_node.values()) * nodes / n_jobs}


async def main(args) -> None:
    counts = [int(x) for x in args.nodes.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="rs-bench-nodes-"))
    os.chmod(folder, 0o711)
    scaling.say(f"bench/nodes.py: {psutil.cpu_count()} CPUs, nodes {counts}; work folder {folder}")
    rows: list[dict] = []
    procs: list[subprocess.Popen] = []
    failed = True
    with Network() as net:
        try:
            net.add_host("driver", driver=True)
            redis_host = net.add_host("redis")
            inference = net.add_host("inference")
            shaping = "none" if not (args.delay_ms or args.loss_percent) else \
                "netem" if net.netem_available() else "userspace wire"
            for i in range(max(counts)):
                net.add_host(f"n{i + 1}")
                if args.delay_ms or args.loss_percent:
                    net.shape(f"n{i + 1}", delay_ms=args.delay_ms, loss_percent=args.loss_percent)
            procs.append(subprocess.Popen(
                redis_host.command(["redis-server", "--bind", redis_host.address, "--port", str(REDIS_PORT),
                                    "--protected-mode", "no", "--save", "", "--appendonly", "no",
                                    "--dir", str(folder), "--maxclients", "10000"]),
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            procs.append(subprocess.Popen(
                inference.command([sys.executable, str(REPO / "bench" / "scaling.py"), "--serve-http",
                                   str(SERVER_PORT), "--serve-host", inference.address,
                                   "--latency-ms", str(args.latency_ms)]),
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            redis_url = f"redis://{redis_host.address}:{REDIS_PORT}/0"
            server_url = f"http://{inference.address}:{SERVER_PORT}/v1/completions"
            await _wait_port(inference.address, SERVER_PORT, procs[1])
            await _wait_port(redis_host.address, REDIS_PORT, procs[0])
            for nodes in counts:
                rows.append(await run_nodes(net, nodes, redis_url, server_url, folder, args,
                                            [p.pid for p in procs]))
                row = rows[-1]
                scaling.say(f"  {nodes} node(s): {row['jobs_per_s']:.1f} jobs/s, "
                            f"{row['jobs_per_s_per_node']:.1f} per node, cpu {row['own_cpu_percent']:.0f}% ours, "
                            f"busiest node {row['busiest_node_share']:.2f}x an even share")
            failed = False
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
            if failed:
                scaling.say(f"bench/nodes.py failed; logs are kept in {folder}")
            else:
                shutil.rmtree(folder, ignore_errors=True)

    base = rows[0]["jobs_per_s"] / rows[0]["nodes"]
    for row in rows:
        row["efficiency"] = row["jobs_per_s"] / (row["nodes"] * base)
    ideal_one = args.concurrency / (args.turns * args.latency_ms / 1000)
    print(f"\nrollout nodes on hosts of their own (namespaces, veth, a bridge); each node 1 init + 1 run + 1 eval "
          f"process; run stage {args.turns} turns x {args.latency_ms} ms simulated inference, {args.concurrency} "
          f"jobs in flight (ideal {ideal_one:.1f} jobs/s per node); each node's cable {args.delay_ms} ms delay, "
          f"{args.loss_percent}% loss ({shaping}); {psutil.cpu_count()} CPUs shared by all hosts, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print(f"{'nodes':>5} {'jobs':>6} {'jobs/s':>9} {'per node':>9} {'ideal':>9} {'efficiency':>10} "
          f"{'our cpu %':>9} {'machine cpu %':>13}")
    for row in rows:
        print(f"{row['nodes']:>5} {row['jobs']:>6} {row['jobs_per_s']:>9.1f} {row['jobs_per_s_per_node']:>9.1f} "
              f"{row['ideal_jobs_per_s']:>9.1f} {row['efficiency']:>10.2f} {row['own_cpu_percent']:>9.0f} "
              f"{row['machine_cpu_percent']:>13.0f}")
    result = {
        "node_efficiency": {str(r["nodes"]): round(r["efficiency"], 3) for r in rows},
        "jobs_per_s": {str(r["nodes"]): round(r["jobs_per_s"], 2) for r in rows},
        "jobs_per_s_per_node": {str(r["nodes"]): round(r["jobs_per_s_per_node"], 2) for r in rows},
        "own_cpu_percent": {str(r["nodes"]): round(r["own_cpu_percent"], 1) for r in rows},
        "busiest_node_share": {str(r["nodes"]): round(r["busiest_node_share"], 2) for r in rows},
        "ideal_jobs_per_s_per_node": round(ideal_one, 2),
        "latency_ms": args.latency_ms, "delay_ms": args.delay_ms, "loss_percent": args.loss_percent,
        "shaping": shaping, "turns": args.turns, "concurrency": args.concurrency,
        "cpus": psutil.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print("RESULT " + json.dumps(result))


async def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}")
        try:
            _reader, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise SystemExit(f"nothing answered on {host}:{port} within {timeout_s} s")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="1,2,4,8", help="node counts to measure")
    p.add_argument("--latency-ms", type=float, default=50.0, help="simulated inference latency per request")
    p.add_argument("--turns", type=int, default=4, help="inference requests per job")
    p.add_argument("--concurrency", type=int, default=8, help="jobs in flight per node's run process")
    p.add_argument("--seconds", type=float, default=8.0, help="target length of each measurement")
    p.add_argument("--start-timeout-s", type=float, default=120.0, help="how long workers may take to register")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay on what each node sends (its cable)")
    p.add_argument("--loss-percent", type=float, default=0.0, help="loss on what each node sends (its cable)")
    p.add_argument("--collect-timeout-s", type=float, default=600.0, help="how long one measurement may take")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
