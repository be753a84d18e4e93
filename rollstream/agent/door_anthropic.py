"""Anthropic Messages at the per-job door (POST /v1/messages, what Claude Code speaks, and
/v1/messages/count_tokens): ``system`` (a string or text blocks) and messages of content blocks
(text, tool_use, tool_result) become the chat messages the template renders (each tool_result a
``tool`` message, in order); tools' ``input_schema`` becomes the template's parameters. The
answer is a ``message`` of a text block and a tool_use block per parsed tool call or, streamed,
Anthropic's events (message_start, content_block_start, content_block_delta with text_delta or
input_json_delta, content_block_stop, message_delta, message_stop) sent while the tokens are
generated; errors in Anthropic's form ``{"type": "error", "error": {...}}``. A reply that opens
with the model's ``<think>...</think>`` is answered as a thinking block (streamed as
thinking_delta) and the text after it; a thinking block sent back is joined to its text again
exactly as the model wrote it, so the harness's next call extends the recorded sequence (the
signature is empty: nothing is signed here). The request's ``thinking`` setting is the client's
hint: the job's chat_template_kwargs decide whether the served model thinks, and so is
``output_config`` (effort). ``context_management`` (which Claude Code always sends, and cannot be
told not to) asks a hosted model's server to clear old tool results or thinking from the prompt:
here the prompt is the history the harness sent, rendered whole (the trajectory must be what the
model saw), and one past the job's context is refused with context_length_exceeded, which a
harness answers by compacting. ``cache_control`` marks are the client's caching hints."""

from __future__ import annotations

import json
import uuid
from typing import Any

from rollstream.agent.door_models import AnthropicRequest
from rollstream.agent.door_request import (
    ANTHROPIC_SERVICE_TIERS,
    MODEL_NAME,
    CallOptions,
    DoorError,
    check_bookkeeping,
    check_job_sampling,
    flag,
    function_tools,
    is_int,
    refuse,
    stop_strings,
)
from rollstream.agent.door_stream import Completed, held_prefix

_ACCEPTED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "tools", "tool_choice",
                       "temperature", "top_p", "top_k", "metadata", "thinking", "service_tier", "cache_control",
                       "context_management", "output_config"})
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def split_thinking(content: str) -> tuple[str | None, str]:
    """The model's thinking at the start of ``content`` (between <think> and </think>), and the rest."""
    end = content.find(THINK_CLOSE)
    if not content.startswith(THINK_OPEN) or end < 0:
        return None, content
    return content[len(THINK_OPEN):end], content[end + len(THINK_CLOSE):]


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise DoorError(400, f"{where} must be a string or a list of content blocks", "invalid_request",
                        param=where)
    return content


def _text_blocks(content: Any, where: str) -> str:
    """Text blocks (a tool_result's content, the system prompt) as text; other blocks refused."""
    out = []
    for block in _blocks(content, where):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise DoorError(400, f"{where} holds a {block.get('type')!r} block; this door serves a text model: "
                            "send text blocks only", "unsupported_content", param=where)
        out.append(block["text"])
    return "\n".join(out) if where == "system" else "".join(out)


def _messages(request: dict) -> list[dict]:
    messages: list[dict] = []
    if request.get("system") is not None:
        messages.append({"role": "system", "content": _text_blocks(request["system"], "system")})
    raw = request.get("messages")
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise DoorError(400, "messages must be a non-empty list of message objects", "invalid_request",
                        param="messages")
    for i, message in enumerate(raw):
        role, where = message.get("role"), f"messages[{i}]"
        if role == "system":  # a system message amid the turns (Claude Code 2.1 sends its environment so)
            messages.append({"role": "system", "content": _text_blocks(message.get("content"), f"{where}.content")})
            continue
        if role not in ("user", "assistant"):
            raise DoorError(400, f"{where}.role must be user, assistant or system", "invalid_request",
                            param=f"{where}.role")
        texts, calls = [], []
        for j, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            kind, at = block.get("type"), f"{where}.content[{j}]"
            if kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                texts.append(THINK_OPEN + block["thinking"] + THINK_CLOSE)  # as the model wrote it
            elif kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                text = _text_blocks(result, f"{at}.content") if result else ""
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another provider's encrypted thinking: nothing this model wrote
            else:
                raise DoorError(400, f"{at} is a {kind!r} block in a {role} message; this door serves text, "
                                "thinking and tool_use (assistant), tool_result (user) blocks", "unsupported_content",
                                param=at)
        if texts or calls or not messages or messages[-1]["role"] != "tool":
            entry: dict = {"role": role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def _tool_choice(choice: Any) -> tuple[bool, bool]:
    """Whether calls are parsed, and whether several may be (disable_parallel_tool_use)."""
    if choice is None:
        return True, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("any", "tool"):
        raise refuse("tool_choice", f"tool_choice {kind!r} needs decoding constrained to a tool call, which this door "
                     "does not do: the model would be free to answer without one. Send {\"type\": \"auto\"} (or leave "
                     "it unset) and handle a reply without tool_use", "unsupported_tool_choice")
    if kind not in ("auto", "none"):
        raise refuse("tool_choice", "tool_choice must be {\"type\": \"auto\"} or {\"type\": \"none\"}", "invalid_value")
    return kind == "auto", not flag(choice, "disable_parallel_tool_use", False)


def parse(request: dict, count_only: bool = False) -> CallOptions:
    """A Messages request (or a count_tokens one) as the door's CallOptions, or a DoorError."""
    unknown = sorted(set(request) - _ACCEPTED)
    if unknown:
        raise refuse(unknown[0], f"parameter {unknown[0]!r} is not supported by this door; it serves "
                     f"{', '.join(sorted(_ACCEPTED))}")
    check_bookkeeping(request, ANTHROPIC_SERVICE_TIERS, string_metadata=False)
    max_tokens = request.get("max_tokens")
    if (max_tokens is not None or not count_only) and (not is_int(max_tokens) or max_tokens < 1):
        raise refuse("max_tokens", "max_tokens is required: a positive integer", "invalid_value")
    check_job_sampling(request, ("temperature", "top_p", "top_k"))
    thinking = request.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict)
                                 or thinking.get("type") not in ("enabled", "disabled", "adaptive")):
        raise refuse("thinking", "thinking must be {\"type\": \"enabled\" | \"disabled\" | \"adaptive\", ...}",
                     "invalid_value")
    context = request.get("context_management")
    if context is not None and (not isinstance(context, dict) or not isinstance(context.get("edits", []), list)):
        raise refuse("context_management", "context_management must be {\"edits\": [...]}", "invalid_value")
    if request.get("output_config") is not None and not isinstance(request["output_config"], dict):
        raise refuse("output_config", "output_config must be an object", "invalid_value")
    tools = function_tools(request.get("tools"), "custom", "custom", "input_schema",
                           'client tools only ({"name": ..., "input_schema": ...}): server tools (web search, code '
                           "execution, computer use) have no backend here")
    parse_calls, parallel = _tool_choice(request.get("tool_choice"))
    stream = flag(request, "stream", False)
    if count_only and stream:
        raise refuse("stream", "count_tokens does not stream", "invalid_value")
    return CallOptions(messages=_messages(request), tools=tools if parse_calls else None,
                       parse_tool_calls=parse_calls, parallel_tool_calls=parallel,
                       stop=stop_strings(request.get("stop_sequences"), "stop_sequences"),
                       max_tokens=max_tokens, logprobs=False, seed=None, stream=stream, include_usage=True)


def _stop_reason(done: Completed) -> str:
    if done.finish == "tool_calls":
        return "tool_use"
    if done.finish == "length":
        return "max_tokens"
    return "stop_sequence" if done.stop_sequence else "end_turn"


def _usage(done: Completed) -> dict:
    # Anthropic counts tokens read from the cache apart from input_tokens.
    return {"input_tokens": done.prompt_tokens - done.cached_tokens, "cache_read_input_tokens": done.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": done.completion_tokens}


def _tool_use(call: Any) -> dict:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": call.arguments}


class AnthropicApi:
    """What gateway.py needs of an API (see door_chat.ChatApi)."""

    name = "anthropic"

    def parse(self, request: dict, count_only: bool = False) -> tuple[AnthropicRequest, CallOptions]:
        options = parse(request, count_only)
        if count_only and "max_tokens" in request:  # counting generates nothing: checked, not read
            request = {k: v for k, v in request.items() if k != "max_tokens"}
        return AnthropicRequest.accepted(request), options

    def error(self, exc: DoorError) -> dict:
        return error_body(exc.status, str(exc))

    def body(self, done: Completed, request: AnthropicRequest, options: CallOptions, tokenizer: Any) -> dict:
        thinking, text = split_thinking(done.content)
        content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking is not None else []
        content += [{"type": "text", "text": text}] if text or not (done.calls or content) else []
        content += [_tool_use(c) for c in done.calls]
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": request.model or MODEL_NAME, "content": content, "stop_reason": _stop_reason(done),
                "stop_sequence": done.stop_sequence, "usage": _usage(done)}

    def emitter(self, request: AnthropicRequest, options: CallOptions, tokenizer: Any) -> AnthropicEvents:
        return AnthropicEvents(request.model or MODEL_NAME)


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **fields}).encode() + b"\n\n"


class AnthropicEvents:
    """A streamed message's events (door_stream.Emitter): a thinking block while the text is inside
    the model's opening <think>...</think>, then a text block, then a tool_use block per call."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.blocks = 0  # content blocks started so far
        self.open: str | None = None  # the kind of the block now open
        self.thought = False  # the thinking part is over (or there was none)
        self.pending = ""  # text that may be the start of <think> or </think>

    def start(self, prompt_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return _event("message_start", message=message)

    def _switch(self, kind: str | None) -> bytes:
        """Close the open block and open one of ``kind`` (None: none)."""
        out = _event("content_block_stop", index=self.blocks - 1) if self.open else b""
        self.open = kind
        if kind is not None:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += _event("content_block_start", index=self.blocks, content_block=block)
            self.blocks += 1
        return out

    def _delta(self, text: str) -> bytes:
        if not text:
            return b""
        if self.open != ("thinking" if not self.thought else "text"):
            return self._switch("thinking" if not self.thought else "text") + self._delta(text)
        delta = {"type": "thinking_delta", "thinking": text} if self.open == "thinking" else \
            {"type": "text_delta", "text": text}
        return _event("content_block_delta", index=self.blocks - 1, delta=delta)

    def text(self, delta: str, tokens: list[tuple[int, float]], final: bool = False) -> bytes:
        text, self.pending = self.pending + delta, ""
        if not self.thought and self.open is None:  # does the reply open with <think>?
            if THINK_OPEN.startswith(text) and not final:
                self.pending = text
                return b""
            if not text.startswith(THINK_OPEN):
                self.thought = True
                return self._delta(text)
            text = text[len(THINK_OPEN):]
            out = self._switch("thinking")
            return out + self.text(text, tokens, final) if text else out
        if self.thought:
            return self._delta(text)
        end = text.find(THINK_CLOSE)
        if end >= 0:
            out = self._delta(text[:end])
            self.thought = True
            return out + self._switch(None) + self._delta(text[end + len(THINK_CLOSE):])
        keep = 0 if final else held_prefix(text, [THINK_CLOSE])
        self.pending = text[len(text) - keep:] if keep else ""
        return self._delta(text[:len(text) - keep])

    def finish(self, done: Completed) -> bytes:
        out = [self.text("", [], final=True)]
        if not self.blocks and not done.calls:
            out.append(self._switch("text"))  # a reply of nothing still has its (empty) text block
        out.append(self._switch(None))
        for call in done.calls:
            index, block = self.blocks, _tool_use(call)
            self.blocks += 1
            out += [_event("content_block_start", index=index, content_block={**block, "input": {}}),
                    _event("content_block_delta", index=index,
                           delta={"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}),
                    _event("content_block_stop", index=index)]
        out.append(_event("message_delta",
                          delta={"stop_reason": _stop_reason(done), "stop_sequence": done.stop_sequence},
                          usage={"output_tokens": done.completion_tokens}))
        out.append(_event("message_stop"))
        return b"".join(out)

    def error(self, status: int, message: str, code: str) -> bytes:
        return _event("error", error=error_body(status, message)["error"])
