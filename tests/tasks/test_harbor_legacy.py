"""A task in Terminal-Bench's original format (task.yaml, Dockerfile, run-tests.sh with the
benchmark's usual test bootstrap: curl's uv installer, `uv add pytest`, `uv run pytest`, and
solution.sh) converted to a Harbor folder and run by the harbor task on real bubblewrap: its
run-tests.sh runs unchanged in the offline verification sandbox (what it downloads was
installed at build, the Dockerfile's ENV in its environment), the reference solution scores 1
and no change 0."""

from __future__ import annotations

import json
import subprocess
import sys
from xml.etree import ElementTree

import pytest

from rollstream.tasks.harbor import HarborTask
from rollstream.tasks.harbor_folder import TaskFolder
from rollstream.tasks.harbor_legacy import LegacyTaskError, convert_terminal_bench, is_legacy_task
from rollstream.tasks.harbor_verify import pytest_summary_outcomes

from .conftest import needs_bwrap
from .harbor_fixtures import SOLVE

TASK_YAML = """\
instruction: |-
  Write the sum of the numbers in /app/numbers.txt to /app/sum.txt.
author_name: rollstream tests
difficulty: easy
parser_name: pytest
max_agent_timeout_sec: 120.0
max_test_timeout_sec: 90.0
"""
RUN_TESTS = """\
#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
source $HOME/.local/bin/env
uv init
uv add pytest==8.4.1
uv run pytest $TEST_DIR/test_outputs.py -rA
"""
TEST_OUTPUTS = """\
import os
from pathlib import Path


def test_sum_is_written():
    # SUM_FILE: the Dockerfile's ENV, which reaches the bwrap sandbox too
    assert Path(os.environ["SUM_FILE"]).read_text().strip() == "42"
"""


@pytest.fixture
def legacy_task(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_HARBOR_TASK_ROOTS", json.dumps([str(tmp_path / "harbor")]))
    folder = tmp_path / "tb" / "sum-file"
    (folder / "tests").mkdir(parents=True)
    (folder / "task.yaml").write_text(TASK_YAML)
    (folder / "Dockerfile").write_text("FROM python:3.13-slim-bookworm\nWORKDIR /app\nCOPY numbers.txt /app/\n"
                                         "ENV SUM_FILE=/app/sum.txt\n")
    (folder / "numbers.txt").write_text("10\n30\n2\n")
    (folder / "docker-compose.yaml").write_text("services:\n  client:\n    build: {dockerfile: Dockerfile}\n")
    (folder / "run-tests.sh").write_text(RUN_TESTS)
    (folder / "tests" / "test_outputs.py").write_text(TEST_OUTPUTS)
    (folder / "solution.sh").write_text(
        "#!/bin/bash\npython3 -c \"print(sum(map(int, open('/app/numbers.txt'))))\" > /app/sum.txt\n")
    return folder


def test_the_conversion_keeps_every_file_and_runs_run_tests_unchanged(legacy_task, tmp_path):
    assert is_legacy_task(legacy_task)
    target = convert_terminal_bench(legacy_task, tmp_path / "harbor" / "sum-file")
    folder = TaskFolder.load(str(target))
    assert folder.instruction.startswith("Write the sum")
    assert folder.config.agent.timeout_sec == 120.0 and folder.config.verifier.timeout_sec == 90.0
    assert folder.config.verifier.env == {"TEST_DIR": "/tests/"}
    assert (target / "tests" / "run-tests.sh").read_text() == RUN_TESTS
    assert "bash /tests/run-tests.sh" in (target / "tests" / "test.sh").read_text()
    assert (target / "solution" / "solve.sh").read_text() == (legacy_task / "solution.sh").read_text()
    # the environment is the build context the task had: its whole folder
    assert sorted(p.name for p in (target / "environment").iterdir()) == [
        "Dockerfile", "numbers.txt", "run-tests.sh", "solution.sh", "tests"]
    dockerfile = (target / "environment" / "Dockerfile").read_text()
    assert dockerfile.startswith((legacy_task / "Dockerfile").read_text())
    assert "uv==0.7.13" in dockerfile and "uv add pytest==8.4.1" in dockerfile
    (legacy_task / "task.yaml").write_text(json.dumps({"difficulty": "easy"}))
    with pytest.raises(LegacyTaskError, match="no instruction"):
        convert_terminal_bench(legacy_task, tmp_path / "again")


@needs_bwrap
async def test_a_converted_terminal_bench_task_scores_its_solution_one_and_no_change_zero(
        legacy_task, tmp_path, episode):
    target = convert_terminal_bench(legacy_task, tmp_path / "harbor" / "sum-file")
    solved = await episode(HarborTask(), {"path": str(target)}, backend="bwrap")  # builds the image once
    untouched = await episode(HarborTask(), {"path": str(target)}, backend="bwrap")
    async with solved.client() as sandbox:
        await sandbox.write_file("/tmp/.rs-solution.tar", TaskFolder.load(str(target)).files("solution").tar())
        assert (await sandbox.bash(SOLVE)).exit_code == 0
    assert await solved.score() == 1.0, solved.env.trajectory.extra["eval"]
    assert await untouched.score() == 0.0, untouched.env.trajectory.extra["eval"]
    assert "1 passed" in solved.env.trajectory.extra["eval"]["output"]
    assert "FAILED" in untouched.env.trajectory.extra["eval"]["output"]
    # Per-test outcomes from pytest's -rA summary in run-tests.sh's output (no CTRF report here).
    for ep, outcome in ((solved, "passed"), (untouched, "failed")):
        tests = ep.env.trajectory.extra["eval"]["tests"]
        assert list(tests.values()) == [outcome] and next(iter(tests)).endswith("::test_sum_is_written"), tests


def test_pytest_summary_outcomes_agree_with_pytests_own_junit_report(tmp_path):
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2, 'a - b'\n\n"
        # A task's test that skips itself where its image lacks a module (one line: its place is line 9).
        "def test_skipped(): pytest.importorskip('rollstream_no_such_module')\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n\n"
        "def test_error(broken):\n    pass\n\n"
        "@pytest.mark.xfail\ndef test_expected_failure():\n    assert False\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_param(n):\n    assert n == 1\n")
    ran = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "--junitxml",
                          str(tmp_path / "junit.xml"), "test_mixed.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    ours = pytest_summary_outcomes("noise before\n" + ran.stdout)
    theirs = {}
    for case in ElementTree.parse(tmp_path / "junit.xml").iter("testcase"):
        kinds = {child.tag: child.get("type", "") for child in case}
        theirs[case.get("name")] = ("failed" if "failure" in kinds or "error" in kinds else
                                    "other" if kinds.get("skipped") == "pytest.xfail" else
                                    "skipped" if "skipped" in kinds else "passed")
    # pytest's summary names a skipped test by its place (the line that skipped), junit by its name.
    assert ours.pop("test_mixed.py:9") == theirs.pop("test_skipped") == "skipped", (ours, ran.stdout)
    assert {name.split("::")[-1]: outcome for name, outcome in ours.items()} == theirs, ran.stdout
    assert len(theirs) == 6
