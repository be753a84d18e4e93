"""scripts/install-podman's last step, the SWE environment images: a failed build stops the install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.sandboxes.backends.docker import DockerBackend

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0 or not DockerBackend().available(),
                    reason="install-podman installs only as root, and its last step needs podman's socket")
def test_install_podman_stops_with_an_error_when_an_environment_image_fails_to_build(tmp_path):
    # A checkout whose shipped instances hold a recipe that cannot build (its commit is no commit id),
    # run with this venv's real interpreter; steps 1-4 find podman, its socket and the base image in place.
    (tmp_path / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "install-podman", tmp_path / "scripts" / "install-podman")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (venv_bin / "python").chmod(0o755)
    data = tmp_path / "rollstream" / "data" / "swe"
    data.mkdir(parents=True)
    record = {"instance_id": "broken-1", "repo": "pypi/parse", "base_commit": "a" * 40, "python": "3.11",
              "environment_setup_commit": "not-a-commit", "problem_statement": "p",
              "FAIL_TO_PASS": [], "PASS_TO_PASS": []}
    (data / "pypi_instances.jsonl").write_text(json.dumps(record) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "ROLLSTREAM_SKIP_SWE_IMAGES"}
    result = subprocess.run([str(tmp_path / "scripts" / "install-podman")], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": str(REPO)}, timeout=600)
    assert result.returncode == 1, result.stderr
    assert "building the SWE environment images failed" in result.stderr
    assert "not a commit id" in result.stderr  # the build's own reason reaches the user
    assert "export DOCKER_HOST" not in result.stdout  # scripts/test must not go on as if it had worked
