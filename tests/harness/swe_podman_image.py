"""The images of tests/harness/test_swe_on_podman.py: the shipped SWE instance with an environment
recipe (its image holds the test runner eval needs: podman's base image has no pytest, while bwrap
jobs run on the host's root, which has), and every shipped preset's harness layer on that image,
built as an operator builds them (`rollstream images build ... --now --harness NAME ...`).
scripts/install-harnesses builds them before the suite (`cd tests && python -m harness.swe_podman_image`),
so that the test finds them cached; a layer is named by the install, so the tests' lean variants
share their preset's layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .sandbox_presets import swe_instance

ENVIRONMENT = {"pip_packages": ["pytest==8.3.3"], "install": "true"}
# The shipped presets, each layered once on the instance's environment image.
HARNESSES = ("codex", "claude-code", "opencode", "qwen-code", "mini-swe-agent", "openhands-sdk")
ROOT = Path(__file__).resolve().parents[2]


def instance() -> dict:
    return {**swe_instance(), "environment": ENVIRONMENT}


def on_podman(job: dict) -> dict:
    """``job``, a job on the shipped SWE instance (sandbox_presets.swe_job), in podman: its instance
    with the environment recipe (init starts the agent's sandbox from its preset's layer on that
    image, eval from the image itself), its sandbox on the engine (the job's limits kept). The
    operator lets jobs pick their sandbox's backend and limits (ROLLSTREAM_SANDBOX_JOB_OVERRIDES)."""
    return {**job, "instance": {**job["instance"], "environment": ENVIRONMENT},
            "sandbox": {**job.get("sandbox", {}), "backend": "docker"}}


def build(folder: Path, harnesses: tuple[str, ...] = HARNESSES) -> dict:
    """Build (once; cached) the instance's environment image and the layers of ``harnesses`` on it
    with the CLI; what it printed of that environment ({"tag": ..., "harnesses": {name: layer}, ...})."""
    source = folder / "instances.jsonl"
    source.write_text(json.dumps(instance()) + "\n")
    # openhands-sdk's install runs on a copy of pyenv's 3.12, which finds its libpython there.
    library = os.pathsep.join(filter(None, ["/opt/rollstream/python/3.12/lib", os.environ.get("LD_LIBRARY_PATH")]))
    completed = subprocess.run(
        [sys.executable, "-m", "rollstream", "images", "build", str(source), "--now", "--backend", "docker",
         *[arg for name in harnesses for arg in ("--harness", name)], "--json"],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "LD_LIBRARY_PATH": library}, cwd=ROOT)
    if completed.returncode != 0:
        raise RuntimeError(f"building the SWE environment with {', '.join(harnesses)} failed:\n"
                           f"{completed.stderr[-3000:]}")
    [entry] = json.loads(completed.stdout.strip().splitlines()[-1])
    return entry


if __name__ == "__main__":  # python -m harness.swe_podman_image [NAME...]: the layers of those of HARNESSES
    asked = tuple(name for name in HARNESSES if name in sys.argv[1:]) if sys.argv[1:] else HARNESSES
    with tempfile.TemporaryDirectory(prefix="rs-swe-podman-") as scratch:
        print(json.dumps(build(Path(scratch), asked)["harnesses"] if asked else {}))
