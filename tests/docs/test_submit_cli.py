"""`rollstream submit` and `rollstream cancel` as a user meets them: shipped task sets by name,
one clear line for a bad file or task, failures and a passed deadline in the exit status, and
a cancel that every job answers with a 'cancelled' result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pipeline_env import settings_env


@pytest.fixture
def serving(shared_pool):
    """Settings of the module's worker pool, which the tests that run jobs share (its workers
    start once, not once a test)."""
    return shared_pool("cli", concurrency=8)


def _cli(cli_env, *args, timeout_s=120, **kw):
    env = {**os.environ, **cli_env}
    return subprocess.run([sys.executable, "-m", "rollstream", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, **kw)


def _one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_a_bad_path_or_an_unknown_task_is_one_line_without_a_traceback(cli_env, tmp_path):
    error = _one_line_error(_cli(cli_env, "submit", str(tmp_path / "no.jsonl")))
    assert "shipped: arith, code, echo, math, swe" in error
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "echo", "instance": {"prompt": "ok"}}\n{"task": "nope", "instance": {}}\n')
    line = _one_line_error(_cli(cli_env, "submit", str(bad)))
    assert f"{bad}:2: unknown task 'nope'" in line
    bad.write_text("{not json\n")
    assert f"{bad}:1: not JSON" in _one_line_error(_cli(cli_env, "submit", str(bad)))


def test_submit_runs_a_shipped_task_set_by_name_and_exits_1_when_a_job_failed(serving, tmp_path):
    cli_env = settings_env(serving)
    done = _cli(cli_env, "submit", "echo", "--wait", "--timeout-s", "90")
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 4 and {r["status"] for r in results} == {"completed"}
    assert all(r["trajectory"]["extra"]["eval"]["reason"] for r in results)
    assert "done 4  failed 0" in done.stderr
    failing = tmp_path / "fail.jsonl"
    failing.write_text('{"task": "echo", "instance": {"prompt": "x", "fail_in": "run"}}\n'
                       '{"task": "echo", "instance": {"prompt": "y"}}\n')
    failed = _cli(cli_env, "submit", str(failing), "--wait", "--timeout-s", "90")
    assert failed.returncode == 1, failed.stderr
    assert "done 1  failed 1" in failed.stderr and "1 of 2 jobs did not complete" in failed.stderr


def test_timeout_s_is_a_deadline_and_cancel_ends_the_rest_by_submitter_or_all(serving, tmp_path):
    settings, cli_env = serving, settings_env(serving)
    slow = tmp_path / "slow.jsonl"
    slow.write_text('{"task": "echo", "instance": {"prompt": "quick"}}\n'
                    '{"task": "echo", "instance": {"prompt": "slow", "run_s": 60}}\n')
    late = _cli(cli_env, "submit", str(slow), "--wait", "--timeout-s", "4", "--submitter", "me")
    assert late.returncode == 3, late.stderr  # not 0 after the slow job's 60 s: the deadline held
    assert "with 1 of 2 results" in late.stderr and "rollstream cancel --submitter me" in late.stderr
    cancelled = _cli(cli_env, "cancel", "--submitter", "me")
    assert cancelled.returncode == 0 and "cancelled: submitter me" in cancelled.stderr
    from rollstream.client import Client

    with Client(settings=settings, submitter="me") as client:
        (result,) = client.collect(1, timeout_s=60)
    assert result.status == "cancelled"
    assert _one_line_error(_cli(cli_env, "cancel")).startswith("error: say what to cancel")

    # --all reaches every submitter of the namespace.
    with Client(settings=settings, submitter="a") as a, Client(settings=settings, submitter="b") as b:
        for client in (a, b):
            client.submit({"task": "echo", "instance": {"prompt": "slow", "run_s": 60}})
        everything = _cli(cli_env, "cancel", "--all")
        assert everything.returncode == 0 and "submitter a" in everything.stderr and "submitter b" in everything.stderr
        assert [r.status for r in a.collect(1, timeout_s=60) + b.collect(1, timeout_s=60)] == ["cancelled"] * 2
