"""Per-rollout init of a real SWE instance: started from its cached environment image vs.
installing the environment in every rollout, and the cache under 64 concurrent rollouts.

Init = what the init stage does for one job of the ``swe`` task: create the sandbox (from
the environment image: bwrap an unpacked rootfs, docker/podman the image) and check the
repository out at base_commit. The baseline starts from the bare base image with network
on and installs the recipe (pip packages + the project) in each rollout, as a wrapper
must without environment images. Needs the images built (scripts/install-podman).

Run: python bench/swe_env.py [--rollouts 10] [--install-rollouts 3] [--concurrent 64]
Prints a table, then `RESULT {json}` with init_cached_p50_s, init_install_p50_s,
init_cached_docker_p50_s, concurrent_init_p50_s, concurrent_init_p95_s, concurrent_wall_s,
concurrent_rollouts, concurrent_instances, cache_builds, cache_hits, images_disk_mb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.messages import Envelope, Job
from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox, images
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE, image_exists
from rollstream.sandboxes.supervisor_spawn import stop_fork_server
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.base import TaskContext
from rollstream.tasks.swe import SweTask, load_instances
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

INSTANCES = Path(__file__).resolve().parent.parent / "rollstream" / "data" / "swe" / "pypi_instances.jsonl"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def cached_init(inst: dict, sandboxes: NodeSandboxes) -> tuple[float, Envelope]:
    """One rollout's init from the cached environment image; returns seconds and the job."""
    task = SweTask()
    env = Envelope(job=Job(task="swe", instance=inst))
    started = time.perf_counter()
    await set_up(task, env, TaskContext(node="bench", work_dir=Path(sandboxes.root)), sandboxes)
    return time.perf_counter() - started, env


async def install_init(inst: dict, sandboxes: NodeSandboxes) -> float:
    """The baseline: the bare base image, network on, the recipe installed in the rollout."""
    canonical = swe_records.normalize(inst)
    recipe = swe_env.env_recipe(canonical)
    base = {k: v for k, v in inst.items() if k not in ("environment",)}
    task = SweTask()
    env = Envelope(job=Job(task="swe", instance=base))
    started = time.perf_counter()
    spec = SandboxSpec(backend=sandboxes.backend, image=DEFAULT_BASE_IMAGE, network=True,
                       env={"PIP_CERT": "/etc/ssl/certs/ca-certificates.crt"})
    handle = await create_sandbox(spec, sandbox_id=f"inst-{uuid.uuid4().hex[:8]}", root_dir=sandboxes.root)
    env.sandbox = handle
    try:
        async with SandboxClient(handle.socket_path) as sb:
            await task.prepare(env, sb)
            q = shlex.quote
            repo = task.repo_dir(base, handle.workdir)
            packages = " ".join(q(p) for p in recipe.pip_packages)
            result = await sb.bash(
                f"python3 -m venv --system-site-packages /tmp/venv && . /tmp/venv/bin/activate && "
                f"python -m pip install -q {packages} && cd {q(repo)} && {recipe.install}", timeout_s=900)
            assert result.exit_code == 0, result.output[-2000:]
        return time.perf_counter() - started
    finally:
        await destroy_sandbox(handle)


def _disk_mb(paths: list[str]) -> float:
    """Bytes on disk of the files under `paths`, each inode once (rootfs folders share hard links)."""
    seen, total = set(), 0
    for path in paths:
        for root, _, files in os.walk(path):
            for name in files:
                try:
                    stat = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                if (stat.st_dev, stat.st_ino) not in seen:
                    seen.add((stat.st_dev, stat.st_ino))
                    total += stat.st_size
    return total / 2**20


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=10, help="sequential cached inits per backend")
    parser.add_argument("--install-rollouts", type=int, default=3, help="sequential installing inits (slow)")
    parser.add_argument("--concurrent", type=int, default=64, help="rollouts started at once")
    parser.add_argument("--instances", type=int, default=8, help="distinct instances among the concurrent rollouts")
    args = parser.parse_args()

    instances = load_instances(INSTANCES)
    root = tempfile.mkdtemp(prefix="rs-bse-", dir="/tmp")
    mirror = tempfile.mkdtemp(prefix="rs-bse-mirror-")
    os.environ["ROLLSTREAM_SWE_REPO_MIRRORS"] = json.dumps([mirror])  # as its node's operator would allow it
    instances = [{**i, "repo_mirror": mirror} for i in instances]
    tags = {i["instance_id"]: swe_env.sandbox_image(swe_records.normalize(i)) for i in instances}
    missing = [t for t in tags.values() if not os.path.isdir(images.rootfs_path(t))]
    if missing:
        raise SystemExit(f"{len(missing)} environment rootfs folders are not built; run scripts/install-podman")
    sandboxes = NodeSandboxes(root=root, backend="bwrap")
    rows = []
    result: dict = {}
    try:
        first = instances[0]
        # warm the bundle cache and the fork server (not counted)
        _, env = await cached_init(first, sandboxes)
        await destroy_sandbox(env.sandbox)

        times = []
        for n in range(args.rollouts):
            seconds, env = await cached_init(instances[n % len(instances)], sandboxes)
            times.append(seconds)
            await destroy_sandbox(env.sandbox)
        result["init_cached_p50_s"] = round(statistics.median(times), 3)
        rows.append(("bwrap, cached env rootfs", len(times), statistics.median(times), max(times)))

        if DockerBackend().available() and all(image_exists(tags[i["instance_id"]]) for i in instances[:3]):
            docker_sandboxes = NodeSandboxes(root=root, backend="docker")
            times = []
            for n in range(max(3, args.rollouts // 2)):
                seconds, env = await cached_init(instances[n % 3], docker_sandboxes)
                times.append(seconds)
                await destroy_sandbox(env.sandbox)
            result["init_cached_docker_p50_s"] = round(statistics.median(times), 3)
            rows.append(("podman (docker API), cached env image", len(times), statistics.median(times), max(times)))

        if os.path.isdir(images.rootfs_path(DEFAULT_BASE_IMAGE)) or image_exists(DEFAULT_BASE_IMAGE):
            images.export_rootfs(DEFAULT_BASE_IMAGE)  # the baseline's bare image, unpacked once
            times = [await install_init(instances[n % len(instances)], sandboxes) for n in range(args.install_rollouts)]
            result["init_install_p50_s"] = round(statistics.median(times), 3)
            rows.append(("bwrap, bare image + install per rollout", len(times), statistics.median(times), max(times)))

        # 64 rollouts of 8 instances at once: every one must hit the cache (no build, no install).
        chosen = instances[: args.instances]
        before = {t: os.stat(images.rootfs_path(t)).st_mtime for t in tags.values()}
        started = time.perf_counter()
        outcomes = await asyncio.gather(
            *(cached_init(chosen[n % len(chosen)], sandboxes) for n in range(args.concurrent)), return_exceptions=True)
        wall = time.perf_counter() - started
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        inits = [o[0] for o in outcomes if not isinstance(o, BaseException)]
        await asyncio.gather(*(destroy_sandbox(o[1].sandbox) for o in outcomes if not isinstance(o, BaseException)))
        after = {t: os.stat(images.rootfs_path(t)).st_mtime for t in tags.values()}
        builds = sum(before[t] != after[t] for t in tags.values())
        used = {tags[i["instance_id"]] for i in chosen}
        result.update(
            concurrent_rollouts=args.concurrent, concurrent_instances=len(chosen),
            concurrent_failures=len(failures),
            concurrent_init_p50_s=round(statistics.median(inits), 3) if inits else None,
            concurrent_init_p95_s=round(percentile(inits, 0.95), 3) if inits else None,
            concurrent_wall_s=round(wall, 2), cache_builds=builds, cache_hits=len(inits),
            images_disk_mb=round(_disk_mb([images.rootfs_path(t) for t in used])),
        )
        if inits:
            rows.append((f"bwrap, {args.concurrent} at once over {len(chosen)} instances", len(inits),
                         statistics.median(inits), max(inits)))
        if failures:
            print(f"{len(failures)} concurrent inits failed, first: {failures[0]!r}")
    finally:
        await stop_fork_server(root)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mirror, ignore_errors=True)

    print(f"{'init':<48} {'n':>4} {'p50 s':>8} {'max s':>8}")
    for label, count, p50, worst in rows:
        print(f"{label:<48} {count:>4} {p50:>8.3f} {worst:>8.3f}")
    print(f"cache: {result.get('cache_hits')} rollouts started from {result.get('concurrent_instances')} cached "
          f"images ({result.get('images_disk_mb')} MB on disk, shared), {result.get('cache_builds')} builds")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
