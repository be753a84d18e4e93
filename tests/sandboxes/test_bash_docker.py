"""The bash tool behind `docker exec -t`, whose pty is the container's own. On the container's
host the supervisor reaches that pty through /proc and holds it as one of its own (modes put
back, the foreground job signalled, no process per command); where it cannot (another host's
engine, no rights), the shell runs stty before each prompt and a timeout's signal comes from
a second shell in the container. Either way a program that set raw mode is interrupted and
the shell keeps its state and gets its terminal modes back."""

from __future__ import annotations

import json
import os

import pytest

from rollstream.sandboxes import SandboxClient
from rollstream.sandboxes.runtime.bash_session import BashSession

from .test_bash_torture import EDITOR
from .test_docker import BASE_IMAGE, _image_present, docker_sandbox  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not _image_present(),
                                reason=f"no Docker engine with {BASE_IMAGE} (scripts/install-podman)")


async def test_raw_mode_program_behind_docker_exec_is_interrupted_and_the_shell_keeps_its_state(docker_sandbox):  # noqa: F811
    async with SandboxClient(docker_sandbox.socket_path) as sb:
        assert (await sb.bash("cd /tmp && export KEEP=yes")).exit_code == 0
        editor = await sb.bash(EDITOR.format(ignore=""), timeout_s=1)
        assert editor.interrupted and editor.exit_code == 130, editor
        assert "restarted" not in editor.note, editor
        after = await sb.bash("pwd; echo $KEEP; stty -a | grep -o -- '-icanon\\|-isig\\| echo ' | wc -l")
        assert after.output == "/tmp\nyes\n0\n", after
        assert (await sb.info())["terminals"]["main"].endswith("reached from the host")


async def test_where_the_containers_pty_cannot_be_reached_the_shell_restores_it_and_is_signalled_from_beside(
        docker_sandbox):  # noqa: F811
    with open(os.path.join(docker_sandbox.dir, "plan.json")) as handle:
        plan = json.load(handle)
    session = BashSession(plan["bash_argv"], plan["spawn_env"], plan["spawn_cwd"], {}, 65536,
                          interrupt_grace_s=1.0)  # no namespace from the engine: the old way
    session.start()
    try:
        assert "stty before each prompt" in session.terminal_kind
        assert session.run(b"cd /tmp && export KEEP=yes; stty echo onlcr", 10, None)["exit_code"] == 0
        assert session.run(b"echo $((6*7))", 10, None)["output"] == b"42\n"
        editor = session.run(EDITOR.format(ignore="").encode(), 1, None)
        assert editor["interrupted"] and editor["exit_code"] == 130 and "restarted" not in editor["note"], editor
        after = session.run(b"pwd; echo $KEEP; stty -a | grep -o -- '-icanon\\|-isig\\| echo ' | wc -l", 10, None)
        assert after["output"] == b"/tmp\nyes\n0\n", after
    finally:
        session.close()
