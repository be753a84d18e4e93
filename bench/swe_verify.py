"""What verifying a SWE rollout in a fresh sandbox costs against verifying it in place.

Both score the same agent work (the gold patch applied by the "agent") of a shipped instance
on bubblewrap. In place = what eval did before: take the agent's diff in its own sandbox, reset
the checkout, apply the diff and the test_patch, run the tests there. Fresh = what eval does
now (tasks/swe_eval.py): stop the agent's sandbox, read its checkout from the host, destroy it,
start a new sandbox from the same spec, check base_commit out again, rebuild the diff with the
image's git, apply, run the tests. The agent's init is outside both timings; each rollout gets
a new agent sandbox.

The test run itself (pytest in the sandbox) is the same work both ways and the noisiest part on
a shared machine, so each way is also timed without it ("before the tests": what verification
adds around the tests).

Run: python bench/swe_verify.py [--rollouts 4] [--instance rollstream__minicalc-1]
Prints a table, then `RESULT {json}` with fresh_p50_s, in_place_p50_s, ratio (fresh / in place
at p50), fresh_before_tests_p50_s, in_place_before_tests_p50_s, tests_p50_s, rollouts, instance,
backend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollstream.messages import Envelope, Job
from rollstream.sandboxes.supervisor_spawn import stop_fork_server
from rollstream.tasks import eval_report, swe_eval, swe_records
from rollstream.tasks.base import TaskContext
from rollstream.tasks.swe import SweTask, load_instances
from rollstream.trajectory import Trajectory
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def agent_rollout(inst: dict, sandboxes: NodeSandboxes, ctx: TaskContext, number: int) -> Envelope:
    """Init as the stage does it, then the agent's work: the gold patch in the checkout."""
    task = SweTask()
    env = Envelope(job=Job(task="swe", instance=inst, job_id=f"bench-verify-{number}"))
    await set_up(task, env, ctx, sandboxes)
    async with sandboxes.connected(env) as sb:
        await sb.write_file("/tmp/agent.patch", inst["patch"])
        repo = task.repo_dir(inst, env.sandbox.workdir)
        applied = await sb.bash(f"cd {shlex.quote(repo)} && git apply /tmp/agent.patch && rm /tmp/agent.patch")
        assert applied.exit_code == 0, applied.output
    env.trajectory = Trajectory()
    return env


async def in_place(env: Envelope, ctx: TaskContext, sandboxes: NodeSandboxes) -> float:
    """The old way: everything in the agent's live sandbox."""
    inst = swe_records.normalize(env.job.instance)
    repo = SweTask().repo_dir(inst, env.sandbox.workdir)
    base = shlex.quote(inst["base_commit"])
    async with sandboxes.connected(env) as sb:
        patch = await swe_eval.agent_diff(sb, repo, inst["base_commit"], swe_eval.excluded_pathspecs(inst))
        reset = await sb.bash(f"cd {shlex.quote(repo)} && git reset -q --hard {base} && git clean -qfdx")
        assert reset.exit_code == 0, reset.output
        limit_s = eval_report.eval_timeout_s(inst, default=120.0)
        return await swe_eval.apply_and_test(env, sb, inst, repo, patch, limit_s)


async def fresh(env: Envelope, ctx: TaskContext, sandboxes: NodeSandboxes) -> float:
    """The new way: eval's own scoring."""
    async with sandboxes.connected(env) as sb:
        ctx.sandbox, ctx.sandboxes = sb, sandboxes
        return await SweTask().score(env, ctx)


TEST_RUNS: list[float] = []  # seconds of each test run (swe_eval._run_tests), appended as they end
_run_tests = swe_eval._run_tests


async def _timed_run_tests(*args, **kwargs) -> float:
    started = time.perf_counter()
    try:
        return await _run_tests(*args, **kwargs)
    finally:
        TEST_RUNS.append(time.perf_counter() - started)


swe_eval._run_tests = _timed_run_tests  # the same test run both ways: timed apart


async def measure(way: Callable[[Envelope, TaskContext, NodeSandboxes], Awaitable[float]], inst: dict,
                  sandboxes: NodeSandboxes, ctx: TaskContext, rollouts: int, first: int) -> list[tuple[float, float]]:
    """(whole verification, its test run) in seconds, per rollout."""
    seconds = []
    for number in range(first, first + rollouts):
        env = await agent_rollout(inst, sandboxes, ctx, number)
        try:
            started = time.perf_counter()
            reward = await way(env, ctx, sandboxes)
            seconds.append((time.perf_counter() - started, TEST_RUNS[-1]))
            assert reward == 1.0, env.trajectory.extra.get("eval")
        finally:
            await sandboxes.destroy(env)
    return seconds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts verified each way (alternating blocks)")
    parser.add_argument("--instance", default="rollstream__minicalc-1", help="a shipped instance id")
    args = parser.parse_args()

    inst = next(i for i in load_instances() if i["instance_id"] == args.instance)
    root = tempfile.mkdtemp(prefix="rs-bsv-", dir="/tmp")
    Path(root).chmod(0o711)
    sandboxes = NodeSandboxes(root=root, backend="bwrap")
    ctx = TaskContext(node="bench", work_dir=Path(root))
    try:
        await measure(fresh, inst, sandboxes, ctx, 1, 0)  # warm: the mirror's bundle, the fork server
        in_place_s, fresh_s = [], []
        half = max(1, args.rollouts // 2)
        for block in (half, args.rollouts - half):  # alternate, so drift on a shared machine hits both
            in_place_s += await measure(in_place, inst, sandboxes, ctx, block, 1000 + len(in_place_s))
            fresh_s += await measure(fresh, inst, sandboxes, ctx, block, 2000 + len(fresh_s))
    finally:
        await stop_fork_server(root)
        shutil.rmtree(root, ignore_errors=True)

    rows = {"in place (before)": in_place_s, "fresh sandbox (now)": fresh_s}
    print(f"{'verification':<22}{'n':>3}{'p50 s':>8}{'mean s':>8}{'min s':>8}{'max s':>8}"
          f"{'before tests p50 s':>20}{'tests p50 s':>13}")
    for name, pairs in rows.items():
        whole = [w for w, _ in pairs]
        print(f"{name:<22}{len(whole):>3}{percentile(whole, 0.5):>8.3f}{statistics.mean(whole):>8.3f}"
              f"{min(whole):>8.3f}{max(whole):>8.3f}{percentile([w - t for w, t in pairs], 0.5):>20.3f}"
              f"{percentile([t for _, t in pairs], 0.5):>13.3f}")
    fresh_p50, in_place_p50 = percentile([w for w, _ in fresh_s], 0.5), percentile([w for w, _ in in_place_s], 0.5)
    fresh_before = percentile([w - t for w, t in fresh_s], 0.5)
    in_place_before = percentile([w - t for w, t in in_place_s], 0.5)
    print(f"fresh / in place at p50: {fresh_p50 / in_place_p50:.2f}x; before the tests: "
          f"{fresh_before:.3f} s against {in_place_before:.3f} s (+{fresh_before - in_place_before:.3f} s a rollout)")
    print("RESULT " + json.dumps({
        "fresh_p50_s": round(fresh_p50, 4), "in_place_p50_s": round(in_place_p50, 4),
        "ratio": round(fresh_p50 / in_place_p50, 3), "fresh_before_tests_p50_s": round(fresh_before, 4),
        "in_place_before_tests_p50_s": round(in_place_before, 4),
        "tests_p50_s": round(percentile([t for _, t in fresh_s + in_place_s], 0.5), 4),
        "rollouts": len(fresh_s), "instance": args.instance, "backend": "bwrap"}))


if __name__ == "__main__":
    asyncio.run(main())
