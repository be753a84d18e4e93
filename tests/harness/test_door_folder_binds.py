"""Every backend binds the sandbox's own door folder, read-only, at /run/rollstream-door: where a
harness inside finds its job's door (agent/door_relay.py). bwrap and podman run it for real in
test_sandbox_harness.py; Singularity, not installed here, by its command line."""

from __future__ import annotations

import os
import stat

from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.backends.common import DOOR_DIR_INNER
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.backends.singularity import SingularityBackend


def _layout(tmp_path) -> SandboxLayout:
    layout = SandboxLayout.of(str(tmp_path), "sb1")
    layout.make()
    return layout


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def test_bwrap_binds_the_door_folder_read_only(tmp_path):
    layout = _layout(tmp_path)
    argv = BwrapBackend().bwrap_args(SandboxSpec(backend="bwrap"), layout, {})
    i = argv.index(layout.door)
    assert argv[i - 1] == "--ro-bind" and argv[i + 1] == DOOR_DIR_INNER


def test_docker_mounts_the_door_folder_read_only(tmp_path):
    layout = _layout(tmp_path)
    argv = DockerBackend().run_argv(SandboxSpec(backend="docker", image="img"), layout, "sb1", "o", {})
    assert f"{layout.door}:{DOOR_DIR_INNER}:ro" in _pairs(argv, "--volume")


def test_singularity_binds_the_door_folder_read_only(tmp_path):
    layout = _layout(tmp_path)
    argv = SingularityBackend(binary="apptainer").start_argv(SandboxSpec(backend="singularity", image="x.sif"),
                                                             layout, "sb1")
    assert f"{layout.door}:{DOOR_DIR_INNER}:ro" in _pairs(argv, "--bind")


def test_the_door_folder_is_the_workers_alone_to_write(tmp_path):
    layout = _layout(tmp_path)
    info = os.stat(layout.door)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o755
