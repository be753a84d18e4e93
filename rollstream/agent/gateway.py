"""The per-job door of the run stage: an agent harness of the job's own talks OpenAI Chat
Completions (agent/door_chat.py), OpenAI Responses (door_responses.py) or Anthropic Messages
(door_anthropic.py), streaming or not, to ``http://127.0.0.1:PORT/v1`` with the job's key (as
``Authorization: Bearer`` or ``x-api-key``); behind every API each call is rendered with the
model's chat template, sent token-in/token-out through the job's LLM session (the balancer's job
and group affinity kept), and recorded exactly (door_call.py, recorder.py). One small HTTP/1.1 server per run-worker
process serves every job's door; a key reaches only its own job, and nothing else (no backend, no
other job) is served. The server listens on loopback only: sandboxes, whose network is off, never reach it.
A harness that runs inside its sandbox reaches its door through a Unix socket of that job alone,
bound into that sandbox alone (``open_in_sandbox``; the relay inside is agent/door_relay.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from typing import Any

from rollstream.agent.door_anthropic import AnthropicApi
from rollstream.agent.door_call import JobDoor
from rollstream.agent.door_chat import ChatApi
from rollstream.agent.door_models import DoorRequest
from rollstream.agent.door_request import MODEL_NAME, CallOptions, DoorError, check_model
from rollstream.agent.door_responses import ResponsesApi
from rollstream.agent.door_stream import EventStream
from rollstream.episode_settings import AgentSettings

__all__ = ["MODEL_NAME", "Gateway", "JobDoor"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 32 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_REQUESTS_PER_DOOR = 16
DOOR_SOCKET_NAME = "door.sock"
# What the relay in the sandbox sends first on each connection to the job's socket: the key,
# which thus never enters the harness's environment, its requests or its trajectory.
SANDBOX_PREAMBLE = b"ROLLSTREAM-DOOR "
_CHAT, _ANTHROPIC = ChatApi(), AnthropicApi()
# The model-call endpoints, each API's own (agent/door_chat.py, door_responses.py, door_anthropic.py).
_APIS: dict[str, Any] = {"/v1/chat/completions": _CHAT, "/v1/responses": ResponsesApi(), "/v1/messages": _ANTHROPIC}
_SERVED = ("POST /v1/chat/completions, POST /v1/responses, POST /v1/messages (and /v1/messages/count_tokens), "
           "GET /v1/models (and /v1/models/NAME)")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
            431: "Request Header Fields Too Large", 502: "Bad Gateway", 503: "Service Unavailable"}


def _remove_socket(path: str) -> None:
    """Remove what is at ``path`` if it is a socket or a link (never a folder or a file)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(info.st_mode) or stat.S_ISLNK(info.st_mode):
        os.unlink(path)
    else:
        raise RuntimeError(f"{path} is in the way of the job's door socket and is not a socket; remove it")


def _response(status: int, payload: dict, close: bool = False) -> bytes:
    data = json.dumps(payload).encode()
    extra = "connection: close\r\n" if close else ""
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n{extra}\r\n").encode() + data


def _deadline(writer: asyncio.StreamWriter, timeout_s: float,
              answer: Callable[[], bytes] | None = None) -> asyncio.TimerHandle:
    """Close the connection in ``timeout_s`` (after sending what ``answer`` makes) unless cancelled
    first: the read it guards then ends at once (a timer, not a task per read as wait_for makes)."""

    def expire() -> None:
        if answer is not None:
            writer.write(answer())
        writer.close()

    return asyncio.get_running_loop().call_later(timeout_s, expire)


class _Connection:
    """One client connection: idle while it waits for a request's head (then it may be closed
    to make room for a new one), busy while a request is read or served."""

    __slots__ = ("bound", "idle", "since", "writer")

    def __init__(self, writer: asyncio.StreamWriter, bound: JobDoor | None = None) -> None:
        self.writer, self.idle, self.since = writer, True, time.monotonic()
        self.bound = bound  # the door of the job whose sandbox socket this came through


class Gateway:
    """The run worker's door server: ``open(job_id, session, ...)`` gives a job its key,
    ``close(door)`` takes it away. Start with ``await start()``; ``base_url`` is then set.

    Against a client that holds connections (the door's keys are secrets, its port is not):
    the key is checked from the request's head before any body is read; a head and a body
    must each arrive within ``read_timeout_s``; a connection waits at most ``keepalive_s``
    for its next request; at most ``max_connections`` are open (a new one closes the longest
    idle, or is answered 503 when all are busy), and one door serves at most
    ``max_requests_per_door`` requests at once."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_connections: int = 256,
                 read_timeout_s: float = 30.0, keepalive_s: float = 300.0,
                 max_requests_per_door: int = MAX_REQUESTS_PER_DOOR) -> None:
        self.host, self.port = host, port
        self.max_connections, self.read_timeout_s, self.keepalive_s = max_connections, read_timeout_s, keepalive_s
        self.max_requests_per_door = max_requests_per_door
        self.doors: dict[str, JobDoor] = {}
        self.connections: dict[_Connection, None] = {}  # open ones, oldest first
        self._server: asyncio.base_events.Server | None = None
        # key -> (server, socket path) of the doors opened into a sandbox
        self._sandbox_servers: dict[str, tuple[asyncio.base_events.Server, str]] = {}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> Gateway:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_HEAD_BYTES)
            self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        for server, path in self._sandbox_servers.values():
            server.close()
            _remove_socket(path)
        self._sandbox_servers.clear()
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.writer.close()
            await self._server.wait_closed()
            self._server = None

    def open(self, job_id: str, session: Any, tokenizer: Any, settings: AgentSettings) -> JobDoor:
        door = JobDoor(job_id, session, tokenizer, settings)
        self.doors[door.key] = door
        return door

    def close(self, door: JobDoor) -> None:
        """The door's key stops working at once, its sandbox socket is removed, and every
        connection that came through that socket is cut (a process left behind gets nothing)."""
        self.doors.pop(door.key, None)
        opened = self._sandbox_servers.pop(door.key, None)
        if opened is not None:
            server, path = opened
            server.close()
            _remove_socket(path)
        for conn in list(self.connections):
            if conn.bound is door:
                self.connections.pop(conn, None)
                conn.writer.transport.abort()

    async def open_in_sandbox(self, door: JobDoor, folder: str) -> str:
        """Serve ``door`` on a Unix socket in ``folder``, the job's sandbox's door folder (bound
        read-only into that sandbox alone, sandboxes/backends/base.py): the relay inside sends
        ``SANDBOX_PREAMBLE + key + "\\n"`` first; a connection without the key is cut. Returns the
        socket's host path. The socket is world-connectable because the sandbox runs under a uid
        of its own; the folder above it (the sandbox's, mode 0710) keeps other host users out."""
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise RuntimeError(f"{folder} is not a door folder of ours (a folder only this worker's uid writes); "
                               "the sandbox was made by an older rollstream: start the job again")
        path = os.path.join(folder, DOOR_SOCKET_NAME)
        _remove_socket(path)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve_sandbox(door, reader, writer)

        server = await asyncio.start_unix_server(serve, path, limit=MAX_HEAD_BYTES)
        os.chmod(path, 0o666)
        self._sandbox_servers[door.key] = (server, path)
        return path

    async def _serve_sandbox(self, door: JobDoor, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        deadline = _deadline(writer, self.read_timeout_s)
        try:
            line = await reader.readuntil(b"\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        finally:
            deadline.cancel()
        expected = SANDBOX_PREAMBLE + door.key.encode() + b"\n"
        if not secrets.compare_digest(line, expected) or self.doors.get(door.key) is not door:
            writer.write(_response(401, DoorError(401, "this socket serves one job's door, through its relay; the "
                                                  "key did not match or the job has ended", "invalid_api_key",
                                                  "authentication_error").body(), close=True))
            writer.close()
            return
        await self._serve(reader, writer, bound=door)

    # -- HTTP/1.1, the little that OpenAI clients use ------------------------------------
    def _admit(self, conn: _Connection) -> bool:
        """Room for ``conn``: past the cap, the longest-idle connection is closed for it."""
        if len(self.connections) >= self.max_connections:
            victim = min((c for c in self.connections if c.idle), key=lambda c: c.since, default=None)
            if victim is None:
                return False
            self.connections.pop(victim, None)
            victim.writer.transport.abort()
        self.connections[conn] = None
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     bound: JobDoor | None = None) -> None:
        conn = _Connection(writer, bound)
        try:
            if not self._admit(conn):
                await self._send(writer, 503, DoorError(503, "the door is serving its maximum of connections; "
                                                        "try again", "too_many_connections", "server_error").body(),
                                 close=True)
                return
            first = True
            while True:
                conn.idle, conn.since = True, time.monotonic()
                # A head that does not come in time: the connection is closed without a word.
                deadline = _deadline(writer, self.read_timeout_s if first else self.keepalive_s)
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    await self._send(writer, 431, DoorError(431, "the request head is too large",
                                                            "head_too_large").body(), close=True)
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                finally:
                    deadline.cancel()
                conn.idle, first = False, False
                if not await self._request(reader, writer, head, bound):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except Exception:
            log.exception("gateway connection failed")
        finally:
            self.connections.pop(conn, None)
            writer.close()

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                       bound: JobDoor | None = None) -> bool:
        """Serve the request of ``head``; False when the connection is to be closed."""
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            return False
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        # The key first, from the head alone: a caller without one never gets its body read.
        # Through a sandbox's socket the key came first on the connection (the harness's own
        # Authorization is a placeholder); the door must still be open.
        path = target.split("?", 1)[0].rstrip("/")
        api = _APIS.get(path, _ANTHROPIC if path.startswith("/v1/messages") else _CHAT)
        if bound is not None:
            door = bound if self.doors.get(bound.key) is bound else None
        else:
            auth = headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "").strip()
            door = self.doors.get(key) if key else None
        if door is None:
            await self._send(writer, 401, api.error(DoorError(
                401, "unknown or expired key: each job's door takes only its own key (OPENAI_API_KEY or "
                "ANTHROPIC_API_KEY, sent as 'Authorization: Bearer' or 'x-api-key')", "invalid_api_key",
                "authentication_error")), close=True)
            return False
        raw_length = headers.get("content-length", "0")
        if "transfer-encoding" in headers or not raw_length.isdigit():
            await self._send(writer, 411, DoorError(411, "send the body with a Content-Length",
                                                    "length_required").body(), close=True)
            return False
        length = int(raw_length)
        if length > MAX_REQUEST_BYTES:
            await self._send(writer, 413, DoorError(413, f"request bodies are limited to {MAX_REQUEST_BYTES} bytes",
                                                    "too_large").body(), close=True)
            return False
        if door.in_flight >= self.max_requests_per_door:
            await self._send(writer, 503, DoorError(503, f"this job's door is serving {door.in_flight} requests "
                                                    "already, its most at once", "too_many_requests",
                                                    "server_error").body(), close=True)
            return False
        door.in_flight += 1
        try:
            body = b""
            if length and headers.get("expect", "").lower() == "100-continue":  # curl, for bodies past 1 KiB
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if length:
                def late() -> bytes:  # made only when the body is late, not for every request
                    return _response(408, DoorError(408, f"the body did not arrive within {self.read_timeout_s:g} s",
                                                    "request_timeout").body(), close=True)

                deadline = _deadline(writer, self.read_timeout_s, late)
                try:
                    body = await reader.readexactly(length)
                finally:
                    deadline.cancel()
            await self._handle(writer, method, path, door, body)
        finally:
            door.in_flight -= 1
        return headers.get("connection", "").lower() != "close"

    async def _handle(self, writer, method: str, path: str, door: JobDoor, body: bytes) -> None:
        if path == "/v1/models" or path.startswith("/v1/models/"):
            await self._models(writer, method, path, door)
            return
        count_only = path == "/v1/messages/count_tokens"
        api = _ANTHROPIC if count_only else _APIS.get(path)
        if api is None:
            await self._send(writer, 404, DoorError(404, f"{path} is not served here; this door serves {_SERVED}",
                                                   "not_found").body())
            return
        if method != "POST":
            await self._send(writer, 405, api.error(DoorError(405, "use POST", "method_not_allowed")))
            return
        try:
            try:
                request = json.loads(body)
            except ValueError as exc:
                raise DoorError(400, f"the body is not JSON: {exc}", "invalid_json") from None
            if not isinstance(request, dict):
                raise DoorError(400, "the body is not a JSON object", "invalid_json")
            check_model(request, door.models)
            typed, options = api.parse(request, count_only=True) if count_only else api.parse(request)
            if count_only:
                await self._send(writer, 200, {"input_tokens": await door.count_tokens(options)})
                return
        except DoorError as exc:
            door.requests += not count_only
            door.refused += not count_only
            await self._send(writer, exc.status, api.error(exc))
            return
        try:
            await self._answer(writer, api, door, typed, options)
        finally:
            await door.settle()  # the call's backend slot, given back once its answer is on its way

    async def _models(self, writer, method: str, path: str, door: JobDoor) -> None:
        """The served models, in a form both OpenAI's and Anthropic's clients read (list and
        retrieve); another name is a 404 in each API's words."""
        if method != "GET":
            await self._send(writer, 405, DoorError(405, "use GET", "method_not_allowed").body())
            return

        def entry(name: str) -> dict:
            return {"id": name, "object": "model", "created": 0, "owned_by": "rollstream", "type": "model",
                    "display_name": name, "created_at": "1970-01-01T00:00:00Z"}

        if path == "/v1/models":
            await self._send(writer, 200, {"object": "list", "data": [entry(name) for name in door.models],
                                           "has_more": False, "first_id": door.models[0], "last_id": door.models[-1]})
            return
        name = path.removeprefix("/v1/models/")
        try:
            check_model({"model": name}, door.models)
        except DoorError as exc:
            # In both APIs' words: OpenAI's error object (code model_not_found), Anthropic's type.
            await self._send(writer, exc.status, {"type": "error", "error": {
                **exc.body()["error"], **_ANTHROPIC.error(exc)["error"]}})
            return
        await self._send(writer, 200, entry(name))

    async def _answer(self, writer, api: Any, door: JobDoor, request: DoorRequest, options: CallOptions) -> None:
        if not options.stream:
            try:
                done = await door.call(options)
            except DoorError as exc:
                await self._send(writer, exc.status, api.error(exc))
                return
            await self._send(writer, 200, api.body(done, request, options, door.tokenizer))
            return
        stream = EventStream(writer)
        emitter = api.emitter(request, options, door.tokenizer)
        try:
            await door.call(options, emitter, stream.send)
        except DoorError as exc:
            if not stream.started:  # refused before anything was sent: an HTTP error as any other
                await self._send(writer, exc.status, api.error(exc))
                return
            await stream.send(emitter.error(exc.status, str(exc), exc.code))
        await stream.end()

    @staticmethod
    async def _send(writer, status: int, payload: dict, close: bool = False) -> None:
        writer.write(_response(status, payload, close))
        await writer.drain()
