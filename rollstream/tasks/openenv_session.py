"""One OpenEnv session, driven from the run worker: the environment's server (uvicorn on a Unix
socket in the sandbox's /tmp, the sandbox has no network) is started inside the job's sandbox,
its ``/health`` and ``/schema`` read over HTTP, and one WebSocket session on ``/ws`` (reset,
step, state, close: OpenEnv's own protocol) plays the episode. The agent sees the session as a
ToolBox whose one tool is the environment's action, its JSON schema as the tool's parameters;
each observation (its reward and done included) is the tool's answer.

The socket lives where the sandbox can write, so the worker never follows a path to it: the
folder and the socket are opened without following symlinks and connected through
``/proc/self/fd``, so a link planted there cannot point the worker at a host socket. A server
that dies or answers garbage is the environment's fault (failure 'task'), said with its log."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import stat
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, unix_connect
from websockets.exceptions import WebSocketException

from rollstream.agent.tools import ToolOutput
from rollstream.errors import JobFailed
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.errors import SandboxError
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.openenv_runtime import PYTHON

log = logging.getLogger(__name__)

SERVER_DIR = "/tmp/rs-openenv"  # inside the sandbox; the sandbox's /tmp is a host folder
SOCKET_NAME = "server.sock"
LOG_NAME = "server.log"
STEP_TOOL = "step"
MAX_MESSAGE_BYTES = 16 << 20
LOG_TAIL_BYTES = 3000


class EnvironmentBroken(JobFailed):
    """The environment's server failed (did not start, died, answered what OpenEnv never sends)."""

    def __init__(self, message: str):
        super().__init__(message, retryable=False, failure="task")


def start_command(env_dir: str, app: str) -> str:
    """The bash command that starts the server in the background (its CMD, on a socket)."""
    q = shlex.quote
    return (f"mkdir -p {SERVER_DIR} && cd {q(env_dir)} && (PYTHONPATH={q(env_dir)} setsid {PYTHON} -m uvicorn "
            f"{q(app)} --uds {SERVER_DIR}/{SOCKET_NAME} --log-level warning > {SERVER_DIR}/{LOG_NAME} 2>&1 "
            "< /dev/null &)")


class _SocketPath:
    """The server's socket as a path that names the very inode found, never a link."""

    def __init__(self, sandbox_socket_path: str) -> None:
        self.tmp = SandboxLayout(os.path.dirname(sandbox_socket_path)).tmp
        self.fd: int | None = None

    def open(self) -> str | None:
        """``/proc/self/fd/N`` of the socket once it exists; None while it does not."""
        if self.fd is not None:
            return f"/proc/self/fd/{self.fd}"
        flags = os.O_PATH | os.O_NOFOLLOW
        try:
            folder = os.open(os.path.join(self.tmp, os.path.basename(SERVER_DIR)), flags | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        try:
            fd = os.open(SOCKET_NAME, flags, dir_fd=folder)
        except FileNotFoundError:
            return None
        finally:
            os.close(folder)
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.close(fd)
            raise EnvironmentBroken(f"the OpenEnv server's socket {SERVER_DIR}/{SOCKET_NAME} is not a socket")
        self.fd = fd
        return f"/proc/self/fd/{fd}"

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
    _socket: _SocketPath | None = None
    _ws: ClientConnection | None = None

    async def start(self, env_dir: str, app: str, ready_timeout_s: float, reset: dict | None = None) -> dict:
        """Start the server, wait for /health, read /schema, open the session and reset it;
        returns the first observation."""
        self._socket = _SocketPath(self.sandbox.socket_path)
        await self.sandbox.bash(start_command(env_dir, app), timeout_s=60, session="rs-openenv")
        deadline = time.monotonic() + ready_timeout_s
        while True:
            path = self._socket.open()
            if path is not None:
                try:
                    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), timeout=10) as http:
                        health = await http.get("http://openenv/health")
                        if health.status_code == 200:
                            schema = (await http.get("http://openenv/schema")).json()
                            break
                except (httpx.HTTPError, ValueError):
                    pass
            if time.monotonic() > deadline:
                raise EnvironmentBroken(f"OpenEnv environment {self.environment!r}: its server did not answer "
                                        f"/health within {ready_timeout_s:.0f} s; its log: {await self.log_tail()}")
            await asyncio.sleep(0.2)
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
        try:
            text = (await self.sandbox.read_file(f"{SERVER_DIR}/{LOG_NAME}")).decode("utf-8", "replace")
        except (SandboxError, OSError) as error:  # the log is for the message; its absence is said, not raised
            return f"(no log: {error})"
        return text[-LOG_TAIL_BYTES:].strip() or "(empty)"

    async def close(self) -> None:
        """Close the session and stop the server (the sandbox goes with the job anyway)."""
        if self._ws is not None:
            try:
                await self._ws.send(json.dumps({"type": "close"}))
                await self._ws.close()
            except (WebSocketException, OSError):
                pass
            self._ws = None
        if self._socket is not None:
            self._socket.close()
        try:
            await self.sandbox.bash(f"pkill -f -- '--uds {SERVER_DIR}/{SOCKET_NAME}' || true", timeout_s=30,
                                    session="rs-openenv")
        except (SandboxError, OSError):  # the sandbox may be gone already: teardown frees it regardless
            log.debug("stopping the OpenEnv server failed", exc_info=True)


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
