"""Every shipped harness preset (Qwen Code, OpenCode, Codex, Claude Code, mini-SWE-agent, OpenHands
SDK: each unmodified at its pinned version, in its lean variant) through the whole pipeline in
bubblewrap and in podman against the suite's real, unmodified vLLM. vLLM serves one model per
server: one server (for this module) serves the tiny model that learnt every preset's arith
episode (all_presets_model.py), and the twelve jobs run at once. Each job's model turns are vLLM's
own ids, the very ones its preset's episode taught the model, and eval scores the answer the
harness printed. The same server, its weights then swapped for random ones, shows a CLI on a model
that emits garbage: the agent's failure, scored, once; swapped in turn for each preset's SWE model,
it drives every preset to fix a shipped SWE instance in bwrap and in podman at once, whose diff
eval's hidden tests pass."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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

from . import swe_podman_image
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
# The CLIs' lean arith prompts run to ~3.7k tokens, their SWE episodes past the tiny model's 4096
# positions (Qwen Code's to ~4.4k): the context each CLI's SWE job is served on the built-in server.
MAX_MODEL_LEN = max(cli.swe_context_tokens for cli in CLIS.values())
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
    on a copy, into which other tests load other weights (one server start for all). The copy's
    config declares MAX_MODEL_LEN positions, as vLLM asks of a longer context: the model's rotary
    positions are computed, not learnt (no weight depends on their number), and the tests check
    the learnt ids still come out."""
    served = tmp_path_factory.mktemp("vllm-served") / "all-presets"
    shutil.copytree(all_presets_arith_model_dir, served)
    config = json.loads((served / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default", config  # no scaling that reads the count
    (served / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_MODEL_LEN}))
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


@contextlib.asynccontextmanager
async def _weights(vllm, then_dir):
    """Yields ``load(weights_dir)``, which has ``vllm`` serve those weights, loaded as a trainer's
    weight sync loads them (every model here is trained from one tiny base: same architecture,
    tokenizer and template); afterwards ``then_dir``'s again, so the module's other tests find the
    model they expect in any order."""
    backend = VllmReloadBackend(vllm.url, vllm.model_dir)
    versions = itertools.count(1)
    async with httpx.AsyncClient(timeout=300) as http:

        async def load(weights_dir) -> None:
            await backend.load(http, weights_dir, policy_version=next(versions))

        try:
            yield load
        finally:
            await load(then_dir)


@contextlib.asynccontextmanager
async def _serving(vllm, weights_dir, then_dir):
    """``vllm`` serving ``weights_dir``'s weights; afterwards ``then_dir``'s again."""
    async with _weights(vllm, then_dir) as load:
        await load(weights_dir)
        yield vllm


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


def swe_jobs(mirror: str) -> dict[tuple[str, str], dict]:
    """Each preset's job on the shipped SWE instance (its repository mirrored into ``mirror``), by
    (preset, backend): in bwrap, and in podman from its layer on the instance's environment image."""
    out = {"mini-swe-agent": swe_job(mirror, _agent("mini-swe-agent", 384)),
           "openhands-sdk": swe_job(mirror, _agent(OPENHANDS_LEAN, 384))}
    for name, cli in CLIS.items():
        agent = {**_agent(cli.lean, 384), "max_context_tokens": cli.swe_context_tokens}
        out[name] = {**swe_job(mirror, agent), "sandbox": {"limits": cli.limits}}
    return {(name, backend): job if backend == "bwrap" else swe_podman_image.on_podman(job)
            for name, job in out.items() for backend in ("bwrap", "docker")}


async def _past_the_run_stage(client, job_ids: list[str], timeout_s: float = 600) -> None:
    """Wait until every job of ``job_ids`` has left the run stage: its harness has made its last model call."""
    deadline = time.monotonic() + timeout_s
    for job_id in job_ids:
        while (state := await client.status(job_id)) is None or state.stage not in ("eval", "done", "dead"):
            assert time.monotonic() < deadline, f"job {job_id} still in {state and state.stage} after {timeout_s} s"
            await asyncio.sleep(0.1)


async def test_every_preset_fixes_a_shipped_swe_instance_on_vllm_in_bwrap_and_podman_with_vllms_ids_and_is_scored(
        settings, worker_pool, sandbox_root, tmp_path, presets_vllm, all_presets_arith_model_dir, swe_model_dirs,
        built):
    from rollstream.client import AsyncClient
    from rollstream.llm.balancer import add_backend

    for name in swe_model_dirs:
        installed_preset(name)
    # One pool (the door renders with the models' one tokenizer) and one server: vLLM serves one model
    # at a time, so each preset's two jobs (bwrap, podman: submitted together) run on its SWE model's
    # weights alone. Their run stage (the model calls) waits for the weights; their eval overlaps the
    # next preset's init and run.
    jobs = swe_jobs(str(tmp_path / "swe-mirror"))
    _start_pool(worker_pool, all_presets_arith_model_dir, sandbox_root,
                write_lean_preset(write_lean_presets(tmp_path / "presets")), len(jobs))
    submitted: dict[tuple[str, str], str] = {}
    swaps_s = []
    started = time.monotonic()
    async with AsyncClient(settings=settings) as client, _weights(presets_vllm, all_presets_arith_model_dir) as load:
        await add_backend(client.r, presets_vllm.url, settings.namespace)
        for preset in swe_model_dirs:
            swap_started = time.monotonic()
            await load(swe_model_dirs[preset])
            swaps_s.append(time.monotonic() - swap_started)
            for key in ((preset, "bwrap"), (preset, "docker")):
                submitted[key] = str(await client.submit(jobs[key]))
            await _past_the_run_stage(client, [submitted[preset, "bwrap"], submitted[preset, "docker"]])
        results = {result.job_id: result for result in await client.collect(len(submitted), timeout_s=600)}
    print(f"{len(submitted)} SWE jobs of six presets on one vLLM, a preset's bwrap and podman jobs at once: "
          f"{time.monotonic() - started:.0f} s (weight swaps {sum(swaps_s):.1f} s)")

    for key, job_id in submitted.items():
        print(f"{key}'s SWE job on vLLM, per stage: {results[job_id].timings_s}")
    failed = {}
    for (preset, backend), job_id in submitted.items():
        result = results[job_id]
        traj = result.trajectory
        context = (preset, backend, result.status, result.error, traj and traj.extra["harness_run"],
                   traj and traj.response_text[-1500:])
        try:
            assert result.status == "completed", context
            assert {call["backend"] for call in traj.extra["calls"]} == {presets_vllm.url}, context
            # Every model turn is vLLM's own ids, the very ones the preset's SWE episode taught: an edit, then done.
            generated = sum([[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in traj.segments], [])
            assert generated == sum(replies(kept_examples(swe_model_dirs[preset])), []), context
            assert_fixed_and_scored(result)  # the hidden tests pass on the diff the harness left
        except AssertionError as error:
            failed[preset, backend] = str(error)[-1500:]
    assert not failed, (failed, presets_vllm.log_tail(1500))
