"""One OpenEnv session, driven from the run worker: the environment's server (uvicorn on a Unix
socket in the sandbox's /tmp, the sandbox has no network) is started inside the job's sandbox,
its ``/health`` and ``/schema`` read over HTTP, and one WebSocket session on ``/ws`` (reset,
step, state, close: OpenEnv's own protocol) plays the episode. The agent sees the session as a
ToolBox whose one tool is the environment's action, its JSON schema as the tool's parameters;
each observation (its reward and done included) is the tool's answer.

The server's socket is reached as sandbox_server.py reaches it (never through a link the sandbox
planted). A server that dies or answers garbage is the environment's fault (failure 'task'),
said with its log."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, unix_connect
from websockets.exceptions import WebSocketException

from rollstream.agent.tools import ToolOutput
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.runtime_image import OPENENV
from rollstream.tasks.sandbox_server import EnvironmentBroken, SandboxServer

log = logging.getLogger(__name__)

SERVER_FOLDER = "rs-openenv"  # /tmp/rs-openenv in the sandbox
STEP_TOOL = "step"
MAX_MESSAGE_BYTES = 16 << 20


@dataclass
class Session:
    """A started server and its WebSocket session; ``rewards`` and ``done`` follow the episode."""

    sandbox: SandboxClient
    environment: str
    action_schema: dict = field(default_factory=dict)
    rewards: list[float | None] = field(default_factory=list)
    done: bool = False
    last_observation: dict = field(default_factory=dict)
    broken: EnvironmentBroken | None = None  # set when the server failed under a step
    _server: SandboxServer | None = None
    _ws: ClientConnection | None = None

    async def start(self, env_dir: str, app: str, ready_timeout_s: float, reset: dict | None = None) -> dict:
        """Start the server, wait for /health, read /schema, open the session and reset it;
        returns the first observation."""
        what = f"OpenEnv environment {self.environment!r}"
        self._server = server = SandboxServer(self.sandbox, SERVER_FOLDER, what)
        await server.start(env_dir, [OPENENV.python, "-m", "uvicorn", app, "--uds", server.inner_socket,
                                     "--log-level", "warning"], env={"PYTHONPATH": env_dir})
        schema: dict = {}

        async def ready(path: str) -> bool:
            try:
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), timeout=10) as http:
                    if (await http.get("http://openenv/health")).status_code != 200:
                        return False
                    schema.update((await http.get("http://openenv/schema")).json())
                    return True
            except (httpx.HTTPError, ValueError):
                return False

        path = await server.wait_ready(ready, ready_timeout_s)
        action = schema.get("action") if isinstance(schema, dict) else None
        if not isinstance(action, dict):
            raise EnvironmentBroken(f"OpenEnv environment {self.environment!r}: /schema gave no action schema")
        self.action_schema = action_parameters(action)
        self._ws = await unix_connect(path, "ws://openenv/ws", max_size=MAX_MESSAGE_BYTES, open_timeout=30)
        return await self._exchange({"type": "reset", "data": reset or {}})

    async def step(self, action: dict) -> dict:
        observation = await self._exchange({"type": "step", "data": action})
        self.rewards.append(observation.get("reward"))
        self.done = bool(observation.get("done"))
        return observation

    async def _exchange(self, message: dict) -> dict:
        """Send one message, return the observation answered; an error the environment reports
        about the action comes back as ``{"error": ...}`` for the agent to see."""
        if self._ws is None:
            raise EnvironmentBroken(f"OpenEnv environment {self.environment!r}: no session is open")
        try:
            await self._ws.send(json.dumps(message))
            raw = await self._ws.recv()
        except (WebSocketException, OSError) as error:
            raise EnvironmentBroken(f"OpenEnv environment {self.environment!r}: its server closed the session "
                                    f"during {message['type']} ({type(error).__name__}: {error}); its log: "
                                    f"{await self.log_tail()}") from None
        try:
            answer = json.loads(raw)
            kind, data = answer["type"], answer["data"]
        except (ValueError, KeyError, TypeError):
            raise EnvironmentBroken(f"OpenEnv environment {self.environment!r} answered {message['type']} with "
                                    f"something not OpenEnv's: {str(raw)[:300]!r}") from None
        if kind == "error":
            return {"error": data.get("message", data) if isinstance(data, dict) else data}
        if kind != "observation" or not isinstance(data, dict):
            raise EnvironmentBroken(f"OpenEnv environment {self.environment!r} answered {message['type']} with a "
                                    f"{kind!r} message")
        self.last_observation = data
        return data

    async def log_tail(self) -> str:
        return await self._server.log_tail() if self._server is not None else "(no server started)"

    async def close(self) -> None:
        """Close the session and stop the server (the sandbox goes with the job anyway)."""
        if self._ws is not None:
            try:
                await self._ws.send(json.dumps({"type": "close"}))
                await self._ws.close()
            except (WebSocketException, OSError):
                pass
            self._ws = None
        if self._server is not None:
            await self._server.stop()

def action_parameters(action_schema: dict) -> dict:
    """The action's JSON schema as tool parameters: its fields, less OpenEnv's ``metadata``."""
    properties = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    parameters: dict[str, Any] = {"type": "object", "properties": properties,
                                  "required": [r for r in action_schema.get("required", []) if r != "metadata"]}
    if "$defs" in action_schema:
        parameters["$defs"] = action_schema["$defs"]
    return parameters


def render(observation: dict) -> str:
    """What the agent reads back from a step: the observation's fields, its reward and done."""
    if "error" in observation:
        return f"Error: the environment refused the action: {observation['error']}"
    shown = {"observation": observation.get("observation"), "reward": observation.get("reward"),
             "done": bool(observation.get("done"))}
    return json.dumps(shown, ensure_ascii=False)


class SessionTools:
    """The ToolBox the agent loop drives: one tool, the environment's action."""

    def __init__(self, session: Session, description: str) -> None:
        self.session = session
        self.description = description

    def schemas(self) -> list[dict]:
        return [{"type": "function", "function": {"name": STEP_TOOL, "description": self.description,
                                                  "parameters": self.session.action_schema}}]

    async def call(self, name: str, arguments: dict) -> ToolOutput:
        if name != STEP_TOOL:
            return ToolOutput(text=f"Error: unknown tool {name!r}; available: {STEP_TOOL}", ok=False,
                              error="unknown tool")
        if self.session.done:
            return ToolOutput(text="Error: the environment's episode is over (done); submit to finish", ok=False,
                              error="episode over")
        try:
            observation = await self.session.step(arguments)
        except EnvironmentBroken as broken:
            # Not an observation for the agent: the loop stops (as for a lost sandbox) and the
            # task fails the job with the environment's own error.
            self.session.broken = broken
            return ToolOutput(text=str(broken), ok=False, error=str(broken), sandbox_lost=True)
        text = render(observation)
        return ToolOutput(text=text, ok="error" not in observation, error=observation.get("error"))
