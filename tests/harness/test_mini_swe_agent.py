"""The mini-SWE-agent preset, unmodified at its pinned version (2.4.6), through the whole pipeline
in bubblewrap (its venv on the host's own root, `rollstream harnesses install mini-swe-agent`) and
in podman (an environment image with it, `--image`), two jobs at once, against the built-in server. A tiny model
that learnt one mini-SWE-agent episode by heart drives it: a bash block that computes, then the
submit command; eval scores what mini-SWE-agent submitted; on a shipped SWE instance (bwrap), the
diff it left in the sandbox, by the instance's hidden tests. The arith model, which knows nothing
of mini-SWE-agent's format, shows a harness that fails is the agent's failure, scored, once."""

from __future__ import annotations

import model_cache
import pytest

from rollstream.agent.presets import build_image
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
from rollstream.tasks import arith

from .mini_swe_scripted import ARITH_INSTANCE as INSTANCE
from .node_clis import run_job as _run
from .node_clis import run_jobs
from .sandbox_presets import assert_fixed_and_scored, installed_preset, swe_job

GREEDY = {"temperature": 0.0, "max_tokens": 128}
AGENT = {"harness": "mini-swe-agent", "max_turns": 4, "max_tokens_per_turn": 128, "max_context_tokens": 4000,
         "max_wall_time_s": 240}


# Installs and models come before the tests: what is left is the jobs, on a busy 2-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def preset():
    return installed_preset("mini-swe-agent")


@pytest.fixture(scope="module")
def mini_swe_arith_model_dir():
    return model_cache.load("mini_swe_arith_model_dir")


@pytest.fixture(scope="module")
def mini_swe_swe_model_dir():
    return model_cache.load("mini_swe_swe_model_dir")


@pytest.fixture
def mini_server(preset_server, mini_swe_arith_model_dir):
    return preset_server.serving(mini_swe_arith_model_dir)


@pytest.fixture(scope="module")
def pool(module_pool, mini_swe_arith_model_dir):
    """The module's workers (its jobs' models share their tokenizer); the operator lets the jobs
    pick their sandbox's backend and image."""
    return module_pool(mini_swe_arith_model_dir, {"ROLLSTREAM_SANDBOX_JOB_OVERRIDES": '["backend", "image"]'})


def _assert_submitted_and_scored(result) -> None:
    assert result.status == "completed", result.error
    traj = result.trajectory
    run = traj.extra["harness_run"]
    assert traj.finish_reason == "stop" and run["exit_code"] == 0, run
    assert len(traj.extra["calls"]) == 2 and traj.extra["door"] == {"requests": 2, "refused": 0}
    assert "mswea_bash_command" in traj.response_text and "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in traj.response_text
    assert traj.extra["answer"] == "42" and result.reward == 1.0


async def test_mini_swe_agent_in_bwrap_and_in_podman_completes_its_loop_and_its_submission_is_scored(
        module_settings, pool, mini_server, preset):
    # One pool runs both jobs at once, each in the sandbox backend it asks for.
    sandboxes = [{"backend": "bwrap"}]
    if DockerBackend().available():  # (a podman engine answers here: scripts/install-podman)
        sandboxes.append({"backend": "docker", "image": build_image(preset, DEFAULT_BASE_IMAGE)})  # once
    for result in await run_jobs(module_settings, mini_server, [arith.job(INSTANCE, sampling=GREEDY, agent=AGENT,
                                                                   sandbox=sandbox) for sandbox in sandboxes]):
        _assert_submitted_and_scored(result)


async def test_mini_swe_agent_on_a_model_that_emits_garbage_is_the_agents_failure_scored_once(
        module_settings, pool, arith_server, preset):
    result = await _run(module_settings, arith_server, arith.job(INSTANCE, agent={**AGENT, "max_turns": 2}))
    assert result.status == "completed" and result.failure == "agent", result.error
    traj = result.trajectory
    # Two answers without a bash block (format errors), then a third call past the budget: refused
    # for good (no retry), and mini-SWE-agent stops on it.
    assert traj.finish_reason == "max_turns", traj.extra
    assert len(traj.extra["calls"]) == 2 and traj.extra["door"] == {"requests": 3, "refused": 1}
    assert result.reward == 0.0 and result.attempts == 1


async def test_mini_swe_agent_fixes_a_shipped_swe_instance_in_bwrap_and_its_diff_is_scored(
        module_settings, pool, mini_swe_swe_model_dir, preset_server, tmp_path):
    result = await _run(module_settings, preset_server.serving(mini_swe_swe_model_dir),
                        swe_job(str(tmp_path / "swe-mirror"), AGENT))
    assert_fixed_and_scored(result)
