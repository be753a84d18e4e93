"""Harbor task folders (tests/tasks/harbor_tasks, in Harbor's own format) as the harbor task
runs them, on real bubblewrap and real podman: the environment image built once from
environment/Dockerfile (FROM python:3.12-slim mapped to the local base image), the reference
solution/solve.sh run through the sandbox's bash as the agent's work scores 1, no change scores 0,
and a broken Dockerfile or test.sh ends with its reason."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from rollstream.errors import InvalidJob, JobFailed
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks.harbor import HarborTask
from rollstream.tasks.harbor_image import map_dockerfile

from . import harbor_fixtures
from .conftest import needs_bwrap
from .harbor_fixtures import TASKS, copy_task, run_solution

pytestmark = needs_bwrap


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)

BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.skipif(
    not DockerBackend().available(), reason="no container engine (podman's socket: scripts/install-podman)"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", TASKS)
async def test_reference_solution_scores_one(episode, harbor_environment, name, backend):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / name)}, backend=backend)
    await run_solution(ep, harbor_environment / name)
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", TASKS)
async def test_no_change_scores_zero(episode, harbor_environment, name, backend):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / name)}, backend=backend)
    assert await ep.score() == 0.0, ep.env.trajectory.extra["eval"]
    assert "exited 0; reward 0" in ep.reason


async def test_the_workdir_holds_what_the_dockerfile_put_there(episode, harbor_environment):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / "fix-calc")})
    async with ep.client() as sb:
        result = await sb.bash("pwd && python3 -c 'import calc; print(calc.add(2, 2))' && cat data.txt | wc -l")
    assert result.output.split() == ["/app", "5", "5"], result.output


async def test_per_test_results_of_reward_json_are_kept(episode, harbor_environment):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / "fix-calc")})
    assert await ep.score() == 0.0
    metrics = ep.env.trajectory.extra["eval"]["metrics"]
    assert metrics == {"reward": 0.0, "test_add": 0, "test_mul_unchanged": 1}


async def test_a_deleted_file_stays_deleted_in_verification(episode, harbor_environment, tmp_path):
    task = copy_task(harbor_environment / "hello-file", tmp_path / "deleted")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nmkdir -p /logs/verifier\n"
                                            "if [ -e /app/data.txt ]; then echo 0; else echo 1; fi "
                                            "> /logs/verifier/reward.txt\n")
    ep = await episode(HarborTask(), {"path": str(task)})
    async with ep.client() as sb:
        assert (await sb.bash("rm /app/data.txt")).exit_code == 0
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]


async def test_an_agent_that_writes_the_reward_or_the_tests_itself_scores_zero(episode, harbor_environment):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / "hello-file")})
    async with ep.client() as sb:
        forged = await sb.bash("mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
                               "printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && "
                               "(while true; do echo 1 > /logs/verifier/reward.txt; sleep 0.05; done) "
                               "> /dev/null 2>&1 &")
        assert forged.exit_code == 0, forged.output
    assert await ep.score() == 0.0, ep.env.trajectory.extra["eval"]


# -- bad input ---------------------------------------------------------------------------
async def test_a_dockerfile_that_fails_to_build_fails_the_job_naming_the_step(episode, harbor_environment, tmp_path):
    task = copy_task(harbor_environment / "hello-file", tmp_path / "broken-build")
    (task / "environment" / "Dockerfile").write_text(
        "FROM python:3.12-slim\nRUN echo preparing the environment && exit 7\n")
    with pytest.raises(JobFailed) as failed:
        await episode(HarborTask(), {"path": str(task)})
    assert failed.value.failure == "task" and not failed.value.retryable
    assert "RUN echo preparing the environment && exit 7" in str(failed.value), str(failed.value)
    assert "did not build" in str(failed.value)


async def test_a_hanging_test_sh_scores_zero_at_the_verifier_timeout(episode, harbor_environment, tmp_path):
    task = copy_task(harbor_environment / "hello-file", tmp_path / "hangs")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\nsleep 600\necho 1 > /logs/verifier/reward.txt\n")
    toml = (task / "task.toml").read_text().replace("timeout_sec = 60.0", "timeout_sec = 2.0")
    (task / "task.toml").write_text(toml)
    ep = await episode(HarborTask(), {"path": str(task)})
    await run_solution(ep, task)
    assert await ep.score() == 0.0
    assert "timed out after 2 s" in ep.reason


@pytest.mark.parametrize("script, message", [
    ("echo done\n", "wrote no /logs/verifier/reward.txt or reward.json"),
    ("mkdir -p /logs/verifier; echo passed > /logs/verifier/reward.txt\n", "not a number"),
    ("mkdir -p /logs/verifier; echo '[1, 2]' > /logs/verifier/reward.json\n", "not an object with a numeric"),
    ("mkdir -p /logs/verifier; echo nan > /logs/verifier/reward.txt\n", "not a finite number"),
], ids=["no-reward", "garbage-txt", "garbage-json", "nan"])
async def test_a_test_sh_without_a_usable_reward_fails_the_job_as_the_tasks_fault(
        episode, harbor_environment, tmp_path, script, message):
    task = copy_task(harbor_environment / "hello-file", tmp_path / "no-reward")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + script)
    ep = await episode(HarborTask(), {"path": str(task)})
    with pytest.raises(JobFailed) as failed:
        await ep.score()
    assert failed.value.failure == "task" and not failed.value.retryable
    assert message in str(failed.value)


def test_a_compose_environment_without_a_dockerfile_for_main_is_refused_naming_it(harbor_environment, tmp_path):
    task = copy_task(harbor_environment / "hello-file", tmp_path / "compose")
    (task / "environment" / "Dockerfile").unlink()
    (task / "environment" / "docker-compose.yaml").write_text("services:\n  main:\n    build: .\n")
    with pytest.raises(InvalidJob, match="docker-compose.yaml but no Dockerfile.*service main"):
        HarborTask().validate({"path": str(task)})


def test_a_folder_outside_the_operators_roots_is_refused(harbor_environment, tmp_path):
    elsewhere = tempfile.mkdtemp(prefix="rs-harbor-outside-")
    try:
        outside = shutil.copytree(harbor_environment / "hello-file", Path(elsewhere) / "t")
        with pytest.raises(InvalidJob, match="not beneath a folder the operator allows"):
            HarborTask().validate({"path": str(outside)})
        # A link inside the roots to a folder outside them is resolved: the folder is still outside.
        (tmp_path / "link-out").symlink_to(outside)
        with pytest.raises(InvalidJob, match="not beneath a folder the operator allows"):
            HarborTask().validate({"path": str(tmp_path / "link-out")})
    finally:
        shutil.rmtree(elsewhere)
    with pytest.raises(InvalidJob, match="relative"):
        HarborTask().validate({"path": "hello-file"})


def test_a_symlink_in_the_task_folder_is_refused(harbor_environment, tmp_path):
    task = copy_task(harbor_environment / "hello-file", tmp_path / "linked")
    (task / "instruction.md").unlink()
    (task / "instruction.md").symlink_to("/etc/shadow")
    with pytest.raises(InvalidJob, match="symlinks are not followed"):
        HarborTask().validate({"path": str(task)})


async def test_a_symlink_the_agent_planted_in_its_workdir_is_refused(episode, harbor_environment):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / "hello-file")})
    async with ep.client() as sb:
        planted = await sb.bash("echo 'Hello, world!' > /tmp/real.txt && ln -s /tmp/real.txt /app/hello.txt")
        assert planted.exit_code == 0, planted.output
    assert await ep.score() == 0.0
    assert "symlinks refused" in ep.reason and "hello.txt" in ep.reason


def test_from_lines_map_to_local_images_and_stages_stay_as_written():
    mapping = {"python:*": "localhost/base:1", "ubuntu:*": "localhost/base:2"}
    text = ("FROM --platform=linux/amd64 docker.io/library/python:3.13-slim AS build\nRUN true\n"
            "FROM build\nFROM ubuntu:24.04\nFROM $BASE\nFROM ghcr.io/example/tool:1\n")
    mapped, pairs = map_dockerfile(text, mapping)
    assert mapped.splitlines() == ["FROM --platform=linux/amd64 localhost/base:1 AS build", "RUN true", "FROM build",
                                   "FROM localhost/base:2", "FROM $BASE", "FROM ghcr.io/example/tool:1"]
    assert pairs == [("docker.io/library/python:3.13-slim", "localhost/base:1"), ("ubuntu:24.04", "localhost/base:2")]
