"""The Docker backend for real, against the engine scripts/install-podman sets up (podman's
Docker API socket, the installed docker CLI): bash framed exactly as on bwrap, IPython,
the editor, limits held by the engine, and no container left after destroy or reaping."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from rollstream.sandboxes import Reaper, SandboxClient, SandboxLimits, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends.docker import DockerBackend, client_env, container_name

BASE_IMAGE = os.environ.get("ROLLSTREAM_BASE_IMAGE", "localhost/rollstream/python:bookworm")


def _docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, env={**os.environ, **client_env()},
                          timeout=60)


def _image_present() -> bool:
    return DockerBackend().available() and _docker("image", "inspect", BASE_IMAGE).returncode == 0


pytestmark = pytest.mark.skipif(not _image_present(),
                                reason=f"no Docker engine with {BASE_IMAGE} (scripts/install-podman)")


def _containers(sandbox_id: str) -> list[str]:
    listed = _docker("ps", "--all", "--quiet", "--filter", f"label=rollstream.sandbox={sandbox_id}")
    return listed.stdout.split()


@pytest.fixture
async def docker_sandbox(root_dir):
    spec = SandboxSpec(backend="docker", image=BASE_IMAGE, limits=SandboxLimits(max_processes=64, memory_mb=512))
    handle = await create_sandbox(spec, sandbox_id="dk1", root_dir=root_dir)
    yield handle
    await destroy_sandbox(handle)
    assert _containers("dk1") == []


async def test_docker_bash_output_has_no_echo_and_plain_newlines(docker_sandbox):
    async with SandboxClient(docker_sandbox.socket_path) as sb:
        result = await sb.bash("echo hi; pwd; printf 'a\\nb\\n'")
        assert result.output == "hi\n/workspace\na\nb\n"
        assert result.exit_code == 0
        assert (await sb.bash("cd /tmp && export X=7; false")).exit_code == 1
        assert (await sb.bash("echo $X; pwd")).output == "7\n/tmp\n"


async def test_docker_bash_timeout_interrupts_with_ctrl_c_inside_the_container(docker_sandbox):
    async with SandboxClient(docker_sandbox.socket_path) as sb:
        result = await sb.bash("echo start; sleep 30; echo never", timeout_s=2)
        assert result.timed_out and "never" not in result.output
        assert (await sb.bash("echo after")).output == "after\n"


async def test_docker_ipython_and_editor_work_in_the_container(docker_sandbox):
    async with SandboxClient(docker_sandbox.socket_path) as sb:
        out = await sb.ipython("import platform, os; print(os.path.exists('/etc/debian_version'), 6 * 7)")
        assert out.stdout == "True 42\n", out
        await sb.edit("create", "/workspace/m.py", file_text="x = 1\n")
        await sb.edit("str_replace", "/workspace/m.py", old_str="x = 1", new_str="x = 2")
        assert (await sb.bash("python3 -c 'import m; print(m.x)'")).output == "2\n"


async def test_docker_limits_are_held_by_the_engine(docker_sandbox):
    container = container_name("dk1")
    inspected = json.loads(_docker("inspect", container).stdout)[0]["HostConfig"]
    assert inspected["PidsLimit"] == 64 and inspected["Memory"] == 512 * 2**20
    assert inspected["NetworkMode"] == "none"
    async with SandboxClient(docker_sandbox.socket_path) as sb:
        fork_until_refused = (
            "import os, signal, time\nkids = []\ntry:\n    for _ in range(200):\n        pid = os.fork()\n"
            "        if pid == 0:\n            time.sleep(30)\n            os._exit(0)\n        kids.append(pid)\n"
            "except OSError:\n    pass\nprint(len(kids))\nfor pid in kids:\n    os.kill(pid, signal.SIGKILL)\n"
            "    os.waitpid(pid, 0)\n"
        )
        await sb.edit("create", "/workspace/forks.py", file_text=fork_until_refused)
        forked = await sb.bash("python3 /workspace/forks.py", timeout_s=30)
        assert 0 < int(forked.output.split()[-1]) < 64, forked.output  # fork refused at pids.max
        probe = "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 2)\" 2>&1 | tail -1"
        assert "Error" in (await sb.bash(probe)).output


async def test_killed_supervisor_container_is_removed_by_the_reaper(root_dir):
    handle = await create_sandbox(SandboxSpec(backend="docker", image=BASE_IMAGE), sandbox_id="dk2", root_dir=root_dir)
    assert len(_containers("dk2")) == 1
    os.kill(handle.supervisor_pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    assert Reaper(root_dir).reap(lambda sandbox_id, owner: True) == ["dk2"]
    assert _containers("dk2") == []
    assert not os.path.exists(handle.dir)
