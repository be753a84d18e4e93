"""What a run slot waits for its sandbox, and what eval takes to verify, with warm pools and without.

The whole pipeline (init, run, eval: real stage loops in this process) on a private Redis and
real bubblewrap sandboxes. Jobs arrive one every --gap-s; each job's agent works --agent-s in
its sandbox (the run stage), then eval verifies the way tasks/verification.py does: it destroys
the agent's sandbox, starts a fresh one from the pristine spec (``fresh_sandbox``), copies the
agent's change in and runs the test. "Cold": no warm pool (ROLLSTREAM_WARM_POOL_MAX_PER_NODE=0),
every sandbox is started when its job asks. "Warm": init's pool has the job's sandbox ready, and
eval's pool has started the verification sandbox while the agent worked.

- slot wait: the job's init time, from init taking it to its hand-off to run: what its run slot
  waits for a sandbox (sandbox creation, or taking a warm one, plus the task's own setup);
- eval: the eval stage's time per job.

Each backend of --backends is measured in turn: bwrap (host rootfs) and podman (the Docker
backend on podman's Docker API: export DOCKER_HOST=unix:///run/podman/podman.sock, and the base
image scripts/install-podman builds). Rounds alternate cold and warm (--rounds of each), so both
modes see the same machine; the first --warmup jobs of each round (the pools learn the spec from
them) are left out.

Run: python bench/warm_pool.py [--backends bwrap,podman] [--jobs 24] [--rounds 2] [--gap-s S] [--agent-s 0.5]
Prints a table, then `RESULT {json}` with, for each backend under its name: slot_wait_p50_s_warm,
slot_wait_p50_s_cold, slot_wait_p95_s_warm, slot_wait_p95_s_cold, slot_wait_p50_ratio (cold over
warm), eval_p50_s_early, eval_p50_s_late, eval_p95_s_early, eval_p95_s_late, hits (jobs whose
sandboxes came warm), jobs; and load_average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.messages import Envelope
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.pipeline.keys import Keys
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
from rollstream.sandboxes.supervisor_spawn import stop_fork_server
from rollstream.tasks.base import TaskContext
from rollstream.tasks.echo import EchoTask
from rollstream.tasks.registry import register_task
from rollstream.tasks.verification import agent_client, fresh_sandbox
from rollstream.trajectory import Trajectory
from rollstream.workers.process import serve_stage

# The sandbox spec of each --backends name; the bench's task reads the one measured now.
SPECS = {"bwrap": SandboxSpec(backend="bwrap"), "podman": SandboxSpec(backend="docker", image=DEFAULT_BASE_IMAGE)}
MEASURED = {"spec": SPECS["bwrap"]}
# Seconds between submissions by backend, within what its engine can start on this 2-core node
# (a job asks for two sandboxes: its own and eval's fresh one): a pool starved by jobs arriving
# faster than sandboxes start makes them wait for a start like no pool would.
GAP_S = {"bwrap": 0.4, "podman": 1.5}
CAME_WARM: dict[str, set[str]] = {"init": set(), "eval": set()}  # job ids whose sandbox was a warm one


@register_task
class _VerifiedEdit(EchoTask):
    """The agent writes a file in its sandbox; eval verifies it in a fresh sandbox."""

    name = "bench-verified-edit"

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return MEASURED["spec"]

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        if env.sandbox.id.startswith("warm-"):
            CAME_WARM["init"].add(env.job.job_id)

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        await ctx.sandbox.write_file("answer.txt", env.job.job_id)
        return await super().rollout(env, ctx)  # the agent at work for run_s

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        change = await agent_client(ctx).read_file("answer.txt")
        checker = await fresh_sandbox(env, ctx, self.sandbox_spec(env.job.instance))
        try:
            if env.sandbox.id.startswith("warm-"):
                CAME_WARM["eval"].add(env.job.job_id)
            await checker.write_file("answer.txt", change)
            test = await checker.bash(f"test \"$(cat answer.txt)\" = {env.job.job_id}")
        finally:
            await checker.close()
        return 1.0 if test.exit_code == 0 else 0.0


def _owner(root: str, name: str) -> str:
    try:
        return json.loads((Path(root) / name / "plan.json").read_text()).get("owner", "?")
    except (OSError, ValueError):
        return "no plan"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_round(base: Settings, warm: bool, args) -> tuple[list[float], list[float], int]:
    """(slot waits, eval times, warm hits) of the measured jobs of one round."""
    root = tempfile.mkdtemp(prefix="rs-wp-", dir="/tmp")
    os.chmod(root, 0o711)
    settings = base.model_copy(update={"namespace": f"wp{uuid.uuid4().hex[:8]}", "sandbox_root": root,
                                       "warm_pool_max_per_node": args.pool if warm else 0})
    stages = [asyncio.create_task(serve_stage(stage, settings, args.slots)) for stage in ("init", "run", "eval")]
    r = async_redis(settings.redis_url)
    try:
        while await r.zcard(Keys(settings.namespace).workers) < 3:
            await asyncio.sleep(0.05)
        async with AsyncClient(settings=settings) as client:
            ids = []
            for _ in range(args.jobs):
                ids.append(await client.submit({"task": _VerifiedEdit.name,
                                                "instance": {"prompt": "p", "run_s": args.agent_s}}))
                await asyncio.sleep(args.gap_s or GAP_S[args.backend])
            results = {res.job_id: res for res in await client.collect(args.jobs, timeout_s=600)}
    finally:
        for task in stages:
            task.cancel()
        await asyncio.gather(*stages, return_exceptions=True)
        await r.aclose()
        await stop_fork_server(root)
        leftovers = [f"{n} (owner {_owner(root, n)})" for n in os.listdir(root) if not n.startswith(".")]
        shutil.rmtree(root, ignore_errors=True)
    bad = [res for res in results.values() if not res.ok or res.reward != 1.0]
    if bad or len(results) != args.jobs or leftovers:
        raise SystemExit(f"round failed: {len(bad)} bad results ({bad[:1]}), {len(results)} of {args.jobs}, "
                         f"sandboxes left behind: {leftovers}")
    measured = ids[args.warmup:]
    hits = sum(1 for j in measured if j in CAME_WARM["init"]) + sum(1 for j in measured if j in CAME_WARM["eval"])
    return ([results[j].timings_s["init_s"] for j in measured], [results[j].timings_s["eval_s"] for j in measured],
            hits)


async def one_backend(base: Settings, args) -> dict:
    """The rounds of the backend in MEASURED, alternating cold and warm, and their figures."""
    waits: dict[str, list[float]] = {"cold": [], "warm": []}
    evals: dict[str, list[float]] = {"cold": [], "warm": []}
    hits = 0
    for _ in range(args.rounds):
        for mode in ("cold", "warm"):
            w, e, h = await one_round(base, mode == "warm", args)
            waits[mode] += w
            evals[mode] += e
            hits += h if mode == "warm" else 0
    measured = args.rounds * (args.jobs - args.warmup)
    return {
        "slot_wait_p50_s_warm": round(statistics.median(waits["warm"]), 4),
        "slot_wait_p50_s_cold": round(statistics.median(waits["cold"]), 4),
        "slot_wait_p95_s_warm": round(percentile(waits["warm"], 0.95), 4),
        "slot_wait_p95_s_cold": round(percentile(waits["cold"], 0.95), 4),
        "slot_wait_p50_ratio": round(statistics.median(waits["cold"]) / max(statistics.median(waits["warm"]), 1e-6), 1),
        "eval_p50_s_early": round(statistics.median(evals["warm"]), 4),
        "eval_p50_s_late": round(statistics.median(evals["cold"]), 4),
        "eval_p95_s_early": round(percentile(evals["warm"], 0.95), 4),
        "eval_p95_s_late": round(percentile(evals["cold"], 0.95), 4),
        "hits": f"{hits}/{2 * measured}",
        "jobs": measured,
    }


async def main(args) -> dict:
    data = Path(tempfile.mkdtemp(prefix="rs-wp-redis-"))
    redis = EmbeddedRedis(data, appendonly=False).start()
    out: dict = {}
    try:
        base = Settings(redis_url=redis.url, data_dir=data / "node", node="bench", read_block_ms=200,
                        warm_pool_check_s=0.1)
        for backend in args.backends.split(","):
            MEASURED["spec"], args.backend = SPECS[backend], backend
            out[backend] = await one_backend(base, args)
    finally:
        redis.stop()
        shutil.rmtree(data, ignore_errors=True)
    out["load_average"] = round(os.getloadavg()[0], 1)
    print(f"{'':12}{'':28}{'p50 s':>10}{'p95 s':>10}   ({args.rounds} rounds of each mode, alternating)")
    for backend, fig in out.items():
        if backend == "load_average":
            continue
        for label, key in (("run slot waits, warm pool", "slot_wait_%s_s_warm"),
                           ("run slot waits, no pool", "slot_wait_%s_s_cold"),
                           ("eval, verification early", "eval_%s_s_early"),
                           ("eval, verification late", "eval_%s_s_late")):
            print(f"{backend:12}{label:28}{fig[key % 'p50']:>10.4f}{fig[key % 'p95']:>10.4f}")
        print(f"{backend:12}slot wait p50, no pool / warm: {fig['slot_wait_p50_ratio']}x; warm sandboxes taken "
              f"(init + eval): {fig['hits']} of {fig['jobs']} jobs' two")
    print(f"load average at the end: {out['load_average']}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="bwrap,podman", help="comma-separated: bwrap, podman")
    parser.add_argument("--jobs", type=int, default=24, help="jobs per round")
    parser.add_argument("--warmup", type=int, default=4, help="first jobs of a round left out (the pools learn)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
    parser.add_argument("--gap-s", type=float, default=0.0,
                        help=f"seconds between submissions (default by backend: {GAP_S})")
    parser.add_argument("--agent-s", type=float, default=0.5, help="seconds each agent works in its sandbox")
    parser.add_argument("--slots", type=int, default=8, help="concurrency of each stage (the run slots)")
    parser.add_argument("--pool", type=int, default=4, help="ROLLSTREAM_WARM_POOL_MAX_PER_NODE when warm")
    started = time.monotonic()
    result = asyncio.run(main(parser.parse_args()))
    result["wall_s"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result))
