"""The run stage of a job whose harness is a preset (agent/presets.py): a command started inside
the job's own sandbox, in the task's working directory, with the task's instruction. Its model
calls reach the job's door through a Unix socket bound into that sandbox alone and the relay
that starts it (agent/door_relay.py); the door holds the job's limits on calls and tokens, the
sandbox's bash machinery its uid, rlimits and cgroup, and this module its wall time. When it
ends (exits, times out) every process it left behind is killed, the door is closed, and the
sandbox's final state (the workdir: an SWE task's diff) stays for eval; the answer is what the
preset names (a file it writes, else its output's last line).

Whatever the harness does is the agent's conduct, scored: a hang is ``harness_timeout``, an exit
with a failure status (or at once) ``harness_error``, a spent budget the door's ``max_turns``.
Only the service's own failures (backends down, the sandbox lost) fail the job for a retry."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from rollstream.agent.door_service import open_harness_door
from rollstream.agent.gateway import DOOR_SOCKET_NAME, MODEL_NAME
from rollstream.agent.presets import Preset, driver_source
from rollstream.agent.services import ProcessServices
from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandboxes.backends.common import DOOR_DIR_INNER
from rollstream.sandboxes.errors import SandboxGone, ToolError
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.trajectory import Trajectory

log = logging.getLogger(__name__)

RELAY_SOURCE = Path(__file__).with_name("door_relay.py")
HARNESS_SESSION = "rollstream-harness"
REAP_SESSION = "rollstream-harness-reap"
# Not a secret: what the harness sends as its API key (the relay adds the job's own key).
PLACEHOLDER_KEY = "rollstream-door"
# The harness's private folder in its sandbox (one harness runs in a sandbox at a time). The same
# path in every run: CLIs put their folders' paths in the model's prompt (Codex names its skills
# folder), and a random name there would make every rollout of a group a different prompt (no
# shared prefix for the backend's cache) and put noise the policy learns from in every prompt.
HARNESS_DIR = "/tmp/.rollstream-harness"
MAX_ANSWER_BYTES = 1 << 20
OUTPUT_KEPT_CHARS = 4000
# Time for the run stage's own steps around the harness (writing its files, killing leftovers).
SETUP_TIMEOUT_S = 60.0


def instruction_of(messages: list[dict]) -> str:
    """What a CLI harness is asked: the task's user messages (it brings its own system prompt)."""
    return "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")


def _fill(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    return text


def _answer_from(data: bytes, json_key: str | None) -> object:
    if json_key is None:
        return data.decode("utf-8", "replace").strip()
    value: object = json.loads(data)
    for part in json_key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value.strip() if isinstance(value, str) else value


# Terminal escapes (colours, cursor moves) that CLIs print even without a terminal (OpenCode ends
# its output with a colour reset on a line of its own): no part of an answer.
_ANSI_ESCAPE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")


def _last_line(output: str) -> str | None:
    """The last line with text on it, terminal escapes removed."""
    lines = [line.strip() for line in _ANSI_ESCAPE.sub("", output).splitlines() if line.strip()]
    return lines[-1] if lines else None


async def run_sandbox_harness(preset: Preset, messages: list[dict], env: Envelope, services: ProcessServices,
                              sandbox: SandboxClient | None) -> Trajectory:

    if sandbox is None:
        raise InvalidJob(f"harness {preset.name!r} runs inside the task's sandbox, and this task has none; "
                         "use a Python harness (e.g. 'openai-chat') for it")
    opened = await open_harness_door(env, services)
    gateway, door, settings = opened.gateway, opened.door, opened.settings
    result = None
    values = launch_values(preset, instruction_of(messages))
    try:
        try:
            await gateway.open_in_sandbox(door, os.path.join(os.path.dirname(sandbox.socket_path), "door"))
        except FileNotFoundError:
            raise JobFailed("the job's sandbox has no door folder (made by an older rollstream, or gone); the job "
                            "is tried again in a new sandbox", retryable=True) from None
        # A run of an earlier delivery of this job (its run worker died) may still hold the session.
        await sandbox.close_session(HARNESS_SESSION)
        command = await stage_launch(sandbox, preset, door.key, values)
        # No output for a while is no sign of a hang (the model may be thinking): wall time alone.
        result = await sandbox.bash(command, timeout_s=settings.max_wall_time_s, no_output_timeout_s=0,
                                    session=HARNESS_SESSION)
    except (SandboxGone, ToolError) as exc:
        raise JobFailed(f"the sandbox failed under harness {preset.name}: {exc}") from exc
    finally:
        await opened.close()
        await _kill_leftovers(sandbox)
    if door.ended == "error":  # the backends failed it: the service's failure, retried
        raise JobFailed(f"harness {preset.name}: {door.ended_detail}")
    output = result.output
    finish, detail = "stop", None
    if result.timed_out:
        finish = "harness_timeout"
        detail = f"the harness ran past max_wall_time_s={settings.max_wall_time_s:g} and was killed"
    elif result.exit_code != 0:
        finish = "harness_error"
        detail = f"the harness exited with status {result.exit_code}"
    if door.ended is not None and finish != "harness_timeout":  # the door's verdict says why it stopped
        finish, detail = door.ended, door.ended_detail
    answer = await _answer(preset, sandbox, values, output)
    traj = opened.trajectory(preset.name, finish, detail, answer)
    traj.extra["harness_run"] = {"exit_code": result.exit_code, "timed_out": result.timed_out,
                                 "output_bytes": result.total_bytes, "output_tail": output[-OUTPUT_KEPT_CHARS:],
                                 "note": result.note}
    return traj


def launch_values(preset: Preset, instruction: str) -> dict[str, str]:
    """What a preset's ``{name}`` placeholders stand for in one run ({door_port}: the relay's own)."""
    harness_dir = HARNESS_DIR
    # {door_origin}: the door without /v1, for SDKs that add it themselves (Anthropic's).
    values = {"door_url": "http://127.0.0.1:{door_port}/v1", "door_origin": "http://127.0.0.1:{door_port}",
              "door_key": PLACEHOLDER_KEY, "model": MODEL_NAME,
              "harness_dir": harness_dir, "instruction": instruction}
    if preset.driver is not None:
        values["driver"] = f"{harness_dir}/{driver_source(preset.driver).name}"
    return values


async def stage_launch(sandbox: SandboxClient, preset: Preset, key: str, values: dict[str, str]) -> str:
    """Write what a run of ``preset`` needs into the sandbox (its files, the relay, its driver, the
    launch file with the door's ``key``); returns the command that starts it behind the relay."""
    harness_dir = values["harness_dir"]
    for extra in preset.files:
        await sandbox.write_file(_fill(extra.path, values), _fill(extra.content, values), mode=extra.mode)
    await sandbox.write_file(f"{harness_dir}/door_relay.py", RELAY_SOURCE.read_bytes(), mode=0o644)
    if preset.driver is not None:
        await sandbox.write_file(values["driver"], driver_source(preset.driver).read_bytes(), mode=0o644)
    launch = {"key": key, "socket": f"{DOOR_DIR_INNER}/{DOOR_SOCKET_NAME}",
              "argv": [_fill(a, values) for a in preset.argv],
              "env": {k: _fill(v, values) for k, v in preset.env.items()}}
    await sandbox.write_file(f"{harness_dir}/launch.json", json.dumps(launch), mode=0o600)
    return f"python3 -S {harness_dir}/door_relay.py {harness_dir}/launch.json"


async def _answer(preset: Preset, sandbox: SandboxClient, values: dict[str, str], output: str) -> object:
    if preset.answer_file is None:
        return _last_line(output)
    try:
        data = await sandbox.read_file(_fill(preset.answer_file, values), max_bytes=MAX_ANSWER_BYTES)
        return _answer_from(data, preset.answer_json_key)
    except ToolError:  # the harness left no answer (it failed before writing one)
        return None
    except ValueError:  # not JSON: the harness's answer file is its own to get right
        return None


# Backends whose sessions share one pid namespace, the container's, with an init of its own:
# there `kill -1` from inside reaches every process of the sandbox and nothing outside it. Under
# bwrap each session is its own pid namespace (killed with the session); under 'local' there is
# no namespace at all, and `kill -1` would reach the host's processes: never there.
SHARED_PID_NAMESPACE_BACKENDS = ("docker", "singularity")


def sandbox_backend(sandbox: SandboxClient) -> str | None:
    """The backend of ``sandbox``, from the plan its creator wrote beside its socket (this node's)."""
    try:
        with open(os.path.join(os.path.dirname(sandbox.socket_path), "plan.json")) as handle:
            return str(json.load(handle).get("backend"))
    except (OSError, ValueError) as exc:
        log.warning("cannot read the plan of the sandbox at %s: %s", sandbox.socket_path, exc)
        return None


async def _kill_leftovers(sandbox: SandboxClient) -> None:
    """Every process the harness started, wherever it went: its session is killed (under bwrap its
    own pid namespace with it); in a container, where sessions share one pid namespace, a fresh
    session kills every process but the container's first, and the shells that took with them
    are closed, so that the next tool call (eval's) starts a fresh one rather than a dying one."""
    try:
        await sandbox.close_session(HARNESS_SESSION)
        if sandbox_backend(sandbox) not in SHARED_PID_NAMESPACE_BACKENDS:
            return
        await sandbox.bash("exec kill -KILL -1", timeout_s=SETUP_TIMEOUT_S, session=REAP_SESSION)
        for name in (await sandbox.info())["sessions"]:
            await sandbox.close_session(name)
    except (SandboxGone, ToolError) as exc:
        log.warning("killing a harness's processes failed: %s", exc)
