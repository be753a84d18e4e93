"""OpenAI Responses at the per-job door (POST /v1/responses, what Codex CLI speaks): ``input`` items
(message, function_call, function_call_output; reasoning items, which this door never emits,
are skipped: what they carry is another provider's state) and ``instructions`` become the chat
messages the template renders; function tools become the template's tools; the answer is a
``response`` whose output holds a message item and a function_call item per parsed tool call,
or, streamed, Responses' events (response.created, response.output_item.added,
response.output_text.delta, response.function_call_arguments.delta, ... response.completed) sent
while the tokens are generated. Nothing is stored (store must be false or unset), so
previous_response_id is refused: send the whole input each time, as Codex does with store false.
``reasoning``, ``include`` and ``text.verbosity`` are the client's hints to a hosted model; here
the job's settings (chat_template_kwargs) decide whether and how the served model thinks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from rollstream.agent.door_models import ResponsesRequest
from rollstream.agent.door_request import (
    MODEL_NAME,
    OPENAI_SERVICE_TIERS,
    CallOptions,
    DoorError,
    check_bookkeeping,
    check_job_sampling,
    flag,
    function_tools,
    is_int,
    refuse,
    tool_choice_parses,
)
from rollstream.agent.door_stream import Completed

_BOOKKEEPING = ("metadata", "client_metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                "prompt_cache_retention",
                "reasoning", "include", "text", "truncation", "background", "previous_response_id", "top_logprobs",
                "stream_options")
_ACCEPTED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                       "max_output_tokens", "stream", "store", "temperature", "top_p", *_BOOKKEEPING})


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    """A message's or an output's content (a string, or text parts) as text; other parts refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DoorError(400, f"{where} must be a string or a list of text parts", "invalid_input", param=where)
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise DoorError(400, f"{where} holds a {kind or type(part).__name__} part; this door serves a text model: "
                            "send input_text parts only", "unsupported_content", param=where)
    return "".join(out)


def input_messages(request: dict) -> list[dict]:
    """The request's instructions and input as chat messages (function calls folded into the
    assistant message before them, as the chat template shows them)."""
    messages: list[dict] = []
    instructions = request.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise refuse("instructions", "instructions must be a string", "invalid_value")
        messages.append({"role": "system", "content": instructions})
    raw = request.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise DoorError(400, "input must be a string or a non-empty list of items", "invalid_input", param="input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise DoorError(400, f"{where} must be an object", "invalid_input", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise DoorError(400, f"{where}.role must be user, assistant, system or developer", "invalid_input",
                                param=f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise DoorError(400, f"{where} needs a string name and string arguments", "invalid_input", param=where)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise DoorError(400, f"{where} needs the call_id it answers", "invalid_input", param=where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # see the module docstring
        else:
            raise DoorError(400, f"{where} is a {kind!r} item; this door serves message, function_call, "
                            "function_call_output and reasoning items", "unsupported_input", param=where)
    return messages


def namespaces(tools: Any) -> tuple[list, dict[str, str]]:
    """The request's tools with each ``namespace`` tool's function tools in its place (Codex groups
    its sub-agent tools so), and the namespace of each function that came from one: a call to it
    is answered with that ``namespace``, as the Responses API names it."""
    if not isinstance(tools, list):
        return tools, {}
    flat, spaces = [], {}
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            flat += tool["tools"]
            spaces.update({t["name"]: str(tool.get("name")) for t in tool["tools"]
                           if isinstance(t, dict) and isinstance(t.get("name"), str)})
        else:
            flat.append(tool)
    return flat, spaces


def parse(request: dict) -> CallOptions:
    """A Responses request as the door's CallOptions, or a DoorError naming the parameter."""
    unknown = sorted(set(request) - _ACCEPTED)
    if unknown:
        raise refuse(unknown[0], f"parameter {unknown[0]!r} is not supported by this door; it serves "
                     f"{', '.join(sorted(_ACCEPTED))}")
    check_bookkeeping(request, OPENAI_SERVICE_TIERS)
    if request.get("previous_response_id") is not None:
        raise refuse("previous_response_id", "this door stores no responses (the job's trajectory is the record): "
                     "send the whole conversation as input, with store false")
    if request.get("store"):
        raise refuse("store", "responses are not stored by this door; send store false")
    if request.get("background"):
        raise refuse("background", "background responses are not served; send the request and wait for it")
    if request.get("truncation") not in (None, "disabled"):
        raise refuse("truncation", "truncation 'auto' would drop input the trajectory keeps; send 'disabled' or "
                     "leave it unset (a prompt past the context is refused with context_length_exceeded)")
    if request.get("top_logprobs") not in (None, 0):
        raise refuse("top_logprobs", "this door returns no top logprobs; leave top_logprobs unset or 0")
    text = request.get("text")
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if text is not None and (not isinstance(text, dict) or (fmt is not None and fmt.get("type") != "text")):
        raise refuse("text", "text.format must be {\"type\": \"text\"}: a JSON schema needs constrained decoding, "
                     "which this door does not do")
    include = request.get("include") or []
    if not isinstance(include, list) or any(item != "reasoning.encrypted_content" for item in include):
        raise refuse("include", "include may name reasoning.encrypted_content only (this door has none to add)")
    check_job_sampling(request, ("temperature", "top_p"))
    tools = function_tools(namespaces(request.get("tools"))[0], "function", None, "parameters",
                           'function tools only ({"type": "function", "name": ..., "parameters": ...}): hosted tools '
                           "(web search, file search, custom or shell tools) have no backend here")
    parse_calls = tool_choice_parses(request.get("tool_choice"), tools)
    max_tokens = request.get("max_output_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise refuse("max_output_tokens", "max_output_tokens must be a positive integer", "invalid_value")
    stream = flag(request, "stream", False)
    options = request.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
        raise refuse("stream_options", "stream_options is only allowed with stream: true, and takes "
                     "include_obfuscation (this door, serving loopback, never pads)", "invalid_value")
    return CallOptions(messages=input_messages(request), tools=tools if parse_calls else None,
                       parse_tool_calls=parse_calls, parallel_tool_calls=flag(request, "parallel_tool_calls", True),
                       stop=[], max_tokens=max_tokens, logprobs=False, seed=None, stream=stream, include_usage=True)


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] \
        if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, spaces: dict[str, str],
               status: str = "completed") -> dict:
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if name in spaces:
        item["namespace"] = spaces[name]
    return item


class ResponsesApi:
    """What gateway.py needs of an API (see door_chat.ChatApi)."""

    name = "responses"

    def parse(self, request: dict) -> tuple[ResponsesRequest, CallOptions]:
        options = parse(request)
        return ResponsesRequest.accepted(request), options

    def error(self, exc: DoorError) -> dict:
        return exc.body()

    def body(self, done: Completed, request: ResponsesRequest, options: CallOptions, tokenizer: Any) -> dict:
        events = ResponsesEvents(request)
        return events.response(done, _output(done, events.spaces))

    def emitter(self, request: ResponsesRequest, options: CallOptions, tokenizer: Any) -> ResponsesEvents:
        return ResponsesEvents(request)


def _output(done: Completed, spaces: dict[str, str]) -> list[dict]:
    items = [_message_item(_id("msg"), done.content)] if done.content or not done.calls else []
    items += [_call_item(_id("fc"), _id("call"), c.name, json.dumps(c.arguments), spaces) for c in done.calls]
    return items


class ResponsesEvents:
    """A streamed response's events (door_stream.Emitter), numbered as Responses numbers them."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.spaces = namespaces(request.tools)[1]
        self.id = _id("resp")
        self.created = int(time.time())
        self.sequence = 0
        self.message_id: str | None = None
        self.sent = ""

    def response(self, done: Completed | None, output: list[dict], status: str | None = None) -> dict:
        r = self.request
        incomplete = done is not None and done.finish == "length"
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status or ("incomplete" if incomplete else "completed"),
            "model": r.model or MODEL_NAME, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions, "metadata": r.metadata or {},
            # absent: the default (true); sent, as sent (null included)
            "parallel_tool_calls": r.parallel_tool_calls if "parallel_tool_calls" in r.model_fields_set else True,
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "temperature": r.temperature,
            "top_p": r.top_p, "max_output_tokens": r.max_output_tokens, "previous_response_id": None, "store": False,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": None}
        if done is not None:
            body["usage"] = {"input_tokens": done.prompt_tokens,
                             "input_tokens_details": {"cached_tokens": done.cached_tokens},
                             "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": done.prompt_tokens + done.completion_tokens}
        return body

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n"

    def start(self, prompt_tokens: int) -> bytes:
        created = self.response(None, [], "in_progress")
        return self._event("response.created", response=created) + self._event("response.in_progress",
                                                                               response=created)

    def _open_message(self) -> bytes:
        self.message_id = _id("msg")
        return (self._event("response.output_item.added", output_index=0,
                            item=_message_item(self.message_id, "", "in_progress"))
                + self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []}))

    def text(self, delta: str, tokens: list[tuple[int, float]]) -> bytes:
        out = b"" if self.message_id else self._open_message()
        self.sent += delta
        return out + self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=delta, logprobs=[])

    def finish(self, done: Completed) -> bytes:
        out, output = [], []
        if self.message_id is None and (done.content or not done.calls):
            out.append(self._open_message())
        if self.message_id is not None:
            part = {"type": "output_text", "text": self.sent, "annotations": [], "logprobs": []}
            item = _message_item(self.message_id, self.sent)
            out += [self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                content_index=0, text=self.sent, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=0, item=item)]
            output.append(item)
        for call in done.calls:
            index, item_id, arguments = len(output), _id("fc"), json.dumps(call.arguments)
            call_id = _id("call")
            out += [self._event("response.output_item.added", output_index=index,
                                item=_call_item(item_id, call_id, call.name, "", self.spaces, "in_progress")),
                    self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                delta=arguments),
                    self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                name=call.name, arguments=arguments)]
            item = _call_item(item_id, call_id, call.name, arguments, self.spaces)
            out.append(self._event("response.output_item.done", output_index=index, item=item))
            output.append(item)
        final = self.response(done, output)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=final))
        return b"".join(out)

    def error(self, status: int, message: str, code: str) -> bytes:
        failed = self.response(None, [], "failed")
        failed["error"] = {"code": "server_error" if status >= 500 else code, "message": message}
        return self._event("response.failed", response=failed)
