"""The images of tests/harness/test_swe_on_podman.py: the shipped SWE instance with an environment
recipe (its image holds the test runner eval needs: podman's base image has no pytest, while bwrap
jobs run on the host's root, which has), and Codex's harness layer on that image, built as an
operator builds them (`rollstream images build ... --now --harness`). scripts/install-harnesses
builds them before the suite (`cd tests && python -m harness.swe_podman_image`), so that the test
finds them cached; a layer is named by the install, so the test's lean variant of Codex shares it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .sandbox_presets import swe_instance

ENVIRONMENT = {"pip_packages": ["pytest==8.3.3"], "install": "true"}
HARNESS = "codex"
ROOT = Path(__file__).resolve().parents[2]


def instance() -> dict:
    return {**swe_instance(), "environment": ENVIRONMENT}


def build(folder: Path, harness: str = HARNESS, preset_dirs: list[Path] | None = None) -> dict:
    """Build (once; cached) the instance's environment image and ``harness``'s layer on it with the
    CLI; what it printed of that environment ({"tag": ..., "harnesses": {harness: layer}, ...})."""
    source = folder / "instances.jsonl"
    source.write_text(json.dumps(instance()) + "\n")
    env = {**os.environ, "ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(d) for d in preset_dirs or []])}
    completed = subprocess.run(
        [sys.executable, "-m", "rollstream", "images", "build", str(source), "--now", "--backend", "docker",
         "--harness", harness, "--json"], capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    if completed.returncode != 0:
        raise RuntimeError(f"building the SWE environment with {harness} failed:\n{completed.stderr[-3000:]}")
    [entry] = json.loads(completed.stdout.strip().splitlines()[-1])
    return entry


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="rs-swe-podman-") as scratch:
        print(json.dumps(build(Path(scratch))["harnesses"]))
