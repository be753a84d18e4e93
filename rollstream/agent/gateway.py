"""The per-job OpenAI-compatible door of the run stage: an agent harness of the job's own talks
chat completions (tools, tool_calls, streaming) to ``http://127.0.0.1:PORT/v1`` with the job's
key; behind it each call is rendered with the model's chat template, sent token-in/token-out
through the job's LLM session (the balancer's job and group affinity kept), and recorded
exactly (agent/recorder.py). One small HTTP/1.1 server per run-worker process serves every
job's door; a key reaches only its own job, and nothing else (no backend, no other job) is
served. The server listens on loopback only: sandboxes, whose network is off, never reach it."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollstream.agent.parsing import ToolCall, parse_tool_calls
from rollstream.agent.recorder import CallRecorder
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import BackendError, ContextLengthError
from rollstream.pipeline.balancer import NoBackendAvailable

log = logging.getLogger(__name__)

MODEL_NAME = "rollstream"
MAX_REQUEST_BYTES = 32 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 429: "Too Many Requests", 502: "Bad Gateway"}


class DoorError(Exception):
    """A call the door answers with an OpenAI-style error instead of a completion."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code, "param": None}}


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
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.recorder = CallRecorder(self.tokenizer, self.settings.end_of_turn_token,
                                     dict(self.settings.chat_template_kwargs))

    async def complete(self, request: dict) -> dict:
        """A chat completion for ``request`` (the OpenAI request body), as a response body."""
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise DoorError(400, "messages must be a non-empty list of message objects", "invalid_messages")
        tools = request.get("tools") or None
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise DoorError(400, "tools must be a list of tool objects", "invalid_tools")
            tools = [_template_tool(t) for t in tools]
        if (request.get("n") or 1) != 1:
            raise DoorError(400, "this endpoint serves n=1 (each call is one recorded sample)", "unsupported_n")
        # One call at a time per job: a trajectory is one sequence of calls.
        async with self._lock:
            return await self._complete(messages, tools, request)

    async def _complete(self, messages: list[dict], tools: list[dict] | None, request: dict) -> dict:
        s = self.settings
        if len(self.recorder.calls) >= s.max_turns:
            self._end("max_turns", f"{s.max_turns} model calls used")
            raise DoorError(429, f"this job's budget of {s.max_turns} model calls is used up", "max_turns_exceeded")
        try:
            prompt_ids, extended = self.recorder.prompt(messages, tools)
        except Exception as exc:  # the harness's messages do not render with this template
            raise DoorError(400, f"the messages cannot be rendered with the model's chat template: {exc}",
                            "invalid_messages") from exc
        renderer, _ = self.recorder.renderer(tools)
        budget = s.max_context_tokens - len(prompt_ids)
        if budget <= 0:
            self._end("context", f"a {len(prompt_ids)}-token prompt fills the {s.max_context_tokens}-token context")
            raise DoorError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context for the job is "
                            f"{s.max_context_tokens}", "context_length_exceeded")
        asked = request.get("max_completion_tokens") or request.get("max_tokens") or s.max_tokens_per_turn
        if not isinstance(asked, int) or isinstance(asked, bool):
            raise DoorError(400, "max_tokens must be an integer", "invalid_max_tokens")
        max_tokens = max(1, min(asked, s.max_tokens_per_turn, budget))
        stop_ids = sorted(set(s.sampling.stop_token_ids or []) | {renderer.end_of_turn_id})
        # The job's sampling rules (the trainer's, e.g. temperature 1.0): the harness's own
        # temperature or top_p would make the recorded logprobs off-policy.
        params = s.sampling.model_copy(update={"max_tokens": max_tokens, "stop_token_ids": stop_ids})
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
        text = self.tokenizer.decode(gen.token_ids[:-1] if ended_turn else gen.token_ids, skip_special_tokens=False)
        reply, finish = _reply(text, ended_turn, gen.finish_reason)
        self.recorder.record(messages, tools, prompt_ids, extended, gen, reply)
        self.ended = self.ended_detail = None  # a harness that got past a refusal (e.g. summarised) goes on
        # Once this answer is on its way (the next turn of the loop), get the next call's
        # rendering ready while the harness works.
        asyncio.get_running_loop().call_soon(self.recorder.prepare)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.get("model") or MODEL_NAME,
                "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                          "total_tokens": len(prompt_ids) + len(gen.token_ids)}}

    def _end(self, reason: str, detail: str) -> None:
        self.ended, self.ended_detail = reason, detail


def _template_tool(tool: dict) -> dict:
    """A tool as the chat template shows it to the model: the function's name, description and
    parameters. API-only flags (``strict``) are the client's business, not the prompt's."""
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return tool
    return {**tool, "function": {k: v for k, v in fn.items() if k != "strict"}}


def _reply(text: str, ended_turn: bool, backend_finish: str) -> tuple[dict, str]:
    """The assistant message a harness gets for a completion's text, and its finish reason."""
    parsed = parse_tool_calls(text)
    calls = [c for c in parsed.calls if isinstance(c, ToolCall)]
    if calls and len(calls) == len(parsed.calls):
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

    def chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
        data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": message.get("content") or ""})]
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(b"data: " + json.dumps({**base, "choices": [], "usage": body["usage"]}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


class Gateway:
    """The run worker's door server: ``open(job_id, session, ...)`` gives a job its key,
    ``close(door)`` takes it away. Start with ``await start()``; ``base_url`` is then set."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self.doors: dict[str, JobDoor] = {}
        self._server: asyncio.base_events.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> "Gateway":
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
            self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def open(self, job_id: str, session: Any, tokenizer: Any, settings: AgentSettings) -> JobDoor:
        door = JobDoor(job_id, session, tokenizer, settings)
        self.doors[door.key] = door
        return door

    def close(self, door: JobDoor) -> None:
        self.doors.pop(door.key, None)

    # -- HTTP/1.1, the little that OpenAI clients use ------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _version = lines[0].split(" ", 2)
                except ValueError:
                    return
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length") or 0)
                if length > MAX_REQUEST_BYTES:
                    await self._send(writer, 413, {"error": {"message": "request too large", "code": "too_large"}})
                    return
                body = await reader.readexactly(length) if length else b""
                await self._handle(writer, method, target.split("?", 1)[0], headers, body)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except Exception:
            log.exception("gateway connection failed")
        finally:
            writer.close()

    async def _handle(self, writer, method: str, path: str, headers: dict, body: bytes) -> None:
        auth = headers.get("authorization", "")
        door = self.doors.get(auth[7:].strip()) if auth[:7].lower() == "bearer " else None
        if door is None:
            await self._send(writer, 401, DoorError(401, "unknown or expired key: each job's door takes only "
                                                   "its own OPENAI_API_KEY", "invalid_api_key",
                                                   "authentication_error").body())
            return
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
    async def _send(writer, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()

    @staticmethod
    async def _send_stream(writer, events: list[bytes]) -> None:
        out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
               b"transfer-encoding: chunked\r\n\r\n"]
        out += [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
        out.append(b"0\r\n\r\n")
        writer.write(b"".join(out))
        await writer.drain()
