"""verifiers environments, unmodified, through the whole pipeline (real Redis, real worker
processes, the built-in model server): a single-turn (reverse-text), a multi-turn (alphabet-sort,
env_response), a tool environment (tool-test) and a SandboxEnv whose commands run in the job's
sandbox (sandbox-secret), after verifiers' own examples
(tests/tasks/verifiers_envs). A model that gives the dataset's answer scores 1 by each
environment's rubric, a model that writes garbage 0; every model token in the trajectory is the
backend's own; sandbox-secret scores the same on podman (a job that picks the docker backend) as on
bwrap; an environment that raises fails its job (failure 'task'), naming the error."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import model_cache
import pytest

pytest.importorskip("verifiers", reason="the verifiers extra: pip install rollstream[verifiers]")

from rollstream.client import AsyncClient
from rollstream.errors import InvalidJob
from rollstream.llm.balancer import add_backend
from rollstream.llm.inference_client import SamplingParams, VLLMClient
from rollstream.sandboxes.backends.docker import client_env, container_name
from rollstream.sandboxes.paths import sandbox_id_for
from rollstream.sandboxes.policy import DEFAULT_JOB_OVERRIDES

from .verifiers_scripted import ENVS_DIR

ENVIRONMENTS = ["vf-reverse-text", "vf-alphabet-sort", "vf-tool-test", "vf-sandbox-secret"]
ALLOWED = [*ENVIRONMENTS, "vf-broken"]
GREEDY = {"temperature": 0.0}
AGENT = {"max_turns": 4, "max_tokens_per_turn": 64, "max_context_tokens": 4096}
# A job's own sandbox on podman: the operator lets jobs pick the backend and an image of its own list.
PODMAN = {"backend": "docker", "image": "localhost/rollstream/python:bookworm"}
ON_PODMAN = "vf-sandbox-secret@podman"


@pytest.fixture(scope="session")
def answering_model_dir() -> Path:
    """The tiny model trained to give row 0's answers (tests/model_cache.py builds it before the tests)."""
    return model_cache.load("answering_model_dir")


@pytest.fixture(scope="module")
def answering_server(answering_model_dir):
    """The built-in server serving the answering model, shared by the module's tests (each adds it as
    a backend of its own namespace; greedy sampling gives every test the same ids)."""
    from rollstream.llm.server import served_model

    with served_model(answering_model_dir, device="cpu") as url:
        yield url


@pytest.fixture(scope="module")
def random_model_dir() -> Path:
    return model_cache.load("tiny_model_dir")  # untrained: no tags, no tool calls


@pytest.fixture(scope="module")
def random_server(random_model_dir):
    """The built-in server serving the untrained model, shared by the module's tests."""
    from rollstream.llm.server import served_model

    with served_model(random_model_dir, device="cpu") as url:
        yield url


@pytest.fixture
def allowed(monkeypatch):
    """The operator's allow-list, for the client's checks here and the workers started after."""
    monkeypatch.setenv("ROLLSTREAM_VERIFIERS_ENVIRONMENTS", json.dumps(ALLOWED))


def pool_env() -> dict[str, str]:
    return {"PYTHONPATH": str(ENVS_DIR),  # the environments' packages, installed on the workers
            "ROLLSTREAM_SANDBOX_JOB_OVERRIDES": json.dumps([*DEFAULT_JOB_OVERRIDES, *PODMAN]),
            "ROLLSTREAM_VERIFIERS_ENVIRONMENTS": json.dumps(ALLOWED)}


def start_pool(worker_pool, model_dir, sandbox_root):
    pool = worker_pool(model_dir=model_dir, sandbox_root=sandbox_root)
    pool.env.update(pool_env())
    pool.start_all(concurrency=4)
    return pool


@pytest.fixture
def answering_settings(shared_pool, answering_model_dir):
    """Settings of the module's pool for the answering model (its tokenizer): shared by the tests
    that run jobs on it, so workers start and load each environment once, not once a test."""
    return shared_pool("answering", env=pool_env(), concurrency=4, model_dir=answering_model_dir)


@pytest.fixture
def random_settings(shared_pool, random_model_dir):
    """The same for the untrained model (a tokenizer of its own)."""
    return shared_pool("random", env=pool_env(), concurrency=4, model_dir=random_model_dir)


def job(environment: str, index: int = 0, **instance) -> dict:
    return {"task": "verifiers", "instance": {"environment": environment, "index": index, **instance},
            "sampling": GREEDY, "agent": AGENT}


def on_podman(environment: str) -> dict:
    """The job in a podman container of its own (the docker backend on podman), named for the results."""
    return {**job(environment), "sandbox": PODMAN, "metadata": {"label": f"{environment}@podman"}}


async def run_jobs(settings, server: str, jobs: list[dict]) -> dict[str, object]:
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, server, settings.namespace)
        for j in jobs:
            await client.submit(j)
        results = await client.collect(len(jobs), timeout_s=240)
    return {r.metadata.get("label") or (r.trajectory.extra["verifiers"]["environment"] if r.ok else r.error): r
            for r in results}


def engine_events(job_id: str, since: int) -> list[str]:
    """What the container engine did with the job's container (its first attempt's) since then."""
    name = container_name(sandbox_id_for(job_id, 0))
    out = subprocess.run(["docker", "events", "--since", str(since), "--until", str(int(time.time()) + 1),
                          "--filter", f"container={name}", "--format", "{{.Status}}"],
                         capture_output=True, text=True, env=client_env(), timeout=60, check=True).stdout
    return out.split()


async def test_each_environment_scores_the_datasets_answer_one_and_the_ids_are_the_models_own(
        answering_settings, answering_server, allowed):
    settings = answering_settings
    since = int(time.time()) - 1
    results = await run_jobs(settings, answering_server,
                             [job(name) for name in ENVIRONMENTS] + [on_podman("vf-sandbox-secret")])
    assert sorted(results) == sorted([*ENVIRONMENTS, ON_PODMAN]), [r.error for r in results.values()]
    # On podman, the same episode: the set-up's and the model's commands ran in the job's container
    # (created, started, removed by the engine), the model saw the same prompt and wrote the same ids.
    podman, bwrap = results.pop(ON_PODMAN), results["vf-sandbox-secret"]
    assert podman.status == "completed" and podman.reward == 1.0, (podman.error, podman.trajectory.extra)
    assert podman.trajectory.extra["eval"]["metrics"]["secret_found"] == 1.0
    assert [(c.name, c.ok, c.arguments["command"]) for c in podman.trajectory.tool_calls] == \
        [(c.name, c.ok, c.arguments["command"]) for c in bwrap.trajectory.tool_calls]
    assert [(s.prompt_ids, s.response_ids) for s in podman.trajectory.segments] == \
        [(s.prompt_ids, s.response_ids) for s in bwrap.trajectory.segments]
    events = engine_events(podman.job_id, since)
    assert {"create", "start"} <= set(events) and events[-1] in ("remove", "destroy"), events
    backend = VLLMClient()
    try:
        for name, result in results.items():
            assert result.status == "completed" and result.reward == 1.0, (name, result.trajectory.extra)
            found = result.trajectory.extra["verifiers"]
            evaluation = result.trajectory.extra["eval"]
            # The rubric's own functions, each with its score and weight, in the eval info.
            assert evaluation["reward"] == 1.0 and evaluation["metrics"] and evaluation["weights"]
            main = {"vf-reverse-text": "lcs_reward_func", "vf-alphabet-sort": "weighted_reward",
                    "vf-tool-test": "tool_call_reward_func", "vf-sandbox-secret": "secret_found"}[name]
            assert evaluation["metrics"][main] == 1.0 and evaluation["weights"][main] == 1.0
            assert found["index"] == 0 and found["completion"]
            traj = result.trajectory
            calls = traj.extra["calls"]
            two_turns = name in ("vf-alphabet-sort", "vf-sandbox-secret")
            assert len(calls) == (2 if two_turns else 1)  # the environment's turns
            if name == "vf-sandbox-secret":  # set-up's command and the model's ran in the job's sandbox
                assert [(c.name, c.ok) for c in traj.tool_calls] == [("bash", True), ("bash", True)]
                assert traj.tool_calls[1].arguments["command"] == "cat secret.txt"
            for call in calls:
                seg = traj.segments[call["segment"]]
                sequence = seg.prompt_ids + seg.response_ids
                start = call["prompt_tokens"] - len(seg.prompt_ids)
                recorded = seg.response_ids[start:start + call["completion_tokens"]]
                assert recorded and seg.loss_mask[start:start + len(recorded)] == [1] * len(recorded)
                # Asked again greedily for as many tokens, the backend writes the same ids.
                again = await backend.generate(answering_server, sequence[:call["prompt_tokens"]], SamplingParams(
                    temperature=0.0, max_tokens=len(recorded), ignore_eos=True))
                assert again.token_ids == recorded
    finally:
        await backend.aclose()


async def test_a_model_answering_garbage_scores_zero_in_each_environment(
        random_settings, random_server, allowed):
    results = await run_jobs(random_settings, random_server, [job(name) for name in ENVIRONMENTS])
    assert sorted(results) == sorted(ENVIRONMENTS), [r.error for r in results.values()]
    for name, result in results.items():
        assert result.status == "completed" and result.reward == 0.0, (name, result.trajectory.extra)
        assert result.trajectory.extra["eval"]["reward"] == 0.0


async def test_an_environment_that_raises_fails_its_job_naming_the_error(
        random_settings, random_server, allowed):
    async with AsyncClient(settings=random_settings) as client:
        await add_backend(client.r, random_server, random_settings.namespace)
        with pytest.raises(InvalidJob, match="not allowed here"):
            await client.submit(job("vf-not-listed"))
        with pytest.raises(InvalidJob, match="never a path"):
            await client.submit(job("../vf_broken"))
        for fail in ("load", "rubric", "turn", "sampling"):
            await client.submit(job("vf-broken", args={"fail": fail}))
        await client.submit(job("vf-reverse-text", index=99))
        results = await client.collect(5, timeout_s=240)
    # The environment's own failures are the task's; a row the dataset lacks is the job's.
    assert all(r.status == "failed" and r.attempts == 1 for r in results), [(r.status, r.error) for r in results]
    assert sorted(r.failure for r in results) == ["job"] + ["task"] * 4, [(r.failure, r.error) for r in results]
    assert next(r for r in results if r.failure == "job").error.count("no row 99") == 1
    errors = sorted(r.error for r in results)
    assert any("failed to load" in e and "cannot find its dataset" in e for e in errors), errors
    assert any("rubric failed" in e and "exploding_reward" in e for e in errors), errors
    assert any("raised during its rollout" in e and "no follow-up for this row" in e for e in errors), errors
    assert any("has 3 rows, no row 99" in e for e in errors), errors
    # A reward function that would give 1 does not score a call the door refused.
    assert any("door refused its model call" in e and "logit_bias" in e for e in errors), errors


async def test_a_run_worker_that_loaded_an_environment_still_stops_as_a_worker_on_sigterm(
        settings, worker_pool, random_model_dir, random_server, sandbox_root, allowed):
    # verifiers' Environment takes SIGTERM for its own teardown (then exit(143)) when it is made;
    # a run worker must keep its own graceful stop, which hands in-flight jobs back.
    import signal

    pool = start_pool(worker_pool, random_model_dir, sandbox_root)
    [result] = (await run_jobs(settings, random_server, [job("vf-reverse-text")])).values()
    assert result.status == "completed", result.error
    [run_worker] = [proc for stage, proc in pool.procs if stage == "run"]
    run_worker.send_signal(signal.SIGTERM)
    assert run_worker.wait(timeout=60) == 0, pool._log_tail(1, "run")


async def test_the_jobs_turn_budget_ends_a_multi_turn_environment_as_the_agents_end(
        answering_settings, answering_server, allowed):
    # alphabet-sort wants two turns; the job allows one: the door refuses the second call, the
    # environment's rollout ends on that error, its rubric scores the first turn alone.
    one_turn = {**job("vf-alphabet-sort"), "agent": {**AGENT, "max_turns": 1}}
    [result] = (await run_jobs(answering_settings, answering_server, [one_turn])).values()
    assert result.status == "completed" and result.failure == "agent", result.error
    assert result.trajectory.finish_reason == "max_turns" and len(result.trajectory.extra["calls"]) == 1
    found = result.trajectory.extra["verifiers"]
    assert found["error"] and result.reward == 0.5 == result.trajectory.extra["eval"]["reward"]
