"""What the harbor task tests share: the task folders of tests/tasks/harbor_tasks (Harbor's own
format, one environment shared by all three so that a session builds one image), the operator's
roots set to them and to pytest's temporary folders, and the reference solution run through a
sandbox's bash as a scripted agent would."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rollstream.config import load_settings
from rollstream.tasks.harbor_folder import TaskFolder
from rollstream.tasks.harbor_image import ensure_image

TASKS_DIR = Path(__file__).resolve().parent / "harbor_tasks"
TASKS = ["hello-file", "fix-calc", "sum-numbers"]
# Terminal-Bench-style tasks: pytest baked into the image, tests/test_outputs.py, a CTRF report.
TB_DIR = TASKS_DIR.parent / "harbor_tasks_tb"
TB_TASKS = ["log-status-summary", "csv-join-report", "fix-script-permissions", "git-recover-commit", "sqlite-answer"]
SOLVE = ("mkdir -p /solution && cd /solution && tar -xf /tmp/.rs-solution.tar && cd - >/dev/null "
         "&& bash /solution/solve.sh")


def harbor_environment(tmp_path_factory) -> Iterator[Path]:
    """The folder of the test tasks, their environment image built (rootfs too) once a session;
    harbor jobs may name folders there and under pytest's temporary folders."""
    roots = [str(TASKS_DIR), str(TB_DIR), str(tmp_path_factory.getbasetemp())]
    before = os.environ.get("ROLLSTREAM_HARBOR_TASK_ROOTS")
    os.environ["ROLLSTREAM_HARBOR_TASK_ROOTS"] = json.dumps(roots)
    ensure_image(TaskFolder.load(str(TASKS_DIR / TASKS[0])), load_settings().harbor_base_images, rootfs=True)
    yield TASKS_DIR
    if before is None:
        os.environ.pop("ROLLSTREAM_HARBOR_TASK_ROOTS", None)
    else:
        os.environ["ROLLSTREAM_HARBOR_TASK_ROOTS"] = before


def copy_task(source: Path, target: Path) -> Path:
    """A copy of a task folder to change (its environment unchanged: the same image)."""
    return Path(shutil.copytree(source, target))


def solution_tar(folder: Path) -> bytes:
    return TaskFolder.load(str(folder)).files("solution").tar()


async def run_solution(ep, folder: Path) -> None:
    """Stand in for the agent: solution/ copied to /solution and solve.sh run with the sandbox's bash."""
    async with ep.client() as sb:
        await sb.write_file("/tmp/.rs-solution.tar", solution_tar(folder))
        result = await sb.bash(SOLVE)
    assert result.exit_code == 0, result.output
