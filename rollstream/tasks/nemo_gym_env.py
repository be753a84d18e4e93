"""The ``nemo-gym`` task: a NeMo Gym resources server (NVIDIA's ``nemo-gym`` package, its
``resources_servers/NAME/app.py``) run unmodified inside the job's sandbox, from the runtime image
that holds the pinned package (runtime_image.py; Python 3.12+). Run starts the server on a Unix
socket (sandbox_server.py), seeds the episode's session with the dataset row (``/seed_session``),
gives the agent the row's tools, each call a POST to the server's route of that name in the same
session, and sends the finished episode, as a Responses API object, to ``/verify``: its reward is
the score.

Instance: ``{"server": "example_session_state_mgmt", "row": {...}}``: ``row`` is one line of the
server's dataset (``responses_create_params`` with the input and tools, plus the fields its
verify reads); optionally ``config`` (the server config's own fields)."""

from __future__ import annotations

import json
import re
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.results import ToolOutput
from rollstream.tasks import eval_report
from rollstream.tasks.base import TaskContext
from rollstream.tasks.runtime_image import NEMO_GYM
from rollstream.tasks.sandbox_server import EnvironmentBroken, SandboxServer
from rollstream.tasks.server_task import ServerTask
from rollstream.trajectory import Trajectory

if TYPE_CHECKING:  # the CLI imports this module (task_set): the run stage's clients load in rollout only
    import httpx


INSTANCE_FIELDS = ("server", "row", "config")
SERVER_NAME = re.compile(r"[a-z][a-z0-9_]{0,99}")
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
WORKDIR = "/workspace"
LAUNCHER = "serve_resources_server.py"
READY_TIMEOUT_S = 180.0  # importing nemo_gym (ray, mlflow) takes a while on a busy node
REQUEST_TIMEOUT_S = 300.0
SERVER_FOLDER = "rs-nemo-gym"


class NemoGymTask(ServerTask):
    instance_fields = INSTANCE_FIELDS
    runtime = NEMO_GYM
    tools_are = "the resources server's tools"
    name = "nemo-gym"

    # -- instance ----------------------------------------------------------------------
    def validate(self, instance: dict) -> None:
        self.check_fields(instance)
        if not isinstance(instance.get("server"), str) or not SERVER_NAME.fullmatch(instance["server"]):
            raise InvalidJob("nemo-gym: server must name a resources server of the nemo-gym package, such as "
                             f"'example_session_state_mgmt' (lower-case letters, digits, '_'), got "
                             f"{instance.get('server')!r}")
        row = instance.get("row")
        params = row.get("responses_create_params") if isinstance(row, dict) else None
        if not isinstance(params, dict) or "input" not in params:
            raise InvalidJob("nemo-gym: row must be a line of the server's dataset: an object with "
                             "responses_create_params (its input and tools) and the fields its verify reads")
        for tool in params.get("tools") or []:
            if not isinstance(tool, dict) or not TOOL_NAME.fullmatch(str(tool.get("name", ""))):
                raise InvalidJob(f"nemo-gym: each tool of the row needs a plain function name, got {tool!r}")
        if not isinstance(instance.get("config", {}), dict):
            raise InvalidJob("nemo-gym: config must be an object of the server config's fields")

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        launcher = (resources.files("rollstream") / "data" / "nemo_gym" / LAUNCHER).read_text()
        return SandboxSpec(image=NEMO_GYM.tag(), workdir=WORKDIR, files={f".rs/{LAUNCHER}": launcher},
                           env={"HOME": "/tmp"})

    # -- run ---------------------------------------------------------------------------
    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        import httpx

        instance = env.job.instance
        sandbox = self.run_sandbox(env, ctx)
        name, row = instance["server"], instance["row"]
        what = f"NeMo Gym resources server {name!r}"
        server = SandboxServer(sandbox, SERVER_FOLDER, what)
        await server.start("/tmp", [NEMO_GYM.python, f"{WORKDIR}/.rs/{LAUNCHER}", name, server.inner_socket,
                                    json.dumps(instance.get("config") or {})])
        session: ServerSession | None = None
        try:
            path = await server.wait_ready(_answers, READY_TIMEOUT_S)
            # One client, one cookie jar: the server's session (its SessionMiddleware cookie) is the episode's.
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://nemo-gym",
                                         timeout=REQUEST_TIMEOUT_S) as http:
                session = ServerSession(http, server, what)
                await session.post("seed_session", row)
                tools = ServerTools(session, row["responses_create_params"].get("tools") or [])
                traj = await self.act(env, ctx, prompt_messages(row), tools)
                if session.broken is not None:
                    raise session.broken
                verified = await session.post("verify", {**row, "response": responses_object(env, traj, row)})
        except JobFailed:
            if session is not None and session.broken is not None:  # the server failed under a tool call
                raise session.broken from None
            raise
        finally:
            await server.stop()
        reward = verified.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise EnvironmentBroken(f"{what}: /verify gave no numeric reward: {json.dumps(verified)[:500]}")
        traj.extra["nemo_gym"] = {"server": name, "reward": float(reward),
                                  "verify": {k: v for k, v in verified.items()
                                             if k not in ("responses_create_params", "response")}}
        return traj

    # -- eval --------------------------------------------------------------------------
    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        found = (env.trajectory.extra.get("nemo_gym") if env.trajectory is not None else None) or {}
        if "reward" not in found:
            return eval_report.record(env, 0.0, "the NeMo Gym session left no reward")
        return eval_report.record(env, float(found["reward"]), f"/verify of resources server {found['server']!r}",
                                  metrics=found.get("verify", {}))


async def _answers(path: str) -> bool:
    """Whether the server on ``path`` answers HTTP (any status: it has no health route)."""
    import httpx

    try:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), timeout=10) as http:
            await http.get("http://nemo-gym/")
            return True
    except httpx.HTTPError:
        return False


class ServerSession:
    """The episode's calls to the resources server, in its session."""

    def __init__(self, http: httpx.AsyncClient, server: SandboxServer, what: str) -> None:
        self.http, self.server, self.what = http, server, what
        self.broken: EnvironmentBroken | None = None

    async def post(self, route: str, body: dict) -> dict:
        """The route's JSON answer. A 4xx (arguments the route refuses) comes back as
        ``{"error": ...}``; a server that fails or dies is EnvironmentBroken."""
        import httpx

        try:
            response = await self.http.post(f"/{route}", json=body)
        except httpx.HTTPError as error:
            raise EnvironmentBroken(f"{self.what}: /{route} failed ({type(error).__name__}: {error}); its log: "
                                    f"{await self.server.log_tail()}") from None
        if 400 <= response.status_code < 500 and route not in ("seed_session", "verify"):
            return {"error": f"HTTP {response.status_code}: {response.text[:2000]}"}
        if response.status_code != 200:
            raise EnvironmentBroken(f"{self.what}: /{route} answered HTTP {response.status_code}: "
                                    f"{response.text[:1000]}; its log: {await self.server.log_tail()}")
        try:
            answer = response.json()
        except ValueError:
            raise EnvironmentBroken(f"{self.what}: /{route} answered what is not JSON: {response.text[:300]!r}") \
                from None
        return answer if isinstance(answer, dict) else {"result": answer}


class ServerTools:
    """The ToolBox the agent loop drives: the row's tools, each a route of the server."""

    def __init__(self, session: ServerSession, tools: list[dict]) -> None:
        self.session = session
        self._schemas = [{"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}} for tool in tools]
        self._names = {tool["name"] for tool in tools}

    def schemas(self) -> list[dict]:
        return list(self._schemas)

    async def call(self, name: str, arguments: dict) -> ToolOutput:
        if name not in self._names:
            return ToolOutput(text=f"Error: unknown tool {name!r}; available: {', '.join(sorted(self._names))}",
                              ok=False, error="unknown tool")
        try:
            answer = await self.session.post(name, arguments)
        except EnvironmentBroken as broken:  # the loop stops (as for a lost sandbox); the task fails the job
            self.session.broken = broken
            return ToolOutput(text=str(broken), ok=False, error=str(broken), sandbox_lost=True)
        if "error" in answer and len(answer) == 1:
            return ToolOutput(text=f"Error: {answer['error']}", ok=False, error=str(answer["error"]))
        return ToolOutput(text=json.dumps(answer, ensure_ascii=False))


def prompt_messages(row: dict) -> list[dict]:
    """The row's Responses API input as chat messages ('developer' is the system prompt)."""
    params = row["responses_create_params"]
    found = params["input"]
    if isinstance(found, str):
        found = [{"role": "user", "content": found}]
    messages = []
    if params.get("instructions"):
        messages.append({"role": "system", "content": str(params["instructions"])})
    for item in found:
        content = item.get("content")
        if isinstance(content, list):  # input_text parts
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        role = {"developer": "system"}.get(item.get("role", "user"), item.get("role", "user"))
        messages.append({"role": role, "content": content or ""})
    return messages


def responses_object(env: Envelope, traj: Trajectory, row: dict) -> dict:
    """The episode as the Responses API object /verify reads (``response``): the agent's tool
    calls, their outputs and its messages after the prompt, in order."""
    output: list[dict] = []
    calls: list[str] = []
    prompt_count = len(prompt_messages(row))
    for index, message in enumerate(traj.messages[prompt_count:]):
        if message.role == "assistant":
            for number, call in enumerate(message.tool_calls or []):
                function = call.get("function", call)
                call_id = f"call_{index}_{number}"
                calls.append(call_id)
                arguments = function.get("arguments", {})
                output.append({"type": "function_call", "call_id": call_id, "name": function.get("name", ""),
                               "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                               "id": f"fc_{call_id}", "status": "completed"})
            if message.content and not message.tool_calls:
                output.append({"type": "message", "id": f"msg_{index}", "role": "assistant", "status": "completed",
                               "content": [{"type": "output_text", "text": message.content, "annotations": []}]})
        elif message.role == "tool" and calls:
            output.append({"type": "function_call_output", "call_id": calls.pop(0), "output": message.content})
    params = row["responses_create_params"]
    return {"id": f"resp_{env.job.job_id}", "object": "response", "created_at": time.time(), "model": "rollstream",
            "output": output, "parallel_tool_calls": False, "tool_choice": "auto", "tools": params.get("tools") or []}


TASK_SET_PREFIX = "nemo-gym:"


def task_set(spec: str) -> list[dict] | None:
    """The jobs of ``nemo-gym:SERVER:DATASET.jsonl`` (a task-set name for ``rollstream submit``):
    one per line of the server's dataset file; None for any other spec."""
    if not spec.startswith(TASK_SET_PREFIX):
        return None
    server, _, path = spec[len(TASK_SET_PREFIX):].partition(":")
    if not path:
        raise InvalidJob(f"{spec}: name the server and its dataset file: nemo-gym:SERVER:PATH.jsonl")
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = [json.loads(line) for line in lines]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidJob(f"{spec}: cannot read the dataset {path} ({error})") from None
    task = NemoGymTask()
    jobs = []
    for row in rows:
        instance = {"server": server, "row": row}
        task.validate(instance)
        jobs.append({"task": NemoGymTask.name, "instance": instance, "metadata": {"nemo_gym_server": server}})
    return jobs
