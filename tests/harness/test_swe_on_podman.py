"""Every shipped preset (Codex, Claude Code, OpenCode, Qwen Code: Node.js CLIs; mini-SWE-agent,
OpenHands SDK: Python), unmodified, fixes the shipped SWE instance in **podman** through the whole
pipeline: its harness is installed onto the instance's environment image once, when the image is
built (`rollstream images build ... --harness`: a layer keyed by the image and the preset's install),
init starts the agent's sandbox from that layer, and eval scores the diff in a fresh sandbox of the
pristine environment image. Each preset's model is its bwrap SWE model: the podman episode renders
the prompts its bwrap episode renders (Codex's random chunk id in its tool output aside, which two
bwrap runs vary as well). One built-in server serves them in turn, its weights swapped between
jobs as a trainer's weight sync does; one pool runs the jobs."""

from __future__ import annotations

import json

import pytest

from rollstream.agent.harness_images import ENGINE_BACKENDS, agent_spec, layer_tag
from rollstream.agent.presets import find_preset
from rollstream.errors import JobFailed
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import SweTask

from . import swe_podman_image
from .episode_model import kept_examples, replies
from .node_clis import CLIS, CODEX, run_job, write_lean_presets
from .openhands_scripted import LEAN as OPENHANDS_LEAN
from .openhands_scripted import write_lean_preset
from .sandbox_presets import assert_fixed_and_scored, swe_job

pytestmark = pytest.mark.timeout(1800)  # a first run builds the environment image and its harness layers, once


def _agent(harness: str, context_tokens: int = 4000) -> dict:
    return {"harness": harness, "max_turns": 4, "max_context_tokens": context_tokens, "max_wall_time_s": 300}


# Each preset's SWE job as its bwrap test runs it (the harness, its context, its sandbox limits); its
# model is conftest's swe_model_dirs[name].
JOBS = {
    **{name: (_agent(cli.lean, cli.swe_context_tokens), cli.limits) for name, cli in CLIS.items()},
    "mini-swe-agent": (_agent("mini-swe-agent"), None),
    "openhands-sdk": (_agent(OPENHANDS_LEAN), None),
}
# The learnt turns run to 225 tokens: a turn past them is off the episode anyway.
MAX_TOKENS = 256
# OpenHands' SWE model learnt its episode from two captures on this host (openhands_scripted.py), whose
# terminal observation names the working folder and the interpreter: in any sandbox (bwrap as podman)
# they read /workspace/inventory (and bwrap's venv python), so its second turn ("finish") is not the
# learnt one, and the job ends on that reply as OpenHands' final message. Its edit, the first turn, is.
LEARNT_TURNS = {"openhands-sdk": 1}  # (the others: every turn)


@pytest.fixture(scope="module")
def presets_dir(tmp_path_factory):
    """The tests' lean variants (an operator's folder of presets): the Node.js CLIs' and OpenHands'."""
    return write_lean_preset(write_lean_presets(tmp_path_factory.mktemp("presets")))


@pytest.fixture(scope="module")
def instance():
    return swe_podman_image.instance()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The environment image and every preset's layer on it (scripts/install-harnesses built them: cached)."""
    if not DockerBackend().available():
        pytest.fail("no container engine answers at DOCKER_HOST (scripts/install-podman sets up podman's)")
    return swe_podman_image.build(tmp_path_factory.mktemp("instances"))


@pytest.mark.parametrize("name", swe_podman_image.HARNESSES)
def test_the_build_layers_each_preset_on_the_instances_environment_image(name, instance, built, presets_dir):
    env_image = swe_env.sandbox_image(swe_records.normalize(instance))
    assert built["tag"] == env_image and built["harnesses"][name] == layer_tag(find_preset(name), env_image)
    # Named by the install: the test's lean variant (other options, one install) shares its preset's layer.
    harness = JOBS[name][0]["harness"]
    assert layer_tag(find_preset(harness, [presets_dir]), env_image) == built["harnesses"][name]


async def test_only_a_preset_job_on_an_engine_starts_from_the_layer(instance, built, presets_dir):
    spec = SweTask().sandbox_spec(instance)
    on_podman = spec.model_copy(update={"backend": ENGINE_BACKENDS[0]})
    harness = CODEX.lean
    assert (await agent_spec(spec, on_podman, harness, [presets_dir])).image == built["harnesses"][CODEX.preset]
    # A job that chose its image, a Python harness: the task's spec as it is. (bwrap and Singularity
    # start from the layer's rootfs / SIF: tests/sandboxes/test_images_harness.py.)
    for resolved, job_harness in ((on_podman.model_copy(update={"image": "localhost/other:1"}), harness),
                                (on_podman, "openai-chat"), (on_podman, None)):
        assert await agent_spec(spec, resolved, job_harness, [presets_dir]) == spec
    # A layer nobody built: the job fails at once with the command that builds it, never an install.
    unbuilt = spec.model_copy(update={"image": "localhost/rollstream/env:0000000000000000000f"})
    with pytest.raises(JobFailed, match=f"--harness {CODEX.lean}") as failed:
        await agent_spec(unbuilt, unbuilt.model_copy(update={"backend": "docker"}), harness, [presets_dir])
    assert not failed.value.retryable


async def test_every_preset_fixes_the_swe_instance_in_podman_and_eval_scores_its_diff(
        module_settings, module_pool, preset_server, built, presets_dir, swe_model_dirs, tmp_path):
    # The jobs pick their backend and limits, not their image: init picks the layer, eval the environment.
    module_pool(next(iter(swe_model_dirs.values())), {  # (the models share their tokenizer)
        "ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(presets_dir)]),
        "ROLLSTREAM_SANDBOX_JOB_OVERRIDES": '["backend", "limits"]', "ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS": "1"})
    results = {}
    for name, (agent, limits) in JOBS.items():
        job = swe_job(str(tmp_path / "swe-mirror"), {**agent, "max_tokens_per_turn": MAX_TOKENS})
        job = {**job, "instance": {**job["instance"], "environment": swe_podman_image.ENVIRONMENT},
               "sampling": {**job["sampling"], "max_tokens": MAX_TOKENS},
               "sandbox": {"backend": "docker", **({"limits": limits} if limits else {})}}
        # Each preset's model in turn on the one server, as a weight sync loads a policy.
        results[name] = await run_job(module_settings, preset_server.serving(swe_model_dirs[name]), job)
    failed = {}
    for name, result in results.items():
        try:  # The harness ran (exit 0) from its layer: the environment image alone has none of them.
            assert_fixed_and_scored(result)
            # Its model turns are the ones its bwrap episode taught (an edit, then done): the prompts
            # it was given in podman are the ones it learnt.
            traj = result.trajectory
            generated = replies([(s.response_ids, s.loss_mask) for s in traj.segments])
            learnt = replies(kept_examples(swe_model_dirs[name]))
            turns = LEARNT_TURNS.get(name, len(learnt))
            assert generated[:turns] == learnt[:turns] and len(generated) >= turns, traj.response_text[-1500:]
        except AssertionError as error:
            failed[name] = f"{result.status} {result.error}: {str(error)[-1500:]}"
    assert not failed, failed
