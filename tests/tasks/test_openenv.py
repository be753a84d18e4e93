"""OpenEnv environments through the real pipeline (Redis streams, init/run/eval workers, bwrap
sandboxes or podman containers), their servers the real openenv-core inside the job's sandbox:
echo_env as the package's own ``openenv init`` makes it, and word_guess of tests/tasks/openenv_envs.
The agent is scripted (the reference actions, a wrong one, or none) and acts through the same
step tool the agent loop gets; the rewards come from the environments' observations. A broken
environment (a server that dies mid-episode, one that never starts) ends as failure 'task',
not retried, with the server's own words, and leaves no sandbox or process behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.agent.tools import ToolBox
from rollstream.client import AsyncClient
from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandboxes.backends.docker import DockerBackend, client_env
from rollstream.tasks.base import TaskContext
from rollstream.tasks.openenv_env import OpenEnvTask
from rollstream.tasks.openenv_session import STEP_TOOL
from rollstream.tasks.registry import register_task
from rollstream.tasks.runtime_image import OPENENV
from rollstream.tasks.sandbox_server import SOCKET_NAME
from rollstream.trajectory import Trajectory

from .conftest import needs_bwrap, workers

pytestmark = needs_bwrap
ENVS_DIR = Path(__file__).resolve().parent / "openenv_envs"
BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.skipif(
    not DockerBackend().available(), reason="no container engine (podman's socket: scripts/install-podman)"))]


@register_task
class ScriptedOpenEnvTask(OpenEnvTask):
    """The openenv task with the agent replaced by a script: the job's metadata lists the
    actions, each taken through the step tool as the agent loop would call it."""

    name = "openenv-scripted"

    async def act(self, env: Envelope, ctx: TaskContext, messages: list[dict], tools: ToolBox) -> Trajectory:
        assert [s["function"]["name"] for s in tools.schemas()] == [STEP_TOOL]
        observations = []
        for action in env.job.metadata.get("actions", []):
            output = await tools.call(STEP_TOOL, action)
            if output.sandbox_lost:  # what the loop does: end the episode, fail the job
                raise JobFailed(f"agent loop failed: {output.error}")
            observations.append(output.text)
        return Trajectory(num_turns=len(observations), extra={"observations": observations,
                                                               "first": messages[-1]["content"]})


@pytest.fixture(scope="session")
def openenv_envs(tmp_path_factory):
    """The environments' folder (echo_env generated there by the runtime's own `openenv init`),
    the runtime image built (scripts/test builds it first), and the operator's roots set."""
    tag = OPENENV.ensure(rootfs=True)
    folder = tmp_path_factory.mktemp("openenv")
    for name in ("word_guess", "crashes_mid_episode"):
        shutil.copytree(ENVS_DIR / name, folder / name)
    made = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--volume", f"{folder}:/out", tag,
         f"{OPENENV.prefix}/bin/openenv", "init", "echo_env", "--output-dir", "/out"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **client_env()}, check=False)
    assert made.returncode == 0, made.stdout + made.stderr
    assert (folder / "echo_env" / "server" / "app.py").is_file()
    before = os.environ.get("ROLLSTREAM_OPENENV_ROOTS")
    os.environ["ROLLSTREAM_OPENENV_ROOTS"] = json.dumps([str(folder)])
    yield folder
    if before is None:
        os.environ.pop("ROLLSTREAM_OPENENV_ROOTS", None)
    else:
        os.environ["ROLLSTREAM_OPENENV_ROOTS"] = before


def job(folder: Path, name: str, actions: list[dict], **instance) -> dict:
    return {"task": "openenv-scripted", "instance": {"path": str(folder), **instance},
            "metadata": {"actions": actions, "name": name}}


async def run_jobs(settings, jobs: list[dict]) -> dict:
    async with workers(settings), AsyncClient(settings=settings) as client:
        await client.submit_many(jobs)
        results = {r.metadata["name"]: r for r in await client.collect(len(jobs), timeout_s=400)}
    return results


def servers_left() -> list[str]:
    found = subprocess.run(["pgrep", "-af", f"/tmp/rs-openenv/{SOCKET_NAME}"], capture_output=True, text=True,
                           check=False)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def sandboxes_left(settings) -> list[str]:
    return [p.name for p in Path(settings.sandbox_root).rglob("plan.json")]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_reference_actions_score_one_and_no_action_or_a_wrong_one_zero(pipeline_settings, openenv_envs,
                                                                             backend):
    settings = pipeline_settings.model_copy(update={"sandbox_backend": backend})
    echo, words = openenv_envs / "echo_env", openenv_envs / "word_guess"
    jobs = [job(echo, "echo:reference", [{"message": "ten chars!"}]),  # the template's reward: 0.1 a character
            job(echo, "echo:none", []),
            job(words, "words:reference", [{"guess": "garden"}, {"guess": "rocket"}], reset={"seed": 1}),
            job(words, "words:wrong", [{"guess": "planet"}], reset={"seed": 1}),
            job(words, "words:none", [], reset={"seed": 1})]
    results = await run_jobs(settings, jobs)
    expected = {"echo:reference": 1.0, "echo:none": 0.0, "words:reference": 1.0, "words:wrong": 0.0,
                "words:none": 0.0}
    assert {name: (r.status, r.reward) for name, r in results.items()} == \
        {name: ("completed", reward) for name, reward in expected.items()}, {n: r.error for n, r in results.items()}
    solved = results["words:reference"].trajectory.extra
    assert solved["openenv"]["done"] and solved["openenv"]["rewards"] == [0.0, 1.0]
    assert json.loads(solved["observations"][0])["observation"]["feedback"] == "..Y.G."  # garden against rocket
    assert '"word_length": 6' in solved["first"]  # the reset's observation opens the episode
    assert "last reward of OpenEnv environment 'word_guess' after 2 step(s)" in solved["eval"]["reason"]
    assert json.loads(results["echo:reference"].trajectory.extra["observations"][0])["observation"][
        "echoed_message"] == "ten chars!"
    assert not sandboxes_left(settings) and not servers_left()


async def test_a_broken_environment_fails_its_job_as_the_tasks_fault_naming_the_servers_error(
        pipeline_settings, openenv_envs, tmp_path_factory):
    never_starts = openenv_envs / "never_starts"
    if not never_starts.exists():
        shutil.copytree(openenv_envs / "word_guess", never_starts)
        (never_starts / "server" / "app.py").write_text(
            "raise RuntimeError('this environment needs libsimulator, which is not installed')\n")
    crashes = openenv_envs / "crashes_mid_episode"
    jobs = [job(crashes, "crashes", [{"text": "one"}, {"text": "two"}, {"text": "three"}]),
            job(never_starts, "never-starts", [{"guess": "rocket"}]),
            job(crashes, "one-step-is-fine", [{"text": "one"}])]
    results = await run_jobs(pipeline_settings, jobs)
    crashed, silent = results["crashes"], results["never-starts"]
    assert crashed.status == "failed" and crashed.failure == "task" and crashed.attempts == 1, crashed
    assert "closed the session during step" in crashed.error
    assert "the simulator's native extension crashed (step 2)" in crashed.error  # the server's own words
    assert silent.status == "failed" and silent.failure == "task" and silent.attempts == 1, silent
    assert "libsimulator" in silent.error
    assert results["one-step-is-fine"].status == "completed" and results["one-step-is-fine"].reward == 0.0
    assert not sandboxes_left(pipeline_settings) and not servers_left()


def test_instances_are_checked_at_submit(openenv_envs, tmp_path):
    task = OpenEnvTask()
    task.validate({"path": str(openenv_envs / "word_guess"), "reset": {"seed": 3}, "reward": "sum"})
    with pytest.raises(InvalidJob, match="not beneath a folder the operator allows.*openenv_roots"):
        task.validate({"path": str(tmp_path)})
    with pytest.raises(InvalidJob, match="has no server/main.py"):
        task.validate({"path": str(openenv_envs / "word_guess"), "app": "server.main:app"})
    with pytest.raises(InvalidJob, match="module:attribute"):
        task.validate({"path": str(openenv_envs / "word_guess"), "app": "server/app.py"})
    with pytest.raises(InvalidJob, match="reward must be one of"):
        task.validate({"path": str(openenv_envs / "word_guess"), "reward": "max"})


def _submit(cli_env, spec: str):
    env = {**os.environ, **cli_env, "ROLLSTREAM_OPENENV_ROOTS": json.dumps([str(ENVS_DIR)])}
    return subprocess.run([sys.executable, "-m", "rollstream", "submit", spec], env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def test_submit_takes_an_environment_folder_once_or_once_per_reset_seed(cli_env, tmp_path):
    one = _submit(cli_env, f"openenv:{ENVS_DIR / 'word_guess'}")
    assert one.returncode == 0 and "submitted 1 jobs" in one.stderr, one.stderr
    seeded = _submit(cli_env, f'openenv:{ENVS_DIR / "word_guess"}:{{"seeds": [0, 1, 2], "reward": "sum"}}')
    assert seeded.returncode == 0 and "submitted 3 jobs" in seeded.stderr, seeded.stderr
    for spec, says in [(f"openenv:{tmp_path}", "not beneath a folder the operator allows"),
                       (f"openenv:{ENVS_DIR / 'word_guess'}:[1]", "must be a JSON object"),
                       (f'openenv:{ENVS_DIR / "word_guess"}:{{"seeds": []}}', "seeds must be a non-empty list")]:
        refused = _submit(cli_env, spec)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr and says in refused.stderr, \
            refused.stderr


async def test_rollstreams_own_loop_drives_the_environment_with_a_real_model(settings, worker_pool, sandbox_root,
                                                                             openenv_envs):
    """The unscripted path: worker processes, the built-in server and the agent loop with the
    environment's step tool; an untrained model guesses nothing right, so the episode scores 0."""
    import model_cache

    from rollstream.llm.balancer import add_backend
    from rollstream.llm.server import served_model

    model = model_cache.load("tiny_model_dir")
    worker_pool(model_dir=model, sandbox_root=sandbox_root).start_all(concurrency=2)
    with served_model(model, device="cpu") as server:
        async with AsyncClient(settings=settings) as client:
            await add_backend(client.r, server, settings.namespace)
            await client.submit({"task": "openenv", "instance": {"path": str(openenv_envs / "word_guess"),
                                                                 "reset": {"seed": 1}},
                                 "sampling": {"temperature": 0.0},
                                 "agent": {"max_turns": 2, "max_tokens_per_turn": 32, "max_context_tokens": 4096}})
            [result] = await client.collect(1, timeout_s=300)
    assert result.status == "completed" and result.reward == 0.0, result.error
    traj = result.trajectory
    assert traj.num_turns >= 1 and len(traj.logprobs) == len(traj.response_ids) == len(traj.loss_mask)
    assert traj.messages[0].content.startswith("You act in the OpenEnv environment word_guess through the step tool")
    assert '"word_length": 6' in traj.messages[1].content  # the reset's observation opens the episode
    assert traj.extra["openenv"]["environment"] == "word_guess"
    assert not servers_left()
