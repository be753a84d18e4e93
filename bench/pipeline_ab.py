"""A/B of the pipeline's one-job-at-a-time latency between two commits, side by side.

This machine's host runs at very different speeds from one minute to the next (see the
speed probe in bench/pipeline.py). Two runs of bench/pipeline.py minutes apart therefore
differ more than most changes do. This harness runs both commits at once on one Redis: each
commit gets its own namespace, its own three worker processes and its own client process.
The two clients take turns, in windows of N jobs, in alternating order. It reports the
difference per pair of windows, and the p50 of pairs whose speed probe stayed steady.

    python bench/pipeline_ab.py --base de1fc11 [--new WORKTREE_OR_REV] [--pairs 40] [--window 200]

``--base``/``--new``: a git revision (checked out into a temporary worktree) or a folder
holding a rollstream checkout; ``--new`` defaults to this checkout. Each side runs with
its own code on its default event loop. Last line: ``RESULT {json}`` with
``p50_ms_base``, ``p50_ms_new``, ``median_diff_ms``, ``new_faster_pairs``, ``pairs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
from pipeline import speed_probe_ms  # bench/pipeline.py, beside this file

from rollstream.pipeline.embedded import EmbeddedRedis

REPO = Path(__file__).resolve().parent.parent

# Runs inside each side's client process, on that side's code: reads a window size from
# stdin, submits that many echo jobs one at a time, prints the window's p50 in ms.
CLIENT = r"""
import asyncio, statistics, sys, time
from pathlib import Path
from rollstream.client import AsyncClient
from rollstream.config import Settings

async def main(url, ns, work):
    s = Settings(redis_url=url, namespace=ns, data_dir=Path(work), node="bench")
    async with AsyncClient(settings=s) as client:
        while await client.r.zcard(client.keys.workers) < 3:
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        while (line := await loop.run_in_executor(None, sys.stdin.readline)):
            lat = []
            for i in range(int(line)):
                t0 = time.perf_counter()
                await client.submit({"task": "echo", "instance": {"prompt": f"p{i}"}})
                async for _ in client.results(timeout_s=30, max_results=1):
                    pass
                lat.append((time.perf_counter() - t0) * 1000)
            print(statistics.median(lat), flush=True)

try:
    from rollstream import eventloop
    choice = Settings().event_loop
    run = lambda coro: eventloop.run(coro, choice)
except (ImportError, AttributeError):  # a commit from before the event_loop setting
    run = asyncio.run
run(main(*sys.argv[1:4]))
"""


def checkout(rev_or_dir: str, keep: list[Path]) -> Path:
    """A folder with the code of ``rev_or_dir``."""
    if Path(rev_or_dir).is_dir():
        return Path(rev_or_dir).resolve()
    where = Path(tempfile.mkdtemp(prefix="rs-ab-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(where), rev_or_dir],
                   check=True, capture_output=True)
    keep.append(where)
    return where


class Side:
    """One commit's workers and client on the shared Redis."""

    def __init__(self, name: str, tree: Path, url: str):
        self.name, self.namespace = name, f"ab{name}{uuid.uuid4().hex[:4]}"
        work = tempfile.mkdtemp(prefix=f"rs-ab-{name}-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        env = {**os.environ, "PYTHONPATH": str(tree), "REDIS_URL": url, "ROLLSTREAM_NAMESPACE": self.namespace,
               "ROLLSTREAM_NODE": "bench", "ROLLSTREAM_DATA_DIR": work, "ROLLSTREAM_READ_BLOCK_MS": "1000"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "rollstream", "worker", stage, "--concurrency", "256"],
                                       env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                      for stage in ("init", "run", "eval")]
        self.client = subprocess.Popen([sys.executable, "-c", CLIENT, url, self.namespace, work], env=env, cwd=tree,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(self.client)

    def window(self, n: int) -> float:
        self.client.stdin.write(f"{n}\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.name} side's client exited; run its code alone to see why")
        return float(line)

    def cpu_s(self) -> float:
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision or folder of the baseline")
    ap.add_argument("--new", default=str(REPO), help="git revision or folder (default: this checkout)")
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--window", type=int, default=200)
    args = ap.parse_args()
    worktrees: list[Path] = []
    try:
        trees = {"base": checkout(args.base, worktrees), "new": checkout(args.new, worktrees)}
        with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="rs-ab-redis-"))) as server:
            sides = {name: Side(name, tree, server.url) for name, tree in trees.items()}
            try:
                for side in sides.values():
                    side.window(100)  # warm-up
                rows, cpu = [], {name: [] for name in sides}
                for i in range(args.pairs):
                    before, got = speed_probe_ms(), {}
                    for name in (("base", "new") if i % 2 == 0 else ("new", "base")):
                        c0, r0 = sides[name].cpu_s(), sum(psutil.Process(server.proc.pid).cpu_times()[:2])
                        got[name] = sides[name].window(args.window)
                        redis_s = sum(psutil.Process(server.proc.pid).cpu_times()[:2]) - r0
                        cpu[name].append((sides[name].cpu_s() - c0 + redis_s) * 1000 / args.window)
                    rows.append((before, speed_probe_ms(), got["base"], got["new"]))
            finally:
                for side in sides.values():
                    side.stop()
    finally:
        for where in worktrees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], capture_output=True)
    diffs = [new - base for _p0, _p1, base, new in rows]
    steady = [(p0, base, new) for p0, p1, base, new in rows if abs(p1 - p0) / min(p0, p1) < 0.15]
    out = {"p50_ms_base": round(statistics.median(r[2] for r in rows), 3),
           "p50_ms_new": round(statistics.median(r[3] for r in rows), 3),
           "median_diff_ms": round(statistics.median(diffs), 3),
           "new_faster_pairs": sum(d < 0 for d in diffs), "pairs": len(rows),
           "cpu_ms_per_job_base": round(statistics.median(cpu["base"]), 3),
           "cpu_ms_per_job_new": round(statistics.median(cpu["new"]), 3)}
    print(f"{'':42} {'base':>8} {'new':>8} {'new − base':>11}")
    print(f"{'p50 of window p50s, ms':42} {out['p50_ms_base']:8.3f} {out['p50_ms_new']:8.3f} "
          f"{out['median_diff_ms']:+11.3f}"
          f"   (new faster in {out['new_faster_pairs']} of {len(rows)} pairs)")
    print(f"{'CPU per job, ms (workers, client, Redis)':42} {out['cpu_ms_per_job_base']:8.3f} "
          f"{out['cpu_ms_per_job_new']:8.3f}")
    for label, lo, hi in (("steady pairs, fast host (probe < 10 ms)", 0, 10),
                          ("steady pairs, slow host (probe ≥ 10 ms)", 10, 1e9)):
        sel = [(b, n) for p, b, n in steady if lo <= p < hi]
        if sel:
            base, new = statistics.median(b for b, _ in sel), statistics.median(n for _, n in sel)
            out[f"p50_ms_{'fast' if lo == 0 else 'slow'}_host"] = [round(base, 3), round(new, 3), len(sel)]
            print(f"{label:42} {base:8.3f} {new:8.3f} {new - base:+11.3f}   ({len(sel)} pairs)")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
