"""Per-rollout init of a Harbor task from its cached environment image, and what verifying in a
fresh sandbox costs against verifying in the agent's own sandbox.

Init = what the init stage does for one job of the ``harbor`` task: find the environment image
built (cached by content: no build), create the sandbox from it (bwrap: the exported rootfs;
podman: the image) and unpack the workdir the Dockerfile left. Verification = eval's work after
the agent ran the task's solve.sh: fresh (rollstream's way: stop the agent's sandbox, read its
workdir, a new sandbox from the pristine image, the agent's files over it, tests/test.sh) vs in
place (test.sh run in the agent's live sandbox, as peers do: cheaper, and forgeable).

Run: python bench/harbor_env.py [--task tests/tasks/harbor_tasks/hello-file] [--rollouts 10]
Prints a table, then `RESULT {json}` with init_cached_p50_s (bwrap; target <= 1 s),
init_cached_docker_p50_s, verify_fresh_p50_s, verify_in_place_p50_s, image_build_s (0 when it
was cached already), rollouts.
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
from pathlib import Path

from rollstream.config import load_settings
from rollstream.messages import Envelope, Job
from rollstream.sandboxes import destroy_sandbox
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.supervisor_spawn import stop_fork_server
from rollstream.tasks import harbor_verify
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor import HarborTask
from rollstream.tasks.harbor_folder import TaskFolder
from rollstream.tasks.harbor_image import ensure_image
from rollstream.trajectory import Trajectory
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

DEFAULT_TASK = Path(__file__).resolve().parent.parent / "tests" / "tasks" / "harbor_tasks" / "hello-file"
SOLVE = "mkdir -p /solution && tar -xf /tmp/.rs-solution.tar -C /solution && bash /solution/solve.sh"


async def init(path: str, sandboxes: NodeSandboxes) -> tuple[float, Envelope, TaskContext]:
    """One rollout's init from the cached image; returns seconds, the job and its context."""
    env = Envelope(job=Job(task="harbor", instance={"path": path}))
    ctx = TaskContext(node="bench", work_dir=Path(sandboxes.root))
    started = time.perf_counter()
    await set_up(HarborTask(), env, ctx, sandboxes)
    return time.perf_counter() - started, env, ctx


async def solved(path: str, sandboxes: NodeSandboxes) -> tuple[Envelope, TaskContext]:
    """A job whose agent ran the task's solve.sh."""
    _, env, ctx = await init(path, sandboxes)
    solution = TaskFolder.load(path).files("solution").tar()
    async with sandboxes.connected(env) as sandbox:
        await sandbox.write_file("/tmp/.rs-solution.tar", solution)
        result = await sandbox.bash(SOLVE)
        if result.exit_code != 0:
            raise SystemExit(f"solve.sh failed: {result.output[-500:]}")
    env.trajectory = Trajectory()
    return env, ctx


async def verify_fresh(path: str, sandboxes: NodeSandboxes) -> tuple[float, float]:
    env, ctx = await solved(path, sandboxes)
    try:
        async with sandboxes.connected(env) as sandbox:
            ctx.sandbox, ctx.sandboxes = sandbox, sandboxes
            started = time.perf_counter()
            reward = await HarborTask().score(env, ctx)
            return time.perf_counter() - started, reward
    finally:
        await sandboxes.destroy(env)


async def verify_in_place(path: str, sandboxes: NodeSandboxes) -> tuple[float, float]:
    env, _ = await solved(path, sandboxes)
    folder = TaskFolder.load(path)
    try:
        async with sandboxes.connected(env) as sandbox:
            started = time.perf_counter()
            tests = folder.files("tests").tar()
            await sandbox.bash(f"mkdir -p {harbor_verify.EVAL_DIR}")
            await sandbox.write_file(f"{harbor_verify.EVAL_DIR}/tests.tar", tests)
            reward = await harbor_verify.run_tests(env, sandbox, folder, env.sandbox.workdir,
                                                   folder.config.verifier.timeout_sec)
            return time.perf_counter() - started, reward
    finally:
        await sandboxes.destroy(env)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default=str(DEFAULT_TASK), help="a Harbor task folder with solution/solve.sh")
    parser.add_argument("--rollouts", type=int, default=10, help="sequential cached inits per backend")
    parser.add_argument("--verifications", type=int, default=5, help="verifications of each kind")
    args = parser.parse_args()

    path = os.path.realpath(args.task)
    os.environ["ROLLSTREAM_HARBOR_TASK_ROOTS"] = json.dumps([os.path.dirname(path)])  # as its operator allows
    started = time.perf_counter()
    image = ensure_image(TaskFolder.load(path), load_settings().harbor_base_images, rootfs=True)
    result: dict = {"image_build_s": round(time.perf_counter() - started, 2) if image.built else 0.0}
    root = tempfile.mkdtemp(prefix="rs-bhe-", dir="/tmp")
    rows = []
    try:
        sandboxes = NodeSandboxes(root=root, backend="bwrap")
        _, env, _ = await init(path, sandboxes)  # warm the fork server (not counted)
        await destroy_sandbox(env.sandbox)
        times = []
        for _ in range(args.rollouts):
            seconds, env, _ = await init(path, sandboxes)
            times.append(seconds)
            await destroy_sandbox(env.sandbox)
        result["init_cached_p50_s"] = round(statistics.median(times), 3)
        rows.append(("init, bwrap, cached image", len(times), statistics.median(times), max(times)))

        if DockerBackend().available():
            docker = NodeSandboxes(root=root, backend="docker")
            times = []
            for _ in range(max(2, args.rollouts // 2)):
                seconds, env, _ = await init(path, docker)
                times.append(seconds)
                await destroy_sandbox(env.sandbox)
            result["init_cached_docker_p50_s"] = round(statistics.median(times), 3)
            rows.append(("init, podman (docker API), cached image", len(times), statistics.median(times), max(times)))

        for label, verify, key in (("verify, fresh sandbox (rollstream)", verify_fresh, "verify_fresh_p50_s"),
                                   ("verify, in the agent's sandbox", verify_in_place, "verify_in_place_p50_s")):
            outcomes = [await verify(path, sandboxes) for _ in range(args.verifications)]
            if any(reward != 1.0 for _, reward in outcomes):
                raise SystemExit(f"{label}: the reference solution did not score 1: {outcomes}")
            times = [seconds for seconds, _ in outcomes]
            result[key] = round(statistics.median(times), 3)
            rows.append((label, len(times), statistics.median(times), max(times)))
        result["rollouts"] = args.rollouts
    finally:
        await stop_fork_server(root)
        shutil.rmtree(root, ignore_errors=True)

    print(f"{'':<44} {'n':>4} {'p50 s':>8} {'max s':>8}")
    for label, count, p50, worst in rows:
        print(f"{label:<44} {count:>4} {p50:>8.3f} {worst:>8.3f}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
