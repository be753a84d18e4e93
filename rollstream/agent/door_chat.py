"""OpenAI Chat Completions at the per-job door (POST /v1/chat/completions): the request checked by
agent/door_request.py, the answer as a ``chat.completion`` body or, streamed, as
``chat.completion.chunk`` events sent while the tokens are generated (text deltas as they come,
tool calls as ``tool_calls`` deltas once the reply is parsed, usage with
stream_options.include_usage, then ``[DONE]``)."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from rollstream.agent.door_models import ChatRequest
from rollstream.agent.door_request import MODEL_NAME, CallOptions, DoorError, parse_request
from rollstream.agent.door_stream import Completed
from rollstream.agent.parsing import ToolCall


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def token_logprobs(tokenizer: Any, tokens: list[tuple[int, float]]) -> list[dict]:
    """OpenAI's per-token logprobs of the sampled tokens (the backend's own values)."""
    out = []
    for token_id, logprob in tokens:
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        out.append({"token": piece, "logprob": logprob if math.isfinite(logprob) else -9999.0,
                    "bytes": list(piece.encode()), "top_logprobs": []})
    return out


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]


def _usage(done: Completed) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


class ChatApi:
    """What gateway.py needs of an API: parse a request, answer it whole or as events, word an error."""

    name = "chat"

    def parse(self, request: dict) -> tuple[ChatRequest, CallOptions]:
        options = parse_request(request)
        return ChatRequest.accepted(request), options

    def error(self, exc: DoorError) -> dict:
        return exc.body()

    def body(self, done: Completed, request: ChatRequest, options: CallOptions, tokenizer: Any) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": done.content}
        if done.calls:
            message["content"] = done.content or None
            message["tool_calls"] = _tool_calls(done.calls)
        logprobs = {"content": token_logprobs(tokenizer, done.tokens), "refusal": None} if options.logprobs else None
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.model or MODEL_NAME,
                "choices": [{"index": 0, "message": message, "finish_reason": done.finish, "logprobs": logprobs}],
                "usage": _usage(done)}

    def emitter(self, request: ChatRequest, options: CallOptions, tokenizer: Any) -> ChatEvents:
        return ChatEvents(request.model or MODEL_NAME, options, tokenizer)


class ChatEvents:
    """A streamed chat completion's ``data:`` events (door_stream.Emitter)."""

    def __init__(self, model: str, options: CallOptions, tokenizer: Any) -> None:
        self.options, self.tokenizer = options, tokenizer
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": model}

    def _chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        data = {**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def _logprobs(self, tokens: list[tuple[int, float]]) -> dict | None:
        return {"content": token_logprobs(self.tokenizer, tokens), "refusal": None} if self.options.logprobs else None

    def start(self, prompt_tokens: int) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, delta: str, tokens: list[tuple[int, float]]) -> bytes:
        return self._chunk({"content": delta}, logprobs=self._logprobs(tokens))

    def finish(self, done: Completed) -> bytes:
        events = [self._chunk({"tool_calls": [{"index": i, **call}]})
                  for i, call in enumerate(_tool_calls(done.calls))]
        events.append(self._chunk({}, done.finish))
        if self.options.include_usage:
            events.append(b"data: " + json.dumps({**self.base, "choices": [], "usage": _usage(done)}).encode()
                          + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return b"".join(events)

    def error(self, status: int, message: str, code: str) -> bytes:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
        return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
