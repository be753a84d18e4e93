"""The per-job OpenAI-compatible door of the run stage: an agent harness of the job's own talks
chat completions (tools, tool_calls, streaming) to ``http://127.0.0.1:PORT/v1`` with the job's
key; behind it each call is rendered with the model's chat template, sent token-in/token-out
through the job's LLM session (the balancer's job and group affinity kept), and recorded
exactly (agent/recorder.py). One small HTTP/1.1 server per run-worker process serves every
job's door; a key reaches only its own job, and nothing else (no backend, no other job) is
served. The server listens on loopback only: sandboxes, whose network is off, never reach it.
A harness that runs inside its sandbox reaches its door through a Unix socket of that job alone,
bound into that sandbox alone (``open_in_sandbox``; the relay inside is agent/door_relay.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import stat
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollstream.agent.door_request import CallOptions, DoorError, cut_at_stop, parse_request
from rollstream.agent.parsing import ToolCall, parse_tool_calls
from rollstream.agent.recorder import CallRecorder
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import BackendError, ContextLengthError
from rollstream.pipeline.balancer import NoBackendAvailable

log = logging.getLogger(__name__)

MODEL_NAME = "rollstream"
MAX_REQUEST_BYTES = 32 * 1024 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_REQUESTS_PER_DOOR = 16
DOOR_SOCKET_NAME = "door.sock"
# What the relay in the sandbox sends first on each connection to the job's socket: the key,
# which thus never enters the harness's environment, its requests or its trajectory.
SANDBOX_PREAMBLE = b"ROLLSTREAM-DOOR "
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
            431: "Request Header Fields Too Large", 502: "Bad Gateway", 503: "Service Unavailable"}


@dataclass
class JobDoor:
    """One job's door: its LLM session, limits and the recorder of its calls."""

    job_id: str
    session: Any  # agent.session.LLMSession
    tokenizer: Any
    settings: AgentSettings
    key: str = field(default_factory=lambda: "rs-" + secrets.token_urlsafe(32))
    recorder: CallRecorder = field(init=False)
    # Why the episode ended, where the door refused the last call: "context", "max_turns", or
    # "error" (the backends failed it: the service's failure, not the agent's). Cleared by a
    # call that succeeds after it.
    ended: str | None = None
    ended_detail: str | None = None
    llm_s: float = 0.0
    requests: int = 0  # chat-completions requests that reached this door with its key
    refused: int = 0  # of those, answered with an error
    in_flight: int = 0  # requests being served (the gateway caps them per door)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.recorder = CallRecorder(self.tokenizer, self.settings.end_of_turn_token,
                                     dict(self.settings.chat_template_kwargs))

    async def complete(self, request: dict) -> dict:
        """A chat completion for ``request`` (the OpenAI request body), as a response body."""
        self.requests += 1
        try:
            options = parse_request(request)
            # One call at a time per job: a trajectory is one sequence of calls.
            async with self._lock:
                return await self._complete(options, request)
        except DoorError:
            self.refused += 1
            raise

    async def _complete(self, options: CallOptions, request: dict) -> dict:
        s = self.settings
        if len(self.recorder.calls) >= s.max_turns:
            self._end("max_turns", f"{s.max_turns} model calls used")
            # Permanent (4xx, not 429): every client retries a 429 as a rate limit, and no retry
            # can succeed. The harness's giving up on it is scored as the agent's end.
            raise DoorError(400, f"this job's budget of {s.max_turns} model calls is used up; no further call "
                            "will be served", "max_turns_exceeded")
        tools = options.tools
        try:
            prompt_ids, extended = self.recorder.prompt(options.messages, tools)
        except Exception as exc:  # the harness's messages do not render with this template
            raise DoorError(400, f"the messages cannot be rendered with the model's chat template: {exc}",
                            "invalid_messages", param="messages") from exc
        renderer, _ = self.recorder.renderer(tools)
        budget = s.max_context_tokens - len(prompt_ids)
        if budget <= 0:
            self._end("context", f"a {len(prompt_ids)}-token prompt fills the {s.max_context_tokens}-token context")
            raise DoorError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context for the job is "
                            f"{s.max_context_tokens}", "context_length_exceeded", param="messages")
        max_tokens = max(1, min(options.max_tokens or s.max_tokens_per_turn, s.max_tokens_per_turn, budget))
        stop_ids = sorted(set(s.sampling.stop_token_ids or []) | {renderer.end_of_turn_id})
        stops = list(dict.fromkeys([*(s.sampling.stop or []), *options.stop]))
        # The job's sampling rules (the trainer's, e.g. temperature 1.0): the harness's own
        # temperature or top_p would make the recorded logprobs off-policy. A seed does not
        # change the distribution: the request's is used where the job sets none.
        update: dict[str, Any] = {"max_tokens": max_tokens, "stop_token_ids": stop_ids, "stop": stops or None}
        if s.sampling.seed is None and options.seed is not None:
            update["seed"] = options.seed
        params = s.sampling.model_copy(update=update)
        t0 = time.monotonic()
        try:
            gen = await self.session.generate(prompt_ids, params)
        except ContextLengthError as exc:
            self._end("context", exc.reason)
            raise DoorError(400, exc.reason, "context_length_exceeded") from None
        except (BackendError, NoBackendAvailable) as exc:
            self._end("error", str(exc))
            raise DoorError(502, f"no backend could serve this call: {exc}", "backend_unavailable",
                            "server_error") from None
        finally:
            self.llm_s += time.monotonic() - t0
        if len(gen.token_ids) != len(gen.logprobs):
            self._end("error", f"backend returned {len(gen.token_ids)} ids but {len(gen.logprobs)} logprobs")
            raise DoorError(502, "the backend's answer was inconsistent", "backend_error", "server_error")
        ended_turn = bool(gen.token_ids) and gen.token_ids[-1] == renderer.end_of_turn_id
        text_ids = gen.token_ids[:-1] if ended_turn else gen.token_ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=False)
        if stops and gen.finish_reason == "stop" and gen.token_ids and gen.token_ids[-1] not in stop_ids:
            # Ended on a stop string: the ids (all recorded) end with the token that completed
            # it; the harness gets the text before it, as vLLM returns it.
            start = len(self.tokenizer.decode(gen.token_ids[:s.sampling.min_tokens], skip_special_tokens=False)) \
                if s.sampling.min_tokens else 0
            cut = cut_at_stop(text, stops, s.sampling.include_stop_str_in_output, start)
            text = text if cut is None else cut
        reply, finish = _reply(text, ended_turn, gen.finish_reason, options)
        self.recorder.record(options.messages, tools, prompt_ids, extended, gen, reply)
        self.ended = self.ended_detail = None  # a harness that got past a refusal (e.g. summarised) goes on
        # Once this answer is on its way (the next turn of the loop), get the next call's
        # rendering ready while the harness works.
        asyncio.get_running_loop().call_soon(self.recorder.prepare)
        logprobs = {"content": self._token_logprobs(text_ids, gen.logprobs), "refusal": None} \
            if options.logprobs else None
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.get("model") or MODEL_NAME,
                "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": logprobs}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                          "total_tokens": len(prompt_ids) + len(gen.token_ids)}}

    def _token_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict]:
        """OpenAI's per-token logprobs of the sampled tokens (the backend's own values)."""
        out = []
        for token_id, logprob in zip(ids, logprobs):
            piece = self.tokenizer.decode([token_id], skip_special_tokens=False)
            out.append({"token": piece, "logprob": logprob if math.isfinite(logprob) else -9999.0,
                        "bytes": list(piece.encode()), "top_logprobs": []})
        return out

    def _end(self, reason: str, detail: str) -> None:
        self.ended, self.ended_detail = reason, detail


def _reply(text: str, ended_turn: bool, backend_finish: str, options: CallOptions) -> tuple[dict, str]:
    """The assistant message a harness gets for a completion's text, and its finish reason."""
    parsed = parse_tool_calls(text) if options.parse_tool_calls else None
    calls = [c for c in parsed.calls if isinstance(c, ToolCall)] if parsed else []
    if parsed and calls and len(calls) == len(parsed.calls):
        if not options.parallel_tool_calls:
            calls = calls[:1]  # as vLLM: the first call only (the ids keep what the model wrote)
        return ({"role": "assistant", "content": parsed.content or None,
                 "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                for c in calls]}, "tool_calls")
    # No call, or a malformed one: the text as the model wrote it (the harness shows it back).
    finish = "length" if not ended_turn and backend_finish == "length" else "stop"
    return {"role": "assistant", "content": text}, finish


def _stream_events(body: dict, include_usage: bool) -> list[bytes]:
    """A completion as the server-sent events of a streamed one (one delta per part)."""
    choice = body["choices"][0]
    message = choice["message"]
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"], "model": body["model"]}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": message.get("content") or ""}, logprobs=choice["logprobs"])]
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(b"data: " + json.dumps({**base, "choices": [], "usage": body["usage"]}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


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


def _deadline(writer: asyncio.StreamWriter, timeout_s: float, answer: bytes = b"") -> asyncio.TimerHandle:
    """Close the connection in ``timeout_s`` (after sending ``answer``) unless cancelled first:
    the read it guards then ends at once (a timer, not a task per read as wait_for makes)."""

    def expire() -> None:
        if answer:
            writer.write(answer)
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

    async def start(self) -> "Gateway":
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
        if bound is not None:
            door = bound if self.doors.get(bound.key) is bound else None
        else:
            auth = headers.get("authorization", "")
            door = self.doors.get(auth[7:].strip()) if auth[:7].lower() == "bearer " else None
        if door is None:
            await self._send(writer, 401, DoorError(401, "unknown or expired key: each job's door takes only its own "
                                                    "OPENAI_API_KEY", "invalid_api_key", "authentication_error").body(),
                             close=True)
            return False
        raw_length = headers.get("content-length", "0")
        if "transfer-encoding" in headers or not raw_length.isdigit():
            await self._send(writer, 411, DoorError(411, "send the body with a Content-Length", "length_required").body(),
                             close=True)
            return False
        length = int(raw_length)
        if length > MAX_REQUEST_BYTES:
            await self._send(writer, 413, DoorError(413, f"request bodies are limited to {MAX_REQUEST_BYTES} bytes",
                                                    "too_large").body(), close=True)
            return False
        if door.in_flight >= self.max_requests_per_door:
            await self._send(writer, 503, DoorError(503, f"this job's door is serving {door.in_flight} requests "
                                                    "already; one call at a time is served", "too_many_requests",
                                                    "server_error").body(), close=True)
            return False
        door.in_flight += 1
        try:
            body = b""
            if length and headers.get("expect", "").lower() == "100-continue":  # curl, for bodies past 1 KiB
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if length:
                late = _response(408, DoorError(408, f"the body did not arrive within {self.read_timeout_s:g} s",
                                                "request_timeout").body(), close=True)
                deadline = _deadline(writer, self.read_timeout_s, late)
                try:
                    body = await reader.readexactly(length)
                finally:
                    deadline.cancel()
            await self._handle(writer, method, target.split("?", 1)[0], door, body)
        finally:
            door.in_flight -= 1
        return headers.get("connection", "").lower() != "close"

    async def _handle(self, writer, method: str, path: str, door: JobDoor, body: bytes) -> None:
        path = path.rstrip("/")
        if path == "/v1/models" and method == "GET":
            await self._send(writer, 200, {"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "rollstream"}]})
            return
        if path != "/v1/chat/completions":
            await self._send(writer, 404, DoorError(404, f"{path} is not served here; this door serves "
                                                   "POST /v1/chat/completions and GET /v1/models", "not_found").body())
            return
        if method != "POST":
            await self._send(writer, 405, DoorError(405, "use POST", "method_not_allowed").body())
            return
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            await self._send(writer, 400, DoorError(400, f"the body is not a JSON object: {exc}", "invalid_json").body())
            return
        try:
            response = await door.complete(request)
        except DoorError as exc:
            await self._send(writer, exc.status, exc.body())
            return
        if request.get("stream"):
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            await self._send_stream(writer, _stream_events(response, include_usage))
        else:
            await self._send(writer, 200, response)

    @staticmethod
    async def _send(writer, status: int, payload: dict, close: bool = False) -> None:
        writer.write(_response(status, payload, close))
        await writer.drain()

    @staticmethod
    async def _send_stream(writer, events: list[bytes]) -> None:
        out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
               b"transfer-encoding: chunked\r\n\r\n"]
        out += [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
        out.append(b"0\r\n\r\n")
        writer.write(b"".join(out))
        await writer.drain()
