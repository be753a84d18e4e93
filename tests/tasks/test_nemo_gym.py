"""A NeMo Gym resources server through the real pipeline (Redis streams, init/run/eval workers, bwrap
sandboxes or podman containers): example_session_state_mgmt, unmodified from the pinned nemo-gym
package, served inside the job's sandbox, its dataset rows read at run time from the same
installed package. The agent is scripted (the row's reference calls, wrong ones, or none) and
calls the row's tools as the agent loop would; /seed_session seeds the session and /verify gives
the reward. A server that cannot start fails its job as the task's fault, leaving nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.agent.tools import ToolBox
from rollstream.client import AsyncClient
from rollstream.errors import JobFailed
from rollstream.messages import Envelope
from rollstream.sandboxes.backends.docker import DockerBackend, client_env
from rollstream.tasks.base import TaskContext
from rollstream.tasks.nemo_gym_env import NemoGymTask, prompt_messages
from rollstream.tasks.registry import register_task
from rollstream.tasks.runtime_image import NEMO_GYM
from rollstream.trajectory import Message, Trajectory

from .conftest import needs_bwrap, workers

pytestmark = needs_bwrap
SERVER = "example_session_state_mgmt"
BACKENDS = ["bwrap", pytest.param("docker", marks=pytest.mark.skipif(
    not DockerBackend().available(), reason="no container engine (podman's socket: scripts/install-podman)"))]
# The first row: "add 1 then add 2 then get the count", seeded with 3, verified against 6.
REFERENCE = [["increment_counter", {"count": 1}], ["increment_counter", {"count": 2}], ["get_counter_value", {}]]


@register_task
class ScriptedNemoGymTask(NemoGymTask):
    """The nemo-gym task with the agent replaced by a script of (tool, arguments) calls from the
    job's metadata, made through the same ToolBox the agent loop gets."""

    name = "nemo-gym-scripted"

    async def act(self, env: Envelope, ctx: TaskContext, messages: list[dict], tools: ToolBox) -> Trajectory:
        traj = Trajectory(messages=[Message(role=m["role"], content=m["content"]) for m in messages])
        for number, (name, arguments) in enumerate(env.job.metadata.get("calls", [])):
            output = await tools.call(name, arguments)
            if output.sandbox_lost:
                raise JobFailed(f"agent loop failed: {output.error}")
            traj.messages += [Message(role="assistant", content="", tool_calls=[
                {"id": f"c{number}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}]),
                Message(role="tool", name=name, content=output.text)]
        traj.num_turns = len(env.job.metadata.get("calls", []))
        return traj


@pytest.fixture(scope="session")
def dataset_rows() -> list[dict]:
    """The server's example dataset, as the installed package holds it (runtime image built first)."""
    tag = NEMO_GYM.ensure(rootfs=True)
    read = ("import json, pathlib, resources_servers; print(json.dumps([json.loads(line) for line in "
            f"(pathlib.Path(list(resources_servers.__path__)[0]) / '{SERVER}' / 'data' / 'example.jsonl')"
            ".read_text().splitlines() if line.strip()]))")
    found = subprocess.run(["docker", "run", "--rm", "--network", "none", tag, NEMO_GYM.python, "-c", read],
                           capture_output=True, text=True, timeout=600, env={**os.environ, **client_env()},
                           check=False)
    assert found.returncode == 0, found.stderr
    return json.loads(found.stdout)


def job(row: dict, name: str, calls: list, server: str = SERVER) -> dict:
    return {"task": "nemo-gym-scripted", "instance": {"server": server, "row": row},
            "metadata": {"calls": calls, "name": name}}


def leftovers(settings) -> list[str]:
    found = subprocess.run(["pgrep", "-af", "/tmp/rs-nemo-gym/"], capture_output=True, text=True, check=False)
    return [p.name for p in Path(settings.sandbox_root).rglob("plan.json")] + \
        [line for line in found.stdout.splitlines() if "pgrep" not in line]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_reference_calls_score_one_and_none_or_wrong_ones_zero(pipeline_settings, dataset_rows, backend):
    settings = pipeline_settings.model_copy(update={"sandbox_backend": backend})
    row = dataset_rows[0]
    assert row["initial_count"] == 3 and row["expected_count"] == 6
    jobs = [job(row, "reference", REFERENCE), job(row, "none", []), job(row, "wrong", [["increment_counter",
                                                                                         {"count": 5}]])]
    if backend == "bwrap":  # a broken environment, once: a server the package does not have
        jobs.append(job(row, "no-server", REFERENCE, server="no_such_server"))
    async with workers(settings), AsyncClient(settings=settings) as client:
        await client.submit_many(jobs)
        results = {r.metadata["name"]: r for r in await client.collect(len(jobs), timeout_s=500)}
    scored = {name: (r.status, r.reward) for name, r in results.items() if name != "no-server"}
    assert scored == {"reference": ("completed", 1.0), "none": ("completed", 0.0), "wrong": ("completed", 0.0)}, \
        {n: r.error for n, r in results.items()}
    reference = results["reference"].trajectory.extra
    assert reference["nemo_gym"]["server"] == SERVER and reference["nemo_gym"]["reward"] == 1.0
    assert "/verify of resources server 'example_session_state_mgmt'" in reference["eval"]["reason"]
    last_tool = [m for m in results["reference"].trajectory.messages if m.role == "tool"][-1]
    assert json.loads(last_tool.content) == {"count": 6}  # the server's own answer, through its session
    if backend == "bwrap":
        broken = results["no-server"]
        assert broken.status == "failed" and broken.failure == "task" and broken.attempts == 1, broken
        assert "No module named 'resources_servers.no_such_server'" in broken.error, broken.error
    assert not leftovers(settings)


def test_the_rows_input_becomes_the_prompt_and_bad_instances_are_refused(dataset_rows):
    row = dataset_rows[1]
    assert prompt_messages(row) == [{"role": "user", "content": "add 4 then add 5 then get the count"}]
    task = NemoGymTask()
    task.validate({"server": SERVER, "row": row})
    for instance, says in [({"server": "../x", "row": row}, "server must name"),
                           ({"server": SERVER, "row": {"expected_count": 1}}, "row must be a line"),
                           ({"server": SERVER, "row": row, "extra": 1}, "unknown instance fields")]:
        with pytest.raises(Exception, match=says):
            task.validate(instance)


def test_submit_takes_a_servers_dataset_file_one_job_per_row(cli_env, dataset_rows, tmp_path):
    dataset = tmp_path / "example.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in dataset_rows))
    submitted = subprocess.run([sys.executable, "-m", "rollstream", "submit", f"nemo-gym:{SERVER}:{dataset}"],
                               env={**os.environ, **cli_env}, capture_output=True, text=True, timeout=180, check=False)
    assert submitted.returncode == 0 and f"submitted {len(dataset_rows)} jobs" in submitted.stderr, submitted.stderr
    refused = subprocess.run([sys.executable, "-m", "rollstream", "submit", f"nemo-gym:{SERVER}"],
                             env={**os.environ, **cli_env}, capture_output=True, text=True, timeout=180, check=False)
    assert refused.returncode == 2 and "nemo-gym:SERVER:PATH.jsonl" in refused.stderr, refused.stderr
