"""Every shipped harness preset (Qwen Code, OpenCode, Codex, Claude Code, mini-SWE-agent, OpenHands
SDK: each unmodified at its pinned version, in its lean variant) through the whole pipeline in
bubblewrap and in podman against the suite's real, unmodified vLLM. vLLM serves one model per
server: one server (for this module) serves the tiny model that learnt every preset's arith
episode (all_presets_model.py), and the twelve jobs run at once. Each job's model turns are vLLM's
own ids, the very ones its preset's episode taught the model, and eval scores the answer the
harness printed. The same server, its weights then swapped for random ones, shows a CLI on a model
that emits garbage: the agent's failure, scored, once; swapped for those of mini-SWE-agent's SWE
model, it drives mini-SWE-agent to fix a shipped SWE instance, whose diff eval's hidden tests pass."""

from __future__ import annotations

import contextlib
import json
import shutil
import time

import httpx
import model_cache
import pytest
from real_vllm.vllm_process import not_runnable_reason, start_vllm

from rollstream.llm.server import free_port
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks import arith
from rollstream.trainer.weight_sync import VllmReloadBackend

from .all_presets_model import expected_replies
from .episode_model import kept_examples, replies
from .mini_swe_scripted import ARITH_INSTANCE
from .node_clis import CLIS, INSTANCE, run_jobs, write_lean_presets
from .openhands_scripted import LEAN as OPENHANDS_LEAN
from .openhands_scripted import write_lean_preset
from .sandbox_presets import assert_fixed_and_scored, installed_preset, swe_job

# Twelve harness sandboxes at once on a busy 2-core machine; vLLM's startup first (tens of seconds).
pytestmark = [pytest.mark.timeout(1200),
              pytest.mark.skipif(bool(not_runnable_reason()), reason=str(not_runnable_reason()))]
MAX_MODEL_LEN = 4096  # the tiny model's positions: the CLIs' lean prompts run to ~3k tokens
TOOLS = {"qwen-code": "run_shell_command", "opencode": "bash", "codex": "exec_command", "claude-code": "Bash",
         "mini-swe-agent": "mswea_bash_command", "openhands-sdk": "terminal"}


def _agent(harness: str, max_tokens: int) -> dict:
    return {"harness": harness, "max_turns": 4, "max_tokens_per_turn": max_tokens, "max_context_tokens": 4000,
            "max_wall_time_s": 600}


def jobs(backend: str) -> dict[str, dict]:
    """Each preset's arith job as its built-in-server test submits it, in a sandbox of ``backend``
    (podman: from the preset's image, which scripts/install-harnesses built)."""
    from rollstream.agent.presets import build_image, find_preset
    from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE

    def sandbox(preset: str, limits: dict | None = None) -> dict:
        image = {"image": build_image(find_preset(preset), DEFAULT_BASE_IMAGE)} if backend == "docker" else {}
        return {"backend": backend, **image, **({"limits": limits} if limits else {})}

    out = {name: arith.job(INSTANCE, sampling={"temperature": 0.0, "max_tokens": 96}, agent=_agent(cli.lean, 96),
                           sandbox=sandbox(name, cli.limits)) for name, cli in CLIS.items()}
    greedy = {"temperature": 0.0, "max_tokens": 128}
    out["mini-swe-agent"] = arith.job(ARITH_INSTANCE, sampling=greedy, agent=_agent("mini-swe-agent", 128),
                                      sandbox=sandbox("mini-swe-agent"))
    out["openhands-sdk"] = arith.job(ARITH_INSTANCE, sampling=greedy, agent=_agent(OPENHANDS_LEAN, 128),
                                     sandbox=sandbox("openhands-sdk"))
    return out


@pytest.fixture(scope="module")
def all_presets_arith_model_dir():
    return model_cache.load("all_presets_arith_model_dir")


@pytest.fixture(scope="module")
def presets_vllm(all_presets_arith_model_dir, tmp_path_factory):
    """The suite's vLLM (its own venv, unmodified) on the model of every preset, for this module:
    on a copy, into which the garbage test loads other weights (one server start less)."""
    served = tmp_path_factory.mktemp("vllm-served") / "all-presets"
    shutil.copytree(all_presets_arith_model_dir, served)
    server = start_vllm(served, free_port(), tmp_path_factory.mktemp("vllm-log") / "vllm.log",
                        "rollstream-presets", max_model_len=MAX_MODEL_LEN)
    yield server
    server.stop()


def _start_pool(worker_pool, model_dir, sandbox_root, presets_dir, concurrency: int):
    pool = worker_pool(model_dir=model_dir, sandbox_root=sandbox_root)
    pool.env["ROLLSTREAM_HARNESS_PRESET_DIRS"] = json.dumps([str(presets_dir)])
    # The operator lets these jobs pick their sandbox's backend and image, and gives the CLIs room.
    pool.env["ROLLSTREAM_SANDBOX_JOB_OVERRIDES"] = '["backend", "image", "limits"]'
    pool.env["ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS"] = "1"
    pool.start_all(concurrency=concurrency)


async def test_every_preset_completes_its_arith_loop_on_vllm_in_bwrap_and_podman_with_vllms_ids_and_is_scored(
        settings, worker_pool, sandbox_root, tmp_path, all_presets_arith_model_dir, presets_vllm):
    for name in ("mini-swe-agent", "openhands-sdk", *CLIS):
        installed_preset(name)
    folder = write_lean_preset(write_lean_presets(tmp_path / "presets"))
    backends = ["bwrap"] + (["docker"] if DockerBackend().available() else [])
    submitted = {(preset, backend): job for backend in backends for preset, job in jobs(backend).items()}
    _start_pool(worker_pool, all_presets_arith_model_dir, sandbox_root, folder, len(submitted))
    started = time.monotonic()
    results = dict(zip(submitted, await run_jobs(settings, presets_vllm.url, list(submitted.values()),
                                                 timeout_s=1000)))
    print(f"{len(results)} jobs of six presets on one vLLM: {time.monotonic() - started:.0f} s")

    learnt = expected_replies()
    for (preset, backend), result in sorted(results.items()):
        assert result.status == "completed", (preset, backend, result.error)
        traj = result.trajectory
        run = traj.extra["harness_run"]
        context = (preset, backend, run, traj.response_text[-1500:], presets_vllm.log_tail(1500))
        assert traj.finish_reason == "stop" and run["exit_code"] == 0, context
        calls = traj.extra["calls"]
        assert {call["backend"] for call in calls} == {presets_vllm.url}, (preset, calls)
        # The model's turns are vLLM's own ids (the door never re-tokenizes them): the episode's, exactly.
        generated = [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in traj.segments]
        assert sum(generated, []) == sum(learnt[preset], []), context
        assert len(calls) == len(learnt[preset]) and f"{TOOLS[preset]}" in traj.response_text, context
        assert traj.extra["answer"] == "42" and result.reward == 1.0, context


@pytest.fixture(scope="module")
def tiny_model_dir():
    return model_cache.load("tiny_model_dir")


@contextlib.asynccontextmanager
async def _serving(vllm, weights_dir, then_dir):
    """``vllm`` serving ``weights_dir``'s weights, loaded as a trainer's weight sync loads them (every
    model here is trained from one tiny base: same architecture, tokenizer and template); afterwards
    ``then_dir``'s again, so the module's other tests find the model they expect in any order."""
    backend = VllmReloadBackend(vllm.url, vllm.model_dir)
    async with httpx.AsyncClient(timeout=300) as http:
        await backend.load(http, weights_dir, policy_version=1)
        try:
            yield vllm
        finally:
            await backend.load(http, then_dir, policy_version=2)


@pytest.fixture
async def garbage_on_vllm(presets_vllm, all_presets_arith_model_dir, tiny_model_dir):
    """vLLM serving the tiny model's random weights (the base every episode model was trained from);
    afterwards the presets' model again."""
    async with _serving(presets_vllm, tiny_model_dir, all_presets_arith_model_dir) as vllm:
        yield vllm


async def test_a_cli_on_vllm_serving_a_model_that_emits_garbage_is_the_agents_failure_scored_once(
        settings, worker_pool, sandbox_root, tmp_path, tiny_model_dir, garbage_on_vllm):
    cli = CLIS["qwen-code"]
    installed_preset(cli.preset)
    _start_pool(worker_pool, tiny_model_dir, sandbox_root, write_lean_presets(tmp_path / "presets"), 1)
    job = arith.job(INSTANCE, sampling={"temperature": 0.0, "max_tokens": 96},
                    agent={**_agent(cli.lean, 96), "max_turns": 2}, sandbox={"limits": cli.limits})
    [result] = await run_jobs(settings, garbage_on_vllm.url, [job])
    # A reply without a tool call is the CLI's last word: its answer (garbage), scored 0 by eval; a
    # call past the budget is refused for good and the CLI gives up (the agent's failure). Either way:
    # once, scored, never the service's failure, never retried.
    assert result.status == "completed" and result.failure != "service", (result.status, result.failure, result.error)
    traj = result.trajectory
    context = (traj.extra["harness_run"], traj.response_text[-1500:], garbage_on_vllm.log_tail(1500))
    print(f"{cli.preset} on garbage: finish {traj.finish_reason}, failure {result.failure}, door {traj.extra['door']}, "
          f"answer {traj.extra.get('answer')!r:.60}")
    assert {call["backend"] for call in traj.extra["calls"]} == {garbage_on_vllm.url}, context
    if traj.finish_reason == "stop":
        assert traj.extra["harness_run"]["exit_code"] == 0 and traj.extra["answer"] != "42", context
    else:
        assert traj.finish_reason in ("max_turns", "harness_error") and result.failure == "agent", context
    assert traj.response_ids and "reason" in traj.extra["eval"], context
    assert result.reward == 0.0 and result.attempts == 1, context


@pytest.fixture(scope="module")
def mini_swe_swe_model_dir():
    return model_cache.load("mini_swe_swe_model_dir")


@pytest.fixture
async def swe_model_on_vllm(presets_vllm, all_presets_arith_model_dir, mini_swe_swe_model_dir):
    """vLLM serving mini-SWE-agent's SWE model; afterwards the presets' model again."""
    async with _serving(presets_vllm, mini_swe_swe_model_dir, all_presets_arith_model_dir) as vllm:
        yield vllm


async def test_mini_swe_agent_on_vllm_fixes_a_shipped_swe_instance_in_bwrap_with_vllms_ids_and_its_diff_is_scored(
        settings, worker_pool, sandbox_root, tmp_path, mini_swe_swe_model_dir, swe_model_on_vllm):
    installed_preset("mini-swe-agent")
    _start_pool(worker_pool, mini_swe_swe_model_dir, sandbox_root, tmp_path, 1)
    [result] = await run_jobs(settings, swe_model_on_vllm.url,
                              [swe_job(str(tmp_path / "swe-mirror"), _agent("mini-swe-agent", 384))])
    assert result.status == "completed", result.error
    print(f"mini-SWE-agent's SWE job on vLLM, per stage: {result.timings_s}")
    traj = result.trajectory
    context = (traj.extra["harness_run"], traj.response_text[-1500:], swe_model_on_vllm.log_tail(1500))
    assert {call["backend"] for call in traj.extra["calls"]} == {swe_model_on_vllm.url}, context
    # Every model turn is vLLM's own ids, the very ones the SWE episode taught: an edit, then submit.
    generated = [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in traj.segments]
    assert sum(generated, []) == sum(replies(kept_examples(mini_swe_swe_model_dir)), []), context
    assert_fixed_and_scored(result)  # the hidden tests pass on the diff mini-SWE-agent left
