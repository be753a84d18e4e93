"""Soak: load through the Python client and the HTTP API at once, one fault per phase while
jobs are in flight, then the verdict and the leak probes after each phase, and the memory of
every process over the whole run. This is the command behind the README's reliability table.

    python bench/soak.py [--echo 10000] [--llm 500] [--faults all] [--nodes 2]

The full-disk phase puts Redis's data folder on a tmpfs (--redis-disk-mb) and fills it: it
needs root to mount; without root, --faults all leaves it out and says so.

Prints a table, then `RESULT {json}` with jobs, lost, doubled, leaked, dead_letters,
faults_injected, phases_ok, memory_growth_mib (per kind of process: end minus warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness, chaos/, beside rollstream/

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from chaos.cluster import ClusterConfig, LocalCluster  # noqa: E402
from chaos.diskfull import cannot_mount  # noqa: E402
from chaos.faults import FAULTS  # noqa: E402
from chaos.soak import SoakReport, run_soak  # noqa: E402
from rollstream.demo.arith_model import build_arith_model  # noqa: E402


def table(report: SoakReport) -> Table:
    t = Table(title="soak: one fault per phase, load through the Python client and HTTP at once")
    for col in ("fault", "what was done", "jobs (echo+llm)", "results", "lost", "doubled", "failed",
                "dead letters", "workers lost", "leaks", "s", "verdict"):
        t.add_column(col)
    for p in report.phases:
        v, lk = p.verdict, p.leaks
        leak_text = "none" if lk.ok else (f"{lk.supervisors} sup, {lk.bwrap_processes} bwrap, "
                                          f"{lk.node_sandbox_entries} set, {lk.mounts} mounts, "
                                          f"in-flight {sum(lk.backend_in_flight.values())}")
        t.add_row(p.fault, p.action, f"{p.echo_jobs}+{p.llm_jobs}", str(v.received), str(len(v.lost)),
                  str(len(v.doubled)), str(v.failed), str(v.dead_letters), str(p.workers_lost), leak_text,
                  f"{p.elapsed_s:.0f}",
                  "ok" if p.ok else "FAIL")
    return t


def memory_table(report: SoakReport) -> Table:
    t = Table(title="memory (RSS MiB, median process of each kind)")
    for col in ("process", "after warm-up", "end", "peak", "growth"):
        t.add_column(col)
    for kind, (warm, end, peak) in sorted(report.memory.items()):
        t.add_row(kind, f"{warm:.0f}", f"{end:.0f}", f"{peak:.0f}", f"{end - warm:+.0f}")
    return t


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--echo", type=int, default=10_000)
    ap.add_argument("--llm", type=int, default=500, help="arith jobs: bwrap sandbox, bash tool, built-in model")
    ap.add_argument("--faults", default="all", help=f"comma list of {','.join(FAULTS)}, or all")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-disk-mb", type=int, default=512,
                    help="size of the tmpfs under Redis's AOF when the full-disk fault runs")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    faults = list(FAULTS) if args.faults == "all" else args.faults.split(",")
    if "full-disk" in faults and cannot_mount():
        if args.faults != "all":
            raise SystemExit(f"full-disk: {cannot_mount()}")
        print(f"full-disk left out: {cannot_mount()}")
        faults.remove("full-disk")
    model_dir = None
    if args.llm:
        model_dir = build_arith_model(Path.home() / ".cache" / "rollstream" / "tests" / "arith-model")
    with tempfile.TemporaryDirectory(prefix="rs-soak-", ignore_cleanup_errors=True) as tmp:
        cfg = ClusterConfig(data_dir=Path(tmp), nodes=tuple(f"n{i + 1}" for i in range(args.nodes)),
                            concurrency=args.concurrency, model_dir=model_dir,
                            redis_disk_mb=args.redis_disk_mb if "full-disk" in faults else None)
        cluster = LocalCluster(cfg)
        t0 = time.monotonic()
        try:  # a cluster that failed to start is stopped too (its processes, the tmpfs under Redis)
            await cluster.start()
            report = await run_soak(cluster, faults, echo_total=args.echo, llm_total=args.llm, seed=args.seed)
        finally:
            await cluster.stop()
        wall = time.monotonic() - t0
    console = Console(width=200)
    console.print(table(report))
    console.print(memory_table(report))
    if report.prefix_cache_mib:
        console.print(f"model servers' prefix caches at the end: {report.prefix_cache_mib} MiB, bounded by their "
                      "budget (1 GiB by default); a model server's growth is this plus the working memory of its "
                      "first batches (see bench/README.md)")
    phases = report.phases
    result = {
        "jobs": sum(p.verdict.submitted for p in phases),
        "results": sum(p.verdict.received for p in phases),
        "lost": sum(len(p.verdict.lost) for p in phases),
        "doubled": sum(len(p.verdict.doubled) for p in phases),
        "failed": sum(p.verdict.failed for p in phases),
        "dead_letters": sum(p.verdict.dead_letters for p in phases),
        "leaked": sum(0 if p.leaks.ok else 1 for p in phases),
        "workers_lost": sum(p.workers_lost for p in phases),
        "faults_injected": [p.fault for p in phases if p.fault != "none"],
        "phases_ok": sum(p.ok for p in phases),
        "phases": len(phases),
        "worker_restarts": report.worker_restarts,
        "memory_growth_mib": {k: round(end - warm, 1) for k, (warm, end, _peak) in report.memory.items()},
        "prefix_cache_mib": report.prefix_cache_mib,
        "wall_s": round(wall, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
