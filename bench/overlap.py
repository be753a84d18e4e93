"""Why the stages are separate pools: LLM-backend busy fraction and jobs/s with a slow
eval (eval = 2x the LLM time), staged pipeline vs a coupled baseline, same backend slots.

The backend is modelled as SLOTS slots with a fixed service time per rollout (the echo
task's ``run_s``): the run pool has exactly SLOTS slots, so a run-stage job holds one
backend slot while it "generates". Both sides go through the real rollstream pipeline
(embedded redis-server, worker processes):

- staged:  init (init_s) -> run (llm_s, SLOTS slots) -> eval (eval_s), each its own pool;
- coupled: each job holds its slot through init, run and eval (one run stage of
  init_s + llm_s + eval_s on the same SLOTS slots; init/eval do nothing), the design the
  seeds call the bottleneck.

Busy fraction = time the slots spend generating / (SLOTS x the backend's window, from the
first job taking a slot to the last one leaving it); busy over the whole makespan (fill
and drain of a finite batch included) is printed beside it.

    python bench/overlap.py [--jobs 400] [--slots 8] [--llm-s 0.25] [--init-s 0.05]

Last line: RESULT {"busy_staged", "busy_coupled", "throughput_ratio", ...}.
Targets: busy_staged >= 0.90, throughput_ratio >= 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.workers.pool import WorkerPool


async def _wait_workers(client: AsyncClient, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await client.r.zcard(client.keys.workers) < n:
        if time.monotonic() > deadline:
            raise SystemExit("worker processes did not register; see the pool logs")
        await asyncio.sleep(0.05)


async def _drive(settings: Settings, instances: list[dict]) -> tuple[float, list]:
    async with AsyncClient(settings=settings) as client:
        await _wait_workers(client, 3)
        t0 = time.perf_counter()
        await client.submit_many([{"task": "echo", "instance": inst} for inst in instances])
        results = await client.collect(len(instances), timeout_s=600)
        makespan = time.perf_counter() - t0
    bad = [r for r in results if r.status != "completed"]
    if len(results) < len(instances) or bad:
        raise SystemExit(f"{len(results)} of {len(instances)} results, {len(bad)} not completed: "
                         f"{bad[0].error if bad else ''}")
    return makespan, results


def run_side(url: str, data_dir: Path, slots: int, instances: list[dict], llm_s_of) -> dict:
    namespace = f"ov{uuid.uuid4().hex[:6]}"
    pool = WorkerPool(redis_url=url, namespace=namespace, node="bench", data_dir=data_dir,
                      env={"ROLLSTREAM_READ_BLOCK_MS": "100"}, log_dir=data_dir / f"logs-{namespace}")
    # init and eval get ample slots (they are sandboxes and tests, not the scarce GPU);
    # run gets exactly the backend's slots.
    pool.start("init", concurrency=256)
    pool.start("run", concurrency=slots)
    pool.start("eval", concurrency=256)
    try:
        settings = Settings(redis_url=url, namespace=namespace, data_dir=data_dir, node="bench")
        makespan, results = asyncio.run(_drive(settings, instances))
    finally:
        pool.stop()
    generating_s = sum(llm_s_of(r) for r in results)
    # The backend's window: from the first job reaching a slot to the last one leaving it
    # (the pipeline's fill and drain, init before and eval after, lie outside it).
    leave = [r.finished_at - r.timings_s.get("eval_wait_s", 0.0) - r.timings_s.get("eval_s", 0.0) for r in results]
    enter = [end - r.timings_s.get("run_s", 0.0) for end, r in zip(leave, results)]
    window_s = max(leave) - min(enter)
    return {"makespan_s": makespan, "jobs_per_s": len(results) / makespan, "window_s": window_s,
            "busy": generating_s / (slots * window_s), "busy_makespan": generating_s / (slots * makespan),
            "run_wait_p50_s": statistics.median(r.timings_s.get("run_wait_s", 0.0) for r in results),
            "eval_s_p50": statistics.median(r.timings_s.get("eval_s", 0.0) for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--slots", type=int, default=8, help="backend slots (concurrent generations)")
    ap.add_argument("--llm-s", type=float, default=0.25, help="backend service time per rollout")
    ap.add_argument("--init-s", type=float, default=0.05, help="sandbox set-up time")
    ap.add_argument("--eval-ratio", type=float, default=2.0, help="eval time as a multiple of the LLM time")
    args = ap.parse_args()
    eval_s = args.eval_ratio * args.llm_s
    tmp = Path(tempfile.mkdtemp(prefix="rs-overlap-"))
    staged_jobs = [{"prompt": f"p{i}", "init_s": args.init_s, "run_s": args.llm_s, "eval_s": eval_s}
                   for i in range(args.jobs)]
    coupled_jobs = [{"prompt": f"p{i}", "run_s": args.init_s + args.llm_s + eval_s} for i in range(args.jobs)]
    with EmbeddedRedis(tmp / "redis") as server:
        # Staged: what the run stage measured is the generation time.
        staged = run_side(server.url, tmp, args.slots, staged_jobs, lambda r: r.timings_s.get("run_s", 0.0))
        # Coupled: the slot is held for the whole job, but generates only llm_s of it.
        coupled = run_side(server.url, tmp, args.slots, coupled_jobs, lambda r: args.llm_s)
    ratio = staged["jobs_per_s"] / coupled["jobs_per_s"]
    print(f"{args.jobs} jobs, {args.slots} backend slots, init {args.init_s}s, LLM {args.llm_s}s, eval {eval_s}s")
    print(f"{'pipeline':<10} {'makespan s':>11} {'jobs/s':>8} {'backend busy':>13} {'busy/makespan':>14} "
          f"{'run wait p50 s':>15}")
    for name, side in (("staged", staged), ("coupled", coupled)):
        print(f"{name:<10} {side['makespan_s']:>11.2f} {side['jobs_per_s']:>8.2f} {side['busy']:>12.1%} "
              f"{side['busy_makespan']:>14.1%} {side['run_wait_p50_s']:>15.3f}")
    print(f"throughput staged/coupled: {ratio:.2f}x (target >= 1.5x); busy staged target >= 90%")
    print("RESULT " + json.dumps({"busy_staged": round(staged["busy"], 4), "busy_coupled": round(coupled["busy"], 4),
                                  "throughput_ratio": round(ratio, 3),
                                  "busy_staged_makespan": round(staged["busy_makespan"], 4),
                                  "busy_coupled_makespan": round(coupled["busy_makespan"], 4),
                                  "jobs_per_s_staged": round(staged["jobs_per_s"], 2),
                                  "jobs_per_s_coupled": round(coupled["jobs_per_s"], 2),
                                  "slots": args.slots, "jobs": args.jobs, "eval_over_llm": args.eval_ratio}))


if __name__ == "__main__":
    main()
