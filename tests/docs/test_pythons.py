"""Every supported Python that this machine has runs the pipeline, not only the one the suite
runs on: `rollstream up` with its embedded Redis and three pools, jobs submitted with the CLI
and completed, and a benchmark (bench/scaling.py) that reaches its RESULT line. The venvs come
from scripts/install-pythons (run by scripts/test, before any test's time limit); a GPU node
runs Python 3.12, Debian 12 has 3.11."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .blocks import ROOT

SUPPORTED = ("3.11", "3.12", "3.13")
OTHER_VENVS = sorted(p for p in ROOT.glob(".venv-py3.*") if (p / "bin" / "python").exists())


def test_the_supported_pythons_are_the_ones_stated_and_installed_here():
    readme = (ROOT / "README.md").read_text()
    assert "Python 3.11, 3.12 and 3.13" in readme
    installer = (ROOT / "scripts" / "install-pythons").read_text()
    assert f"for version in {' '.join(SUPPORTED)}" in installer
    assert "{}.{}".format(*sys.version_info[:2]) in SUPPORTED
    for venv in OTHER_VENVS:
        assert venv.name.removeprefix(".venv-py") in SUPPORTED


def _version(venv: Path) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.version.split()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("venv", OTHER_VENVS, ids=[v.name for v in OTHER_VENVS])
def test_rollstream_up_runs_jobs_and_a_benchmark_on_another_python(venv):
    bin_dir = venv / "bin"
    data = Path(tempfile.mkdtemp(prefix="rs-py-", dir="/tmp"))
    env = {**os.environ, "ROLLSTREAM_DATA_DIR": str(data), "HOME": str(data)}
    env.pop("REDIS_URL", None)
    up = subprocess.Popen([str(bin_dir / "rollstream"), "up", "--quiet", "--concurrency", "8"], cwd=data, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        jobs = data / "jobs.jsonl"
        jobs.write_text("".join(json.dumps({"task": "echo", "instance": {"prompt": f"p{i}"}}) + "\n"
                                for i in range(12)))
        deadline = time.monotonic() + 60
        while not (data / "redis" / "redis.sock").exists():
            assert up.poll() is None and time.monotonic() < deadline, up.stdout.read() if up.stdout else ""
            time.sleep(0.2)
        done = subprocess.run([str(bin_dir / "rollstream"), "submit", str(jobs), "--wait", "--timeout-s", "120"],
                              cwd=data, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        results = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        assert len(results) == 12 and {r["status"] for r in results} == {"completed"}
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        out = up.communicate(timeout=60)[0]
    assert up.returncode == 0, out[-3000:]

    # A smoke run (the benchmark's whole path, its RESULT line): 16 jobs in flight make its 100
    # jobs take ~2 s instead of ~5, and fewer stream messages its Redis figures ~1 s instead of ~3.
    bench = subprocess.run([str(bin_dir / "python"), str(ROOT / "bench" / "scaling.py"), "--workers", "1",
                            "--seconds", "1", "--concurrency", "16", "--stream-messages", "20000"],
                           cwd=data, env=env, capture_output=True, text=True, timeout=240)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(bench.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["jobs_per_s"]["1"] > 0
    assert _version(venv).startswith(venv.name.removeprefix(".venv-py"))
