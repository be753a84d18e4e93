"""bench/harbor_env.py runs the harbor task's init and both kinds of verification on a test task
folder; this runs it small, so that a change to the task's hooks shows up here, not when someone
next measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import needs_bwrap

BENCH = Path(__file__).resolve().parents[2] / "bench" / "harbor_env.py"


@needs_bwrap
def test_the_benchmark_reports_cached_init_and_both_verifications_of_a_solved_task():
    out = subprocess.run([sys.executable, str(BENCH), "--rollouts", "2", "--verifications", "1"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    # The benchmark exits non-zero unless the reference solution scored 1 both ways.
    assert {"init_cached_p50_s", "verify_fresh_p50_s", "verify_in_place_p50_s"} <= set(result)
    assert result["init_cached_p50_s"] > 0 and result["rollouts"] == 2
