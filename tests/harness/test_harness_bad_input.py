"""Issue 29's bad input not covered by test_sandbox_harness.py (hangs, floods, forks away, exits at
once), through the whole pipeline with real workers in bubblewrap, on the built-in server: a
harness that sends malformed, oversized or unknown-model requests to its door, a real CLI (Codex)
configured to ask for a model the door does not serve, one that leaves a
double-forked daemon calling the door after the job ended, and one whose job is cancelled while it
runs. Each ends with a clear result (the agent's failure, scored, never a restart, or 'cancelled'),
its sandbox torn down with nothing left (process, socket, mount, cgroup), and the job beside it
undisturbed. The presets are TOML files in a folder the workers are told of, as an operator's."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from rollstream.client import AsyncClient
from rollstream.llm.balancer import add_backend
from rollstream.tasks import arith

from .leftovers import alive, left_behind
from .node_clis import CODEX, lean_preset_text
from .sandbox_presets import _toml, installed_preset, write_presets

# Codex as the operator's variant of its shipped preset that asks for a model of its own choosing
# (its `-c model=...` over the preset's {model}): the door serves no such model.
UNSERVED = "gpt-5.5-codex"
CODEX_UNSERVED = dataclasses.replace(CODEX, lean_args=(*CODEX.lean_args, "-c", f'model="{UNSERVED}"'))

# Sends the door what a broken client would, each on its own connection through the relay, and
# prints one JSON line of what came back: then gives up (status 4), as a harness whose API
# calls fail does.
BAD_REQUESTS = r'''
import http.client, json, os, sys, urllib.parse
base = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
headers = {"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"}
good = {"messages": [{"role": "user", "content": sys.argv[1]}], "max_tokens": 4}
cases = {"not-json": b"{this is not json",
         "no-messages": json.dumps({"model": os.environ["OPENAI_MODEL"], "max_tokens": 4}).encode(),
         "oversized": b"{" + b" " * (33 * 2**20) + b"}",
         "unknown-model": json.dumps({**good, "model": "gpt-9-no-such-model"}).encode()}
seen = {}
for name, body in cases.items():
    connection = http.client.HTTPConnection(base.hostname, base.port, timeout=300)
    try:
        connection.putrequest("POST", base.path + "/chat/completions")
        for header, value in {**headers, "content-length": str(len(body))}.items():
            connection.putheader(header, value)
        connection.endheaders()
        try:
            connection.send(body)
        except OSError:  # the door may answer from the head alone and stop reading
            pass
        response = connection.getresponse()
        reply = json.loads(response.read() or b"{}")
        seen[name] = [response.status, reply.get("error", {}).get("message", ""), reply.get("model")]
    except OSError as exc:
        seen[name] = [None, repr(exc), None]
    finally:
        connection.close()
print("DOOR-SAID " + json.dumps(seen))
sys.exit(4)
'''

# One call through the relay as any client makes it, then a daemon (fork, setsid, fork: no parent,
# no session of the harness's) that keeps calling the door once the harness has exited, logging
# what it got; the harness answers and exits at once.
LATE_CALLER = r'''
import json, os, sys, time, urllib.error, urllib.request
def call(text):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "rollstream", "messages": [{"role": "user", "content": text}],
                         "max_tokens": 4}).encode(),
        headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status
call(sys.argv[1])
harness = os.getpid()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(0, 3)
        while os.path.exists(f"/proc/{harness}"):
            time.sleep(0.05)
        while True:  # marker: rs-late-caller-daemon
            try:
                call("after the end")
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
    os._exit(0)
print(5)
'''

PRESETS = {
    "bad-requests": _toml("bad-requests", ["python3", "{harness_dir}/bad.py", "{instruction}"],
                          {"{harness_dir}/bad.py": BAD_REQUESTS}),
    "late-caller": _toml("late-caller", ["python3", "{harness_dir}/late.py", "{instruction}", "rs-late-caller"],
                         {"{harness_dir}/late.py": LATE_CALLER}),
    # Runs until it is stopped (a marker in its command line shows whether it outlived its job).
    "waits": _toml("waits", ["sh", "-c", "exec sleep 1004"]),
}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def pool(worker_pool, arith_model_dir, sandbox_root, tmp_path):
    folder = write_presets(tmp_path / "presets")
    for name, text in PRESETS.items():
        (folder / f"{name}.toml").write_text(text)
    (folder / f"{CODEX_UNSERVED.lean}.toml").write_text(lean_preset_text(CODEX_UNSERVED))
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    pool.env["ROLLSTREAM_HARNESS_PRESET_DIRS"] = json.dumps([str(folder)])
    pool.env["ROLLSTREAM_SANDBOX_JOB_OVERRIDES"] = '["limits"]'  # room for Codex's Node.js
    pool.env["ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS"] = "1"
    pool.start_all(concurrency=4)
    return pool


async def _submit(client, harness: str, instance: dict | None = None, **agent) -> str:
    return await client.submit(arith.job(instance or {"a": 2, "op": "+", "b": 3},
                                         agent={**arith.SMALL_MODEL_AGENT, "harness": harness, **agent}))


async def _collect(client, job_ids: list[str]) -> dict:
    results = await client.collect(len(job_ids), timeout_s=420)
    return {r.job_id: r for r in results}


async def test_malformed_oversized_and_unknown_model_requests_and_a_cli_asking_for_an_unserved_model_end_clearly(
        settings, pool, arith_server, sandbox_root, wait_until):
    installed_preset("codex")
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        bad = await _submit(client, "bad-requests")
        good = await _submit(client, "door-client", {"a": 12, "op": "+", "b": 30})
        codex = await client.submit(arith.job({"a": 2, "op": "+", "b": 3}, sandbox={"limits": CODEX_UNSERVED.limits},
                                              agent={**arith.SMALL_MODEL_AGENT, "harness": CODEX_UNSERVED.lean}))
        results = await _collect(client, [bad, good, codex])
        states = [await client.status(job_id) for job_id in (bad, codex)]
    result = results[bad]
    assert result.status == "completed" and result.failure == "agent", result.error
    traj = result.trajectory
    assert traj.finish_reason == "harness_error" and "status 4" in traj.extra["finish_detail"]
    assert result.reward == 0.0 and result.attempts == 1
    said = json.loads(traj.extra["harness_run"]["output_tail"].split("DOOR-SAID ", 1)[1].splitlines()[0])
    # Each broken request is refused with a 4xx that says what is wrong; none reaches the model.
    assert said["not-json"][0] == 400 and "JSON" in said["not-json"][1], said
    assert said["no-messages"][0] == 400 and "messages" in said["no-messages"][1], said
    assert said["oversized"][0] == 413 and "limited to" in said["oversized"][1], said
    # A model the door does not serve: OpenAI's own 404, which names the model it does serve.
    assert said["unknown-model"][0] == 404 and "rollstream" in said["unknown-model"][1], said
    assert traj.extra["calls"] == [] and traj.extra["door"]["refused"] == traj.extra["door"]["requests"] >= 1
    # Codex takes the door's 404 (model_not_found) as final: it exits at its first call, and its
    # job ends as the agent's failure, scored, once: no retry, no restart.
    result = results[codex]
    assert result.status == "completed" and result.failure == "agent", (result.status, result.error)
    assert result.reward == 0.0 and result.attempts == 1
    traj = result.trajectory
    assert traj.finish_reason == "harness_error", traj.extra
    assert traj.extra["calls"] == [] and traj.extra["door"]["requests"] == traj.extra["door"]["refused"] >= 1
    assert UNSERVED in traj.extra["harness_run"]["output_tail"], traj.extra["harness_run"]["output_tail"][-2000:]
    # The job beside them, on the same workers at the same time, is undisturbed.
    assert results[good].status == "completed" and results[good].reward == 1.0, results[good].error
    for state in states:
        await wait_until(lambda sandbox=state.sandbox: _gone(sandbox_root, sandbox), 60,
                         "the failed jobs' sandboxes to be gone")


async def _gone(sandbox_root: str, sandbox_id: str) -> bool:
    return not left_behind(sandbox_root, sandbox_id)


async def test_a_daemon_calling_the_door_after_its_job_ended_is_refused_killed_and_records_nothing(
        settings, pool, arith_server, sandbox_root, wait_until):
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        job_id = await _submit(client, "late-caller")
        [result] = (await _collect(client, [job_id])).values()
        state = await client.status(job_id)
    assert result.status == "completed", result.error
    traj = result.trajectory
    assert traj.finish_reason == "stop" and traj.extra["answer"] == "5" and result.reward == 1.0
    assert result.attempts == 1
    # The harness's own call and whatever its daemon got in before the door closed are whole
    # records; the calls after the close were refused and left no record.
    door = traj.extra["door"]
    assert len(traj.extra["calls"]) == door["requests"] - door["refused"] >= 1, door
    await wait_until(lambda: _gone(sandbox_root, state.sandbox), 60, "the job's sandbox to be gone")
    assert alive("rs-late-caller") == []


async def test_a_cancelled_job_stops_its_preset_harness_closes_its_door_and_frees_its_sandbox(
        settings, pool, arith_server, sandbox_root, wait_until):
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        job_id = await _submit(client, "waits", max_wall_time_s=600)

        async def harness_running() -> bool:
            return bool(alive("sleep 1004"))

        await wait_until(harness_running, 240, "the harness to start in its sandbox")
        state = await client.status(job_id)
        door_socket = os.path.join(sandbox_root, state.sandbox, "door")
        await client.cancel(job_id=job_id)
        [result] = (await _collect(client, [job_id])).values()
    assert result.status == "cancelled", (result.status, result.error)
    assert result.attempts == 1

    async def stopped() -> bool:
        return not alive("sleep 1004")

    await wait_until(stopped, 60, "the cancelled job's harness to be killed")
    await wait_until(lambda: _gone(sandbox_root, state.sandbox), 60, "the cancelled job's sandbox to be gone")
    assert not os.path.exists(door_socket)
