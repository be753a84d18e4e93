"""Backend command construction (all backends) and real runs where the runtime exists."""

from __future__ import annotations

import os

import pytest

from rollstream.sandboxes import SandboxClient, SandboxLimits, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends import SandboxLayout, get_backend
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.backends.singularity import SingularityBackend

LAYOUT = SandboxLayout("/tmp/rs-root/job-1")
LIMITS = SandboxLimits(memory_mb=1024, max_processes=100, cpus=2, cpu_time_s=60)


def test_docker_plan_isolates_and_labels_the_container():
    spec = SandboxSpec(backend="docker", image="python:3.11-slim", limits=LIMITS)
    plan = DockerBackend().plan(spec, LAYOUT, "job-1", "job-1")
    run = plan.start_argv
    assert run[1:3] == ["run", "--detach"]
    assert run[run.index("--name") + 1] == "rs-job-1"
    assert "rollstream.sandbox=job-1" in run
    assert run[run.index("--network") + 1] == "none"
    assert run[run.index("--memory") + 1] == "1024m"
    assert run[run.index("--pids-limit") + 1] == "100"
    assert run[run.index("--cpus") + 1] == "2.0"
    assert "/tmp/rs-root/job-1/data/work:/workspace" in run and "/tmp/rs-root/job-1/data/tmp:/tmp" in run
    assert run[-4:] == ["sleep", "--", "python:3.11-slim", "infinity"]
    assert plan.bash_argv[1:4] == ["exec", "--interactive", "--tty"]
    assert "rs-job-1" in plan.bash_argv
    assert plan.bash_argv[-5:] == ["bash", "--noediting", "--noprofile", "--norc", "-i"]
    assert plan.stop_argv[1:] == ["rm", "--force", "rs-job-1"] and plan.cleanup_argv == plan.stop_argv
    assert plan.rlimits == {}  # limits live in the container, not on the CLI


def test_docker_with_network_is_on_the_engines_bridge_never_the_hosts():
    plan = DockerBackend().plan(SandboxSpec(backend="docker", image="img", network=True), LAYOUT, "job-1", "")
    assert plan.start_argv[plan.start_argv.index("--network") + 1] == "bridge"


def test_singularity_plan_uses_instances_binds_and_containall():
    backend = SingularityBackend(binary="/usr/bin/apptainer")
    spec = SandboxSpec(backend="singularity", image="/images/py.sif", env={"A": "1"}, limits=LIMITS)
    plan = backend.plan(spec, LAYOUT, "job.1", "owner")
    start = plan.start_argv
    assert start[:3] == ["/usr/bin/apptainer", "instance", "start"]
    for flag in ("--containall", "--cleanenv", "--writable-tmpfs", "--no-home"):
        assert flag in start
    assert start[start.index("--network") + 1] == "none" and "--net" in start
    assert "/tmp/rs-root/job-1/data/work:/workspace" in start
    assert start[-2:] == ["/images/py.sif", "rs-job_1"]
    assert plan.exec_prefix[:2] == ["/usr/bin/apptainer", "exec"]
    assert plan.exec_prefix[-1] == "instance://rs-job_1"
    assert "A=1" in plan.exec_prefix
    assert "ulimit -v 1048576" in " ".join(plan.bash_argv)
    assert plan.stop_argv == ["/usr/bin/apptainer", "instance", "stop", "rs-job_1"]


def test_bwrap_plan_hides_home_and_network():
    plan = get_backend("bwrap").plan(SandboxSpec(), LAYOUT, "job-1", "")
    argv = plan.bash_argv
    assert "--unshare-all" in argv and "--share-net" not in argv
    assert argv[argv.index("/root") - 1 : argv.index("/root") + 1] == ["--tmpfs", "/root"]
    assert ["--bind", LAYOUT.work, "/workspace"] == argv[argv.index(LAYOUT.work) - 1 : argv.index(LAYOUT.work) + 2]
    assert "--clearenv" in argv and "--die-with-parent" in argv
    assert plan.rlimits["RLIMIT_AS"] == 4096 * 2**20


def test_image_backends_need_an_image():
    with pytest.raises(ValueError, match="needs an image"):
        DockerBackend().plan(SandboxSpec(backend="docker"), LAYOUT, "job-1", "")
    with pytest.raises(ValueError, match="needs an image"):
        SingularityBackend("apptainer").plan(SandboxSpec(backend="singularity"), LAYOUT, "job-1", "")


@pytest.mark.skipif(not DockerBackend().available(), reason="no Docker engine answers 'docker info' here")
async def test_docker_sandbox_runs_for_real(root_dir):
    # No registry is reachable in the suite: the image scripts/install-podman builds with mmdebstrap.
    image = os.environ.get("ROLLSTREAM_BASE_IMAGE", "localhost/rollstream/python:bookworm")
    handle = await create_sandbox(SandboxSpec(backend="docker", image=image), sandbox_id="dock", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert (await sb.bash("echo hi; pwd")).output == "hi\n/workspace\n"
    finally:
        await destroy_sandbox(handle)


@pytest.mark.skipif(not SingularityBackend().available(), reason="no apptainer/singularity binary here")
async def test_singularity_sandbox_runs_for_real(root_dir):
    spec = SandboxSpec(backend="singularity", image="docker://python:3.11-slim")
    handle = await create_sandbox(spec, sandbox_id="sing", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert (await sb.bash("echo hi; pwd")).output == "hi\n/workspace\n"
    finally:
        await destroy_sandbox(handle)
