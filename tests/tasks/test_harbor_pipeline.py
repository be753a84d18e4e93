"""Harbor task folders through the real pipeline (Redis streams, init/run/eval workers, bwrap
sandboxes or podman containers): the agent is scripted as Harbor's oracle agent is, running the
folder's solution/solve.sh through the sandbox's bash, or doing nothing; the results carry the
rewards test.sh gave in a fresh sandbox, and broken folders end as failed results naming why."""

from __future__ import annotations

import pytest

from rollstream.client import AsyncClient
from rollstream.messages import Envelope
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor import HarborTask
from rollstream.tasks.registry import register_task
from rollstream.trajectory import Trajectory

from . import harbor_fixtures
from .conftest import needs_bwrap, workers
from .harbor_fixtures import SOLVE, TASKS, copy_task

pytestmark = needs_bwrap
BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.skipif(
    not DockerBackend().available(), reason="no container engine (podman's socket: scripts/install-podman)"))]


@register_task
class OracleHarborTask(HarborTask):
    """The harbor task with the agent replaced by Harbor's oracle: solve.sh when the job's
    metadata says so, else nothing."""

    name = "harbor-oracle"

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        if not env.job.metadata.get("solve"):
            return Trajectory(num_turns=1)
        assert ctx.sandbox is not None
        await ctx.sandbox.write_file("/tmp/.rs-solution.tar", self.folder(env.job.instance).files("solution").tar())
        result = await ctx.sandbox.bash(SOLVE)
        return Trajectory(extra={"solve_exit_code": result.exit_code}, num_turns=1)


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)


def job(path, solve: bool, name: str) -> dict:
    return {"task": "harbor-oracle", "instance": {"path": str(path)}, "metadata": {"solve": solve, "name": name}}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_solutions_score_one_and_no_change_zero_through_the_pipeline(pipeline_settings, harbor_environment,
                                                                            backend):
    settings = pipeline_settings.model_copy(update={"sandbox_backend": backend})
    jobs = [job(harbor_environment / name, solve, f"{name}:{solve}") for name in TASKS for solve in (True, False)]
    async with workers(settings), AsyncClient(settings=settings) as client:
        await client.submit_many(jobs)
        results = {r.metadata["name"]: r for r in await client.collect(len(jobs), timeout_s=300)}
    for name in TASKS:
        solved, untouched = results[f"{name}:True"], results[f"{name}:False"]
        assert solved.status == "completed" and solved.reward == 1.0, solved
        assert untouched.status == "completed" and untouched.reward == 0.0, untouched
        assert "reward 1 from" in solved.trajectory.extra["eval"]["reason"]


async def test_broken_task_folders_end_as_failed_results_naming_why(pipeline_settings, harbor_environment, tmp_path):
    broken_build = copy_task(harbor_environment / "hello-file", tmp_path / "broken-build")
    (broken_build / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN false\n")
    silent = copy_task(harbor_environment / "hello-file", tmp_path / "silent")
    (silent / "tests" / "test.sh").write_text("#!/bin/bash\necho checked\n")
    jobs = [job(broken_build, True, "broken-build"), job(silent, True, "silent"),
            job(harbor_environment / "hello-file", True, "fine")]
    async with workers(pipeline_settings), AsyncClient(settings=pipeline_settings) as client:
        await client.submit_many(jobs)
        results = {r.metadata["name"]: r for r in await client.collect(len(jobs), timeout_s=300)}
    build = results["broken-build"]
    assert build.status == "failed" and build.failure == "task" and build.error_stage == "init", build
    assert "RUN false" in build.error and "did not build" in build.error
    silent_result = results["silent"]
    assert silent_result.status == "failed" and silent_result.failure == "task", silent_result
    assert silent_result.attempts == 1  # a broken verifier is not run again
    assert "wrote no /logs/verifier/reward.txt" in silent_result.error
    assert results["fine"].status == "completed" and results["fine"].reward == 1.0
