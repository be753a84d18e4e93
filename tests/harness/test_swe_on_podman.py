"""Every shipped preset (Codex, Claude Code, OpenCode, Qwen Code: Node.js CLIs; mini-SWE-agent,
OpenHands SDK: Python), unmodified, fixes the shipped SWE instance in **podman** through the whole
pipeline: its harness is installed onto the instance's environment image once, when the image is
built (`rollstream images build ... --harness`: a layer keyed by the image and the preset's install),
init starts the agent's sandbox from that layer, and eval scores the diff in a fresh sandbox of the
pristine environment image. Each preset's model is its bwrap SWE model: the podman episode renders
the prompts its bwrap episode renders (Codex's random chunk id in its tool output aside, which two
bwrap runs vary as well), but for OpenHands, whose terminal names its interpreter: its model learnt
the episode captured in both (openhands_swe.py). One built-in server serves them in turn, its
weights swapped between jobs as a trainer's weight sync does; one pool runs the jobs. The same
server on random weights (a model that emits garbage) runs the six jobs at once: each is scored
once as the agent's outcome (its failure, or a garbage last word), never the service's, its
containers gone."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from rollstream.agent.harness_images import ENGINE_BACKENDS, agent_spec, layer_tag
from rollstream.agent.presets import find_preset
from rollstream.errors import JobFailed
from rollstream.sandboxes.backends.docker import client_env, container_name
from rollstream.sandboxes.paths import sandbox_id_for
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import SweTask

from . import swe_podman_image
from .episode_model import kept_examples, replies
from .node_clis import CLIS, CODEX, run_job, run_jobs, write_lean_presets
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


@pytest.fixture(scope="module")
def presets_dir(tmp_path_factory):
    """The tests' lean variants (an operator's folder of presets): the Node.js CLIs' and OpenHands'."""
    return write_lean_preset(write_lean_presets(tmp_path_factory.mktemp("presets")))


@pytest.fixture(scope="module")
def instance():
    return swe_podman_image.instance()


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
    _pool(module_pool, next(iter(swe_model_dirs.values())), presets_dir)  # (the models share their tokenizer)
    results = {}
    for name in JOBS:
        # Each preset's model in turn on the one server, as a weight sync loads a policy.
        results[name] = await run_job(module_settings, preset_server.serving(swe_model_dirs[name]),
                                      _podman_job(name, str(tmp_path / "swe-mirror"), MAX_TOKENS))
    failed = {}
    for name, result in results.items():
        try:  # The harness ran (exit 0) from its layer: the environment image alone has none of them.
            assert_fixed_and_scored(result)
            # Its model turns, every one, are the ones its episode taught (an edit, then done): the
            # prompts it was given in podman are the ones it learnt.
            traj = result.trajectory
            generated = replies([(s.response_ids, s.loss_mask) for s in traj.segments])
            assert generated == replies(kept_examples(swe_model_dirs[name])), traj.response_text[-1500:]
        except AssertionError as error:
            failed[name] = f"{result.status} {result.error}: {str(error)[-1500:]}"
    assert not failed, failed


def _pool(module_pool, model_dir, presets_dir):
    """The module's one pool, room for every preset's job at once; the operator lets these jobs pick
    their sandbox's backend and limits."""
    return module_pool(model_dir, {
        "ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(presets_dir)]),
        "ROLLSTREAM_SANDBOX_JOB_OVERRIDES": '["backend", "limits"]', "ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS": "1"},
        concurrency=len(JOBS))


def _podman_job(name: str, mirror: str, max_tokens: int, **agent) -> dict:
    """Preset ``name``'s SWE job in podman: it picks its backend and limits, not its image (init picks
    the layer, eval the environment)."""
    preset_agent, limits = JOBS[name]
    job = swe_job(mirror, {**preset_agent, "max_tokens_per_turn": max_tokens, **agent})
    job = {**job, "sampling": {**job["sampling"], "max_tokens": max_tokens},
           **({"sandbox": {"limits": limits}} if limits else {})}
    return swe_podman_image.on_podman(job)


async def test_every_preset_in_podman_on_a_model_that_emits_garbage_is_scored_once_as_the_agents_and_torn_down(
        module_settings, module_pool, preset_server, built, presets_dir, swe_model_dirs, tiny_model_dir, tmp_path):
    # The tiny model's random weights: no per-preset model, so the six jobs run at once, each on a
    # small budget (two model calls of a few tokens).
    _pool(module_pool, next(iter(swe_model_dirs.values())), presets_dir)
    server = preset_server.serving(tiny_model_dir)
    since = int(time.time()) - 1
    jobs = {name: _podman_job(name, str(tmp_path / "swe-mirror"), 24, max_turns=2) for name in JOBS}
    started = time.monotonic()
    results = dict(zip(jobs, await run_jobs(module_settings, server, list(jobs.values()))))
    print(f"{len(jobs)} presets' SWE jobs in podman on garbage, at once: {time.monotonic() - started:.0f} s")
    failed = {}
    for name, result in results.items():
        traj = result.trajectory
        context = (name, result.status, result.failure, result.error, traj and traj.extra.get("harness_run"),
                   traj and traj.response_text[-600:])
        print(f"{name} in podman on garbage: finish {traj and traj.finish_reason}, failure {result.failure}, "
              f"door {traj and traj.extra['door']}, seconds {({k: round(v, 1) for k, v in result.timings_s.items()})}")
        try:
            # Scored once (eval ran on whatever it left: no fix), never the service's failure, never retried.
            assert result.status == "completed" and result.attempts == 1 and result.reward == 0.0, context
            # A harness that calls past its budget, or stops on an error of its own, is the agent's failure;
            # one that takes a reply without a tool call as its last word (OpenCode, OpenHands) exits 0
            # and its answer is scored like any other.
            assert result.failure == "agent" and traj.finish_reason in ("max_turns", "harness_error") or \
                result.failure is None and traj.finish_reason == "stop" and \
                traj.extra["harness_run"]["exit_code"] == 0, context
            assert traj.extra["door"]["requests"] >= 1 and "reason" in traj.extra["eval"], context
            assert {call["backend"] for call in traj.extra["calls"]} == {server}, context
            # Its container was made, run and removed by the engine, and none of its sandboxes is left.
            events, left = _engine_record(result.job_id, since)
            assert {"create", "start"} <= set(events) and events[-1] in ("remove", "destroy") and not left, \
                (name, events, left)
        except AssertionError as error:
            failed[name] = str(error)[-1500:]
    assert not failed, failed


def _engine_record(job_id: str, since: int) -> tuple[list[str], list[str]]:
    """What the engine did with the job's agent container since ``since`` (its events), and the
    containers of the job's sandboxes it still has (each labelled with the job as their owner)."""
    def docker(*argv: str) -> list[str]:
        return subprocess.run(["docker", *argv], capture_output=True, text=True, env=client_env(), timeout=60,
                              check=True).stdout.split()

    events = docker("events", "--since", str(since), "--until", str(int(time.time()) + 1), "--filter",
                    f"container={container_name(sandbox_id_for(job_id, 0))}", "--format", "{{.Status}}")
    return events, docker("ps", "--all", "--quiet", "--filter", f"label=rollstream.owner={job_id}")
