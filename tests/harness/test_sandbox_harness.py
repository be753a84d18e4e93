"""A harness that is a command inside the job's sandbox (a preset), through the whole pipeline with
real workers, in bubblewrap and in podman sandboxes, on the built-in server: it reaches its job's door from a
sandbox without network, its answer is scored, and whatever it does wrong (hangs, floods its
output, leaves processes behind, exits at once, is not installed) ends as the agent's failure,
scored, with nothing left running. The presets are TOML files in a folder the workers are told of."""

from __future__ import annotations

import json

import pytest

from rollstream.client import AsyncClient
from rollstream.llm.balancer import add_backend
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
from rollstream.tasks import arith

from .leftovers import alive
from .sandbox_presets import write_presets

needs_podman = pytest.mark.skipif(not DockerBackend().available(), reason="no Docker API (podman) engine answers here")


# Real workers and sandboxes on a busy 2-core machine: generous.
pytestmark = pytest.mark.timeout(1800)

@pytest.fixture
def preset_dir(tmp_path):
    return write_presets(tmp_path / "presets")


@pytest.fixture(params=["bwrap", pytest.param("podman", marks=needs_podman)])
def backend(request):
    return request.param


@pytest.fixture
def pool(worker_pool, arith_model_dir, sandbox_root, preset_dir, backend):
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    pool.env["ROLLSTREAM_HARNESS_PRESET_DIRS"] = json.dumps([str(preset_dir)])
    if backend == "podman":  # arith's sandbox then starts from the base image (python3 in it)
        pool.env["ROLLSTREAM_SANDBOX_BACKEND"] = "docker"
        pool.env["ROLLSTREAM_SANDBOX_JOB_OVERRIDES"] = '["image", "limits"]'
    pool.start_all(concurrency=4)
    return pool


@pytest.fixture
def job_sandbox(backend):
    """The job's sandbox override: the base image under podman (arith names none)."""
    return {"image": DEFAULT_BASE_IMAGE} if backend == "podman" else None


async def _run(settings, arith_server, harness: str, instance: dict | None = None, *, sandbox: dict | None, **agent):
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        extra = {"sandbox": sandbox} if sandbox else {}
        await client.submit(arith.job(instance or {"a": 2, "op": "+", "b": 3},
                                      agent={**arith.SMALL_MODEL_AGENT, "harness": harness, **agent}, **extra))
        [result] = await client.collect(1, timeout_s=300)
    return result


async def test_a_preset_in_a_networkless_sandbox_calls_its_door_and_its_answer_is_scored(
        settings, pool, arith_server, job_sandbox):
    result = await _run(settings, arith_server, "door-client", {"a": 12, "op": "+", "b": 30}, sandbox=job_sandbox)
    assert result.status == "completed", result.error
    traj = result.trajectory
    assert traj.finish_reason == "stop" and traj.extra["harness_run"]["exit_code"] == 0, traj.extra["harness_run"]
    assert len(traj.extra["calls"]) == 1 and traj.extra["door"] == {"requests": 1, "refused": 0}
    assert traj.response_ids and traj.extra["answer"] == "42"
    assert result.reward == 1.0


async def test_a_hanging_preset_is_killed_at_its_wall_time_and_scored_as_the_agents_timeout(
        settings, pool, arith_server, job_sandbox):
    result = await _run(settings, arith_server, "hangs", max_wall_time_s=5, sandbox=job_sandbox)
    assert result.status == "completed" and result.failure == "agent", result.error
    assert result.trajectory.finish_reason == "harness_timeout"
    assert result.reward == 0.0 and result.attempts == 1
    assert alive("sleep 1001") == []


async def test_a_preset_flooding_its_output_keeps_a_bounded_tail_and_its_answer(
        settings, pool, arith_server, job_sandbox):
    result = await _run(settings, arith_server, "floods", sandbox=job_sandbox)
    assert result.status == "completed", result.error
    run = result.trajectory.extra["harness_run"]
    assert run["output_bytes"] > 64 * 2**20 and len(run["output_tail"]) <= 4000
    assert result.trajectory.extra["answer"] == "5" and result.reward == 1.0


async def test_processes_a_preset_leaves_behind_are_killed_when_it_exits(
        settings, pool, arith_server, job_sandbox):
    result = await _run(settings, arith_server, "forks-away", sandbox=job_sandbox)
    assert result.status == "completed", result.error
    assert result.trajectory.finish_reason == "stop" and result.reward == 1.0
    assert alive("sleep 1002") == []


async def test_a_preset_exiting_at_once_is_the_agents_failure_scored_zero(
        settings, pool, arith_server, job_sandbox):
    result = await _run(settings, arith_server, "exits-at-once", sandbox=job_sandbox)
    assert result.status == "completed" and result.failure == "agent", result.error
    traj = result.trajectory
    assert traj.finish_reason == "harness_error" and "status 3" in traj.extra["finish_detail"]
    assert "giving up" in traj.extra["harness_run"]["output_tail"]
    assert result.reward == 0.0 and result.attempts == 1


async def test_a_preset_not_installed_in_the_sandbox_says_so_and_is_scored_zero(
        settings, pool, arith_server, job_sandbox):
    result = await _run(settings, arith_server, "not-installed", sandbox=job_sandbox)
    assert result.status == "completed" and result.failure == "agent", result.error
    run = result.trajectory.extra["harness_run"]
    assert run["exit_code"] == 127 and "rollstream harnesses list" in run["output_tail"]
    assert result.reward == 0.0
