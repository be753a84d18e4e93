"""The OpenHands SDK preset, unmodified at its pinned version (1.58.2, with openhands-tools), through
the whole pipeline in bubblewrap (its venv on the host's own root, made from a Python 3.12:
scripts/install-harnesses) and in podman (an image that copies both in), two jobs at once, against
the built-in server. Its lean variant (the shipped preset with its runner's options for a short system prompt
and the terminal tool alone: openhands_scripted.py) is driven by tiny models that learnt one episode
each by heart: a terminal call, then finish with the answer, scored by eval; on a shipped SWE
instance, an edit of the checkout by one command, then finish, and eval scores the diff it left by
the instance's hidden tests. The arith model, which knows
nothing of OpenHands' tools, shows a harness that fails is the agent's failure, scored, once."""

from __future__ import annotations

import json

import model_cache
import pytest

from rollstream.agent.presets import PresetError, build_image, driver_source, find_preset, load_preset
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
from rollstream.tasks import arith

from .episode_model import kept_examples, replies
from .node_clis import assert_answered_and_scored, run_job, run_jobs
from .openhands_scripted import ARITH_INSTANCE, LEAN, write_lean_preset
from .sandbox_presets import assert_fixed_and_scored, installed_preset, swe_job

AGENT = {"harness": LEAN, "max_turns": 4, "max_tokens_per_turn": 128, "max_context_tokens": 4000,
         "max_wall_time_s": 300}
GREEDY = {"temperature": 0.0, "max_tokens": 128}

# Installs and models come before the tests: what is left is the jobs, on a busy 2-core machine.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def preset():
    return installed_preset("openhands-sdk")


@pytest.fixture(scope="module")
def openhands_arith_model_dir():
    return model_cache.load("openhands_arith_model_dir")


@pytest.fixture(scope="module")
def openhands_swe_model_dir():
    return model_cache.load("openhands_swe_model_dir")


@pytest.fixture
def openhands_server(preset_server, openhands_arith_model_dir):
    return preset_server.serving(openhands_arith_model_dir)


@pytest.fixture(scope="module")
def pool(module_pool, tmp_path_factory, preset, openhands_arith_model_dir):
    """The module's workers (its jobs' models share their tokenizer), told of the lean preset (an
    operator's folder)."""
    folder = write_lean_preset(tmp_path_factory.mktemp("presets"))
    return module_pool(openhands_arith_model_dir, {"ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(folder)]),
                                                   # the tests' jobs pick them
                                                   "ROLLSTREAM_SANDBOX_JOB_OVERRIDES": '["backend", "image"]'})


def test_the_preset_pins_the_sdk_and_its_tools_and_runs_rollstreams_runner_of_them(tmp_path):
    preset = find_preset("openhands-sdk")
    assert preset.package.split() == ["openhands-sdk==1.58.2", "openhands-tools==1.58.2"]
    assert preset.install_commands()[1].endswith(" openhands-sdk==1.58.2 openhands-tools==1.58.2")
    assert preset.driver == "openhands" and driver_source("openhands").name == "openhands_runner.py"
    # Its image copies in the host's 3.12 and venv (the base image's Python is 3.11).
    steps = preset.containerfile("base").splitlines()
    assert steps[2:] == ["COPY python-home /opt/rollstream/python/3.12", f"COPY prefix {preset.prefix}"], steps
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(preset.source.read_text().replace('name = "openhands-sdk"', 'name = "elsewhere"')
                         .replace('python_home = "/opt/rollstream/python/3.12"', 'python_home = "/usr"'))
    with pytest.raises(PresetError, match="must be the absolute folder that holds install.python"):
        load_preset(elsewhere)
    broken = tmp_path / "broken.toml"
    broken.write_text(find_preset("openhands-sdk").source.read_text().replace('name = "openhands-sdk"',
                                                                              'name = "broken"')
                      .replace('driver = "openhands"', 'driver = "../../gateway"'))
    with pytest.raises(PresetError, match="none of rollstream's runners"):
        load_preset(broken)


async def test_openhands_in_bwrap_and_in_podman_completes_its_tool_loop_and_its_answer_is_scored(
        module_settings, pool, preset, openhands_server):
    # One pool runs both jobs at once, each in the sandbox backend it asks for. The podman image
    # copies in the host's venv and the Python 3.12 it was made from (the base has 3.11):
    # scripts/install-harnesses builds it once; here a no-op.
    sandboxes = [{"backend": "bwrap"}]
    if DockerBackend().available():  # (a podman engine answers here: scripts/install-podman)
        sandboxes.append({"backend": "docker", "image": build_image(preset, DEFAULT_BASE_IMAGE)})
    jobs = [arith.job(ARITH_INSTANCE, sampling=GREEDY, agent=AGENT, sandbox=sandbox) for sandbox in sandboxes]
    for result in await run_jobs(module_settings, openhands_server, jobs):
        assert_answered_and_scored(result, "terminal", calls=2)
        assert '"name": "finish"' in result.trajectory.response_text


async def test_openhands_on_a_model_that_emits_garbage_ends_once_scored_zero_as_the_agents_answer(
        module_settings, pool, arith_server):
    result = await run_job(module_settings, arith_server, arith.job(ARITH_INSTANCE, sampling=GREEDY,
                                                                    agent={**AGENT, "max_turns": 2}))
    # A reply without a tool call is OpenHands' final message: the agent's answer (garbage), scored
    # 0 by eval; a call of a tool it lacks gets an error back until the budget ends it (the agent's
    # failure). Either way: once, scored, never the service's failure, never retried.
    assert result.status == "completed" and result.failure != "service", (result.status, result.failure, result.error)
    traj = result.trajectory
    if traj.finish_reason == "stop":
        assert traj.extra["harness_run"]["exit_code"] == 0 and traj.extra["answer"] != "42", traj.extra
    else:
        assert traj.finish_reason in ("max_turns", "harness_error") and result.failure == "agent", traj.extra
    assert traj.response_ids and "reason" in traj.extra["eval"]
    assert result.reward == 0.0 and result.attempts == 1


async def test_openhands_fixes_a_shipped_swe_instance_in_bwrap_and_its_diff_is_scored(
        module_settings, pool, openhands_swe_model_dir, preset_server, tmp_path):
    result = await run_job(module_settings, preset_server.serving(openhands_swe_model_dir),
                           swe_job(str(tmp_path / "swe-mirror"), AGENT))
    assert_fixed_and_scored(result)
    # Every model turn (an edit, then finish) is the learnt one: the episode was captured in a sandbox.
    generated = replies([(s.response_ids, s.loss_mask) for s in result.trajectory.segments])
    assert generated == replies(kept_examples(openhands_swe_model_dir)), result.trajectory.response_text[-1500:]
