"""A pytest plugin the ``swe`` task's eval loads *inside the sandbox* (copied there as
``rs_swe_report.py``; it imports nothing from rollstream): it writes each test id's
outcome to the JSON file named by ``$ROLLSTREAM_SWE_REPORT``, so eval reads exact per-test
results instead of parsing pytest's console output."""

from __future__ import annotations

import json
import os

_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    # A test passes only if setup, call and teardown all pass; any failure wins.
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and previous is None:
        _outcomes[report.nodeid] = "passed"


def pytest_collectreport(report):
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = "error"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("ROLLSTREAM_SWE_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"outcomes": _outcomes, "exitstatus": int(exitstatus)}, f)
