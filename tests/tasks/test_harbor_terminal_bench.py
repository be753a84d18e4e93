"""Terminal-Bench-style Harbor tasks (tests/tasks/harbor_tasks_tb: pytest and pytest-json-ctrf
installed by the Dockerfile from PyPI, tests/test_outputs.py run by test.sh with a CTRF report,
state in files, script permissions, a git repository, a SQLite database) on real bubblewrap and
real podman: the reference solve.sh scores 1 and no change 0, and the per-test outcomes of the
CTRF report are kept with the reward."""

from __future__ import annotations

import pytest

from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks.harbor import HarborTask

from . import harbor_fixtures
from .conftest import needs_bwrap
from .harbor_fixtures import TB_DIR, TB_TASKS, run_solution

pytestmark = needs_bwrap
BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.skipif(
    not DockerBackend().available(), reason="no container engine (podman's socket: scripts/install-podman)"))]


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", TB_TASKS)
async def test_reference_solution_scores_one_and_no_change_zero(episode, harbor_environment, name, backend):
    solved = await episode(HarborTask(), {"path": str(TB_DIR / name)}, backend=backend)
    untouched = await episode(HarborTask(), {"path": str(TB_DIR / name)}, backend=backend)
    await run_solution(solved, TB_DIR / name)
    assert await solved.score() == 1.0, solved.env.trajectory.extra["eval"]
    assert await untouched.score() == 0.0, untouched.env.trajectory.extra["eval"]
    passed, failed = solved.env.trajectory.extra["eval"]["tests"], untouched.env.trajectory.extra["eval"]["tests"]
    assert passed and set(passed.values()) == {"passed"}, passed
    assert "failed" in failed.values(), failed
