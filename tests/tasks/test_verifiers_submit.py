"""`rollstream submit verifiers:ENV_ID[:JSON-ARGS]`, as a user types it: one verifiers job per row
of the environment's dataset (built with the given load_environment arguments); an environment the
operator does not allow, or one that fails to load, is one line and nothing is submitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra: pip install rollstream[verifiers]")

from .verifiers_scripted import ENVS_DIR


def _submit(cli_env, spec: str, allowed=("vf-reverse-text", "vf-broken")):
    env = {**os.environ, **cli_env, "PYTHONPATH": str(ENVS_DIR),
           "ROLLSTREAM_VERIFIERS_ENVIRONMENTS": json.dumps(list(allowed))}
    return subprocess.run([sys.executable, "-m", "rollstream", "submit", spec], env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def _submitted(result) -> int:
    assert result.returncode == 0, result.stderr
    ids = [line for line in result.stdout.splitlines() if line.strip()]
    assert f"submitted {len(ids)} jobs" in result.stderr
    return len(ids)


def test_an_environment_name_submits_one_job_per_dataset_row(cli_env):
    assert _submitted(_submit(cli_env, "verifiers:vf-reverse-text")) == 3
    assert _submitted(_submit(cli_env, 'verifiers:vf-reverse-text:{"texts": ["ab", "cd"]}')) == 2


@pytest.mark.parametrize(("spec", "says"), [
    ("verifiers:vf-tool-test", "is not allowed here"),
    ("verifiers:vf-broken", "cannot find its dataset"),
    ("verifiers:vf-reverse-text:[1]", "must be a JSON object"),
])
def test_an_environment_that_cannot_be_used_is_refused_in_one_line(cli_env, spec, says):
    result = _submit(cli_env, spec)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr
