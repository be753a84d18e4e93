"""bench/pipeline_trace.py patches the workers' internals to stamp its events; this runs it
for a few jobs so that a renamed method shows up here, not when someone next needs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_trace_sees_every_process_and_every_step_of_a_hop():
    out = subprocess.run([sys.executable, str(BENCH / "pipeline_trace.py"), "--jobs", "20"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    seen = {(proc, event) for proc, event, _at in result["events"]}
    for stage in ("init", "run"):
        for event in ("recv", "decoded", "worked", "packed", "send EVALSHA"):
            assert (stage, event) in seen, (stage, event, sorted(seen))
    assert {("eval", "worked"), ("client", "submit"), ("client", "result")} <= seen
    times = [at for _p, _e, at in result["events"]]
    assert times == sorted(times) and result["p50_ms"] > 0
