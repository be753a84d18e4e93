"""The bash tool behind `docker exec -t` (the container's own pty, which the supervisor cannot
reach): a program that set raw mode is interrupted by a signal sent from a second shell in the
container, and the shell keeps its state and gets its terminal modes back."""

from __future__ import annotations

import pytest

from rollstream.sandboxes import SandboxClient

from .test_bash_torture import EDITOR
from .test_docker import BASE_IMAGE, _image_present, docker_sandbox  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not _image_present(), reason=f"no Docker engine with {BASE_IMAGE} (scripts/install-podman)")


async def test_raw_mode_program_behind_docker_exec_is_interrupted_and_the_shell_keeps_its_state(docker_sandbox):  # noqa: F811
    async with SandboxClient(docker_sandbox.socket_path) as sb:
        assert (await sb.bash("cd /tmp && export KEEP=yes")).exit_code == 0
        editor = await sb.bash(EDITOR.format(ignore=""), timeout_s=1)
        assert editor.interrupted and editor.exit_code == 130, editor
        assert "restarted" not in editor.note, editor
        after = await sb.bash("pwd; echo $KEEP; stty -a | grep -o -- '-icanon\\|-isig\\| echo ' | wc -l")
        assert after.output == "/tmp\nyes\n0\n", after
