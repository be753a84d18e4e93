"""Real Terminal-Bench / Harbor tasks through rollstream's own Harbor path, here, offline.

For each task folder of a folder (Harbor's format, or Terminal-Bench's original task.yaml format,
converted by rollstream.tasks.harbor_legacy): build its environment image as init does (base
images mapped to local ones), then run it twice as a rollout: with its own solution/solve.sh as
the agent (Harbor's oracle: reward 1 expected) and with no change (reward 0 expected), each
verified as eval does, in a fresh sandbox from the pristine image plus the agent's workdir.

Run: python bench/harbor_real_tasks.py TASKS_DIR [--tasks a,b] [--backend bwrap|docker]
TASKS_DIR holds task folders (fetched from a public repository, e.g. the Terminal-Bench datasets;
never committed). Prints a table (task, build s, oracle reward, empty reward, verify s, tests, note),
then `RESULT {json}`: tasks, passed (oracle 1 and empty 0), per-task figures (with the tests the
verifier reported passed, of all, for the oracle and for no change) and failures.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ modules, when run as a script

from harbor_env import SOLVE, init  # noqa: E402

from rollstream.config import load_settings  # noqa: E402
from rollstream.sandboxes.errors import ToolError  # noqa: E402
from rollstream.sandboxes.supervisor_spawn import stop_fork_server  # noqa: E402
from rollstream.tasks.harbor import HarborTask  # noqa: E402
from rollstream.tasks.harbor_folder import TaskFolder  # noqa: E402
from rollstream.tasks.harbor_image import EnvBuildFailed, ensure_image  # noqa: E402
from rollstream.tasks.harbor_legacy import LegacyTaskError, convert_terminal_bench, is_legacy_task  # noqa: E402
from rollstream.trajectory import Trajectory  # noqa: E402
from rollstream.workers.node_sandboxes import NodeSandboxes  # noqa: E402

# Base images of Terminal-Bench tasks -> images built here (scripts/install-podman builds both):
# Python 3.13 on Debian 13 for t-bench's python-3-13 and ubuntu-24-04, Debian 12 for the rest.
BASE_IMAGES = {
    "ghcr.io/laude-institute/t-bench/python-3-13*": "localhost/rollstream/python:trixie",
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04*": "localhost/rollstream/python:trixie",
    "python:3.13*": "localhost/rollstream/python:trixie",
    "ubuntu:24.04": "localhost/rollstream/python:trixie",
    "python*": "localhost/rollstream/python:bookworm",
    "debian*": "localhost/rollstream/python:bookworm",
    "ubuntu*": "localhost/rollstream/python:bookworm",
    "buildpack-deps*": "localhost/rollstream/python:bookworm",
}


async def rollout(path: str, sandboxes: NodeSandboxes, solve: bool) -> tuple[float, float, str, dict]:
    """One job of the task: init, the oracle's solve.sh or nothing, then eval's fresh-sandbox
    verification. Returns the reward, the verification's seconds, eval's reason and its per-test outcomes."""
    _, env, ctx = await init(path, sandboxes)
    try:
        async with sandboxes.connected(env) as sandbox:
            solved = ""
            if solve:
                await sandbox.write_file("/tmp/.rs-solution.tar", TaskFolder.load(path).files("solution").tar())
                ran = await sandbox.bash(SOLVE, timeout_s=TaskFolder.load(path).config.agent.timeout_sec or 900)
                solved = f"solve.sh exited {ran.exit_code}: {ran.output[-300:]}; " if ran.exit_code else ""
            env.trajectory = Trajectory()
            ctx.sandbox, ctx.sandboxes = sandbox, sandboxes
            started = time.perf_counter()
            reward = await HarborTask().score(env, ctx)
            report = env.trajectory.extra.get("eval", {})
            reason = f"{solved}{report.get('reason', '')}; output: {str(report.get('output', ''))[-400:]}"
            return reward, time.perf_counter() - started, reason, report.get("tests") or {}
    finally:
        await sandboxes.destroy(env)


def _passed_of(tests: dict) -> str:
    """'3/4' passed of the per-test outcomes the verifier reported ('-' where it reported none)."""
    return f"{sum(v == 'passed' for v in tests.values())}/{len(tests)}" if tests else "-"


async def bench_task(source: Path, work: Path, sandboxes: NodeSandboxes, rootfs: bool) -> dict:
    row: dict = {"task": source.name, "format": "terminal-bench" if is_legacy_task(source) else "harbor"}
    try:
        path = convert_terminal_bench(source, work / source.name) if is_legacy_task(source) else source
        if not (path / "solution" / "solve.sh").is_file():
            return {**row, "note": "no solution/solve.sh: no oracle to run"}
        started = time.perf_counter()
        image = ensure_image(TaskFolder.load(str(path)), load_settings().harbor_base_images, rootfs)
        row["build_s"] = round(time.perf_counter() - started, 1) if image.built else 0.0
        oracle, verify_s, reason, tests = await rollout(str(path), sandboxes, solve=True)
        empty, _, empty_reason, empty_tests = await rollout(str(path), sandboxes, solve=False)
    except (LegacyTaskError, EnvBuildFailed, ToolError) as failed:
        return {**row, "note": f"{type(failed).__name__}: {str(failed)[-300:]}"}
    row.update(oracle=oracle, empty=empty, verify_s=round(verify_s, 2), passed=oracle == 1.0 and empty == 0.0,
               tests=_passed_of(tests), empty_tests=_passed_of(empty_tests))
    if oracle != 1.0:
        row["note"] = f"oracle: {reason}"
    elif empty != 0.0:
        row["note"] = f"empty: {empty_reason}"
    return row


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks_dir", help="a folder of Harbor or Terminal-Bench task folders")
    parser.add_argument("--tasks", default="", help="comma-separated folder names (default: every one)")
    parser.add_argument("--backend", default="bwrap", choices=["bwrap", "docker"])
    args = parser.parse_args()

    tasks_dir = Path(args.tasks_dir).resolve()
    names = [n for n in args.tasks.split(",") if n] or sorted(p.name for p in tasks_dir.iterdir() if p.is_dir())
    work = Path(tempfile.mkdtemp(prefix="rs-bhr-", dir="/tmp"))
    os.environ["ROLLSTREAM_HARBOR_TASK_ROOTS"] = json.dumps([str(tasks_dir), str(work)])
    os.environ.setdefault("ROLLSTREAM_HARBOR_BASE_IMAGES", json.dumps(BASE_IMAGES))
    root = tempfile.mkdtemp(prefix="rs-bhr-sb-", dir="/tmp")
    rows = []
    try:
        sandboxes = NodeSandboxes(root=root, backend=args.backend)
        for name in names:
            rows.append(await bench_task(tasks_dir / name, work, sandboxes, rootfs=args.backend == "bwrap"))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        await stop_fork_server(root)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'task':<44} {'build s':>8} {'oracle':>7} {'empty':>6} {'verify s':>9} {'tests':>6} {'empty':>6}  note")
    for r in rows:
        print(f"{r['task'][:44]:<44} {r.get('build_s', '-'):>8} {r.get('oracle', '-'):>7} {r.get('empty', '-'):>6} "
              f"{r.get('verify_s', '-'):>9} {r.get('tests', '-'):>6} {r.get('empty_tests', '-'):>6}  "
              f"{r.get('note', '')[:120]}")
    passed = [r["task"] for r in rows if r.get("passed")]
    print("RESULT " + json.dumps({"backend": args.backend, "tasks": len(rows), "passed": len(passed),
                                  "passed_tasks": passed, "per_task": rows}))


if __name__ == "__main__":
    asyncio.run(main())
