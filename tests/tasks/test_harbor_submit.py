"""`rollstream submit` with Harbor task folders, as a user types it: a task folder, a folder of
them, or a dataset file naming them (a text file of paths, or a Harbor registry JSON with local
paths) becomes one harbor job per folder; a folder outside the operator's roots is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .harbor_fixtures import TASKS, TASKS_DIR


def _submit(cli_env, spec, roots=(TASKS_DIR,)):
    env = {**os.environ, **cli_env, "ROLLSTREAM_HARBOR_TASK_ROOTS": json.dumps([str(r) for r in roots])}
    return subprocess.run([sys.executable, "-m", "rollstream", "submit", str(spec)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def _submitted(result) -> int:
    assert result.returncode == 0, result.stderr
    ids = [line for line in result.stdout.splitlines() if line.strip()]
    assert f"submitted {len(ids)} jobs" in result.stderr
    return len(ids)


def test_a_task_folder_or_a_folder_of_them_submits_one_job_each(cli_env):
    assert _submitted(_submit(cli_env, TASKS_DIR / "hello-file")) == 1
    assert _submitted(_submit(cli_env, TASKS_DIR)) == len(TASKS)


def test_a_dataset_file_names_task_folders_relative_to_itself(cli_env, tmp_path):
    listing = tmp_path / "dataset.txt"
    relative = os.path.relpath(TASKS_DIR, tmp_path)
    listing.write_text(f"# two of the test tasks\n{relative}/hello-file\n{TASKS_DIR / 'fix-calc'}\n")
    assert _submitted(_submit(cli_env, listing)) == 2
    registry = tmp_path / "registry.json"  # Harbor's registry format, tasks as local folders
    registry.write_text(json.dumps([{"name": "rollstream-tests", "version": "1.0", "description": "test tasks",
                                     "tasks": [{"name": name, "path": f"{relative}/{name}"} for name in TASKS]}]))
    assert _submitted(_submit(cli_env, registry)) == len(TASKS)


def test_a_folder_outside_the_roots_is_refused_in_one_line(cli_env, tmp_path):
    result = _submit(cli_env, TASKS_DIR / "hello-file", roots=(tmp_path,))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "not beneath a folder the operator allows" in result.stderr
    assert "nothing was submitted" in result.stderr
