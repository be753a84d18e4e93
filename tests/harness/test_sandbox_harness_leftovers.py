"""What a harness leaves behind in its sandbox is killed when the run stage is done with it, while
the sandbox lives on for eval: under bwrap its session's pid namespace goes with the session; in a
container (one pid namespace for all sessions) a fresh session kills every process but the
container's first. Real sandboxes, a process that left its session (setsid) as a daemon would."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollstream.agent.sandbox_harness import HARNESS_SESSION, _kill_leftovers
from rollstream.sandboxes import (
    SandboxClient,
    SandboxSpec,
    create_sandbox,
    destroy_sandbox,
)
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE

from .leftovers import alive

needs_podman = pytest.mark.skipif(not DockerBackend().available(), reason="no Docker API (podman) engine answers here")


@pytest.mark.parametrize("spec", [SandboxSpec(backend="bwrap"),
                                  pytest.param(SandboxSpec(backend="docker", image=DEFAULT_BASE_IMAGE),
                                               marks=needs_podman)], ids=["bwrap", "podman"])
async def test_a_process_a_harness_left_behind_is_killed_and_the_sandbox_lives_on(sandbox_root, spec):
    handle = await create_sandbox(spec, sandbox_id=f"left{uuid.uuid4().hex[:6]}", owner="test", root_dir=sandbox_root)
    seconds = str(1000 + int(uuid.uuid4().int % 900))  # this test's own marker
    try:
        async with SandboxClient(handle.socket_path) as sb:
            started = await sb.bash(f"setsid sh -c 'exec sleep {seconds}' </dev/null >/dev/null 2>&1 & echo started",
                                    timeout_s=60, session=HARNESS_SESSION)
            assert "started" in started.output
            for _ in range(300):  # it outlives the command that started it (once it has exec'd)
                if alive(f"sleep {seconds}"):
                    break
                await asyncio.sleep(0.1)
            assert alive(f"sleep {seconds}")
            await _kill_leftovers(sb)
            assert alive(f"sleep {seconds}") == []
            assert (await sb.bash("echo still-here", timeout_s=60)).output.strip() == "still-here"
    finally:
        await destroy_sandbox(handle)
