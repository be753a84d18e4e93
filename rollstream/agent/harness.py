"""Bring your own agent: a job whose ``agent.harness`` names a harness is run by that harness
instead of the built-in agent loop. The run stage opens the job's door (agent/gateway.py),
calls the harness with a ``HarnessContext`` (the door's URL and key, the task's prompt and
tool schemas, the job's sandbox), and builds the trajectory from the calls it recorded; the
task's eval scores ``extra["answer"]`` (the harness's return value) as for the built-in loop.

Harnesses are found by name: rollstream's own (``HARNESSES``), then presets (agent/presets.py: a
command run inside the job's sandbox, agent/sandbox_harness.py), then the ``rollstream.harnesses``
entry point group (a package the operator installed). A job never names code to import."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from rollstream.agent.door_service import open_harness_door, preset_dirs
from rollstream.agent.episode import truncate_middle
from rollstream.agent.gateway import MODEL_NAME
from rollstream.agent.presets import all_presets, find_preset
from rollstream.agent.sandbox_harness import run_sandbox_harness
from rollstream.agent.services import ProcessServices
from rollstream.episode_settings import AgentSettings
from rollstream.errors import InvalidJob, JobCancelled, JobFailed
from rollstream.messages import Envelope
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.trajectory import ToolCallRecord, Trajectory

ENTRY_POINT_GROUP = "rollstream.harnesses"
HARNESSES = {
    "openai-agents": "rollstream.agent.harnesses.openai_agents:run",
    "openai-chat": "rollstream.agent.harnesses.openai_chat:run",
}

Harness = Callable[["HarnessContext"], Any]


@dataclass
class HarnessContext:
    """What a harness gets: where its model is (``base_url``/``api_key``, also as ``env``
    for a subprocess), the task's prompt and tools, and the job's sandbox to run tools in."""

    job_id: str
    instance: dict
    messages: list[dict]
    tools: list[dict]
    base_url: str
    api_key: str
    settings: AgentSettings
    sandbox: SandboxClient | None = None  # connected by the run stage; None for tasks without one
    model: str = MODEL_NAME
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    # Set when the sandbox was lost under a tool call: harnesses often turn a tool's exception
    # into an observation, so the run stage checks this after the harness returns.
    sandbox_lost: str | None = None

    @property
    def env(self) -> dict[str, str]:
        """Environment for a harness started as a process (the OpenAI SDKs read these)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}

    @property
    def system_prompt(self) -> str:
        return "\n\n".join(m["content"] for m in self.messages if m["role"] == "system")

    @property
    def user_messages(self) -> list[dict]:
        return [m for m in self.messages if m["role"] != "system"]

    async def call_tool(self, name: str, arguments: dict | str) -> str:
        """Run one of the task's tools in the job's sandbox; the observation as text. A tool the
        task does not offer (not in ``tools``) never reaches the sandbox: an error observation."""
        if self.sandbox is None:
            raise RuntimeError("this task gives its harness no sandbox")
        offered = [schema.get("function", schema).get("name", "") for schema in self.tools]
        if name not in offered:
            self.tool_calls.append(ToolCallRecord(name=name, ok=False, error="unknown tool"))
            return f"Error: unknown tool {name!r}; available: {', '.join(offered) or 'none'}"
        started = time.monotonic()
        try:
            output = await asyncio.wait_for(self.sandbox.call_tool(name, arguments), self.settings.tool_timeout_s)
        except TimeoutError:
            self.tool_calls.append(ToolCallRecord(name=name, ok=False, error="timeout",
                                                  duration_ms=(time.monotonic() - started) * 1000))
            return f"Error: tool {name} timed out after {self.settings.tool_timeout_s:.0f}s"
        if output.sandbox_lost:  # the service's failure: the job is retried in a fresh sandbox
            self.sandbox_lost = f"the sandbox was lost during a {name} call: {output.error}"
            raise JobFailed(self.sandbox_lost)
        self.tool_calls.append(ToolCallRecord(name=name, arguments=arguments if isinstance(arguments, dict) else {},
                                              ok=output.ok, error=output.error,
                                              duration_ms=(time.monotonic() - started) * 1000))
        return truncate_middle(output.text, self.settings.max_observation_chars) or "(no output)"

    def call_tool_sync(self, name: str, arguments: dict | str) -> str:
        """``call_tool`` for a harness that runs in a thread (a plain, synchronous function)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(self.call_tool(name, arguments), self.loop).result()


def harness_names() -> list[str]:
    return sorted(set(HARNESSES) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(all_presets()))


@cache
def get_harness(name: str) -> Harness:
    target = HARNESSES.get(name)
    if target is None:
        found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}.get(name)
        if found is None:
            raise InvalidJob(f"unknown harness {name!r}; installed: {', '.join(harness_names())}. A package adds "
                             f"harnesses through the '{ENTRY_POINT_GROUP}' entry point group")
        return found.load()
    module, _, attr = target.partition(":")
    try:
        return getattr(import_module(module), attr)
    except ImportError as exc:
        raise InvalidJob(f"harness {name!r} needs a package that is not installed here ({exc}); "
                         "install rollstream[harness] on the run workers") from exc


async def run_harness(harness: str, messages: list[dict], tools: list[dict], env: Envelope,
                      services: ProcessServices, sandbox: SandboxClient | None) -> Trajectory:
    """The run stage of a harness job: ``sandbox`` is the job's, connected by the stage (None
    for a task without one); ``services`` the run worker's (its LLM service, door, link). A name
    that is no Python harness of ours but a preset's runs as a command in the sandbox."""
    if harness not in HARNESSES:
        preset = find_preset(harness, preset_dirs(services))
        if preset is not None:
            return await run_sandbox_harness(preset, messages, env, services, sandbox)
    fn = get_harness(harness)
    job = env.job
    opened = await open_harness_door(env, services)
    settings = opened.settings
    hctx = HarnessContext(job_id=job.job_id, instance=job.instance, messages=messages, tools=tools,
                          base_url=opened.gateway.base_url, api_key=opened.door.key, settings=settings,
                          sandbox=sandbox, loop=asyncio.get_running_loop())
    answer, finish, detail = None, "stop", None
    try:
        answer = await asyncio.wait_for(_call(fn, hctx), settings.max_wall_time_s)
    except TimeoutError:
        finish, detail = "timeout", f"the harness ran past max_wall_time_s={settings.max_wall_time_s:g}"
    except (JobFailed, JobCancelled):
        raise
    except Exception as exc:  # the harness gave up (often on the door's own limit, said below)
        finish, detail = "harness_error", f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        await opened.close()
    if hctx.sandbox_lost:
        raise JobFailed(hctx.sandbox_lost)
    if opened.door.ended is not None:  # the door's verdict says why the harness stopped
        finish, detail = opened.door.ended, opened.door.ended_detail
    if finish == "error":  # the backends failed it: the service's failure, retried
        raise JobFailed(f"harness {harness}: {detail}")
    traj = opened.trajectory(harness, finish, detail, answer)
    traj.tool_calls = hctx.tool_calls
    traj.timings_s["tools_s"] = round(sum(c.duration_ms for c in hctx.tool_calls) / 1000, 6)
    return traj


async def _call(fn: Harness, hctx: HarnessContext) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(hctx)
    result = await asyncio.to_thread(fn, hctx)
    return await result if isinstance(result, Awaitable) else result
