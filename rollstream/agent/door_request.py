"""What a chat-completions request to the door asks for, checked field by field (agent/gateway.py
serves it; the other APIs' modules check theirs with the helpers here): every parameter the door
accepts is applied, and every one it cannot honour is refused with a 400 that names it. Sampling
stays the job's (the trainer's policy): the request's temperature and top_p are replaced by the
job's, a seed is used where the job sets none, and parameters that would change the distribution
in ways the job's sampling does not say (penalties, logit_bias) or that need constrained decoding
(tool_choice "required" or a named function, response_format JSON) are refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard


class DoorError(Exception):
    """A call the door answers with an OpenAI-style error instead of a completion. 4xx errors
    are permanent (clients do not retry them); 5xx are the service's."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.kind, self.param = status, code, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code, "param": self.param}}


def refuse(param: str, message: str, code: str = "unsupported_parameter") -> DoorError:
    return DoorError(400, message, code, param=param)


# The name the door serves its job's model by (GET /v1/models lists it; presets render it as {model}).
MODEL_NAME = "rollstream"


def check_model(request: dict, served: tuple[str, ...]) -> None:
    """The request's ``model`` is one the door serves, or a 404 as each API answers a model it does
    not serve (OpenAI: code model_not_found; Anthropic: not_found_error), which clients take as
    final. A request without one gets the served model, as vLLM serves it."""
    model = request.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise refuse("model", "model must be a string", "invalid_value")
    if model not in served:
        raise DoorError(404, f"The model `{model}` does not exist or is not served here; this door serves "
                        f"{', '.join(served)} (GET /v1/models lists it)", "model_not_found", param="model")


# The client's bookkeeping for its provider's service (nothing asked of the generation), checked as
# each API types it: a junk value is refused, never carried silently. agent/door_models.py types the same.
_STRING_FIELDS = ("model", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention")
_OBJECT_FIELDS = ("metadata", "client_metadata", "reasoning", "cache_control")
OPENAI_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
ANTHROPIC_SERVICE_TIERS = ("auto", "standard_only")


def check_bookkeeping(request: dict, service_tiers: tuple[str, ...], string_metadata: bool = True) -> None:
    """Strings and objects where the API has them, a known service tier, and (OpenAI) metadata
    whose values are strings."""
    for name in _STRING_FIELDS:
        if request.get(name) is not None and not isinstance(request[name], str):
            raise refuse(name, f"{name} must be a string", "invalid_value")
    for name in _OBJECT_FIELDS:
        if request.get(name) is not None and not isinstance(request[name], dict):
            raise refuse(name, f"{name} must be an object", "invalid_value")
    metadata = request.get("metadata")
    if string_metadata and metadata and not all(isinstance(v, str) for v in metadata.values()):
        raise refuse("metadata", "metadata values must be strings", "invalid_value")
    tier = request.get("service_tier")
    if tier is not None and tier not in service_tiers:
        raise refuse("service_tier", f"service_tier must be one of {', '.join(service_tiers)}", "invalid_value")


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
# Fields that ask nothing of the generation (bookkeeping for the client's own provider).
_BOOKKEEPING = ("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention")
# Sampling knobs the job's sampling decides (see the module docstring): validated, then replaced.
_JOB_SAMPLING = ("temperature", "top_p", "top_k", "min_p")
_ACCEPTED = frozenset({
    "messages", "model", "tools", "tool_choice", "parallel_tool_calls", "stop", "max_tokens", "max_completion_tokens",
    "n", "logprobs", "top_logprobs", "response_format", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "stream", "stream_options", "store", *_BOOKKEEPING, *_JOB_SAMPLING})


@dataclass
class CallOptions:
    """A validated request: what the door renders, asks the backend for and returns."""

    messages: list[dict]
    tools: list[dict] | None  # as the chat template shows them; None when none (or tool_choice "none")
    parse_tool_calls: bool  # False with tool_choice "none": the reply is the model's text
    parallel_tool_calls: bool
    stop: list[str]
    max_tokens: int | None  # what the client asked; the door caps it by the job's limits
    logprobs: bool
    seed: int | None
    stream: bool
    include_usage: bool


def parse_request(request: dict) -> CallOptions:
    """``request`` (a chat-completions body) as CallOptions, or a DoorError naming the parameter."""
    unknown = sorted(set(request) - _ACCEPTED)
    if unknown:
        raise refuse(unknown[0], f"parameter {unknown[0]!r} is not supported by this door; it serves "
                      f"{', '.join(sorted(_ACCEPTED))}")
    check_bookkeeping(request, OPENAI_SERVICE_TIERS)
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise DoorError(400, "messages must be a non-empty list of message objects", "invalid_messages",
                        param="messages")
    for i, message in enumerate(messages):
        _check_message(i, message)
    tools = _tools(request.get("tools"))
    parse_calls = tool_choice_parses(request.get("tool_choice"), tools)
    if not parse_calls:
        tools = None  # "none": the model is shown no tools and its text is returned as text
    stream = flag(request, "stream", False)
    stream_options = request.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise refuse("stream_options", "stream_options is only allowed with stream: true", "invalid_value")
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage", "include_obfuscation"}:
            raise refuse("stream_options", "stream_options takes include_usage (and include_obfuscation, which "
                          "this door, serving loopback, never pads)", "invalid_value")
        include_usage = flag(stream_options, "include_usage", False)
        flag(stream_options, "include_obfuscation", False)
    if request.get("n") not in (None, 1):
        raise refuse("n", "this door serves n=1 (each call is one recorded sample); send the call again for "
                      "another sample", "unsupported_n")
    logprobs = flag(request, "logprobs", False)
    top = request.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= 20:
            raise refuse("top_logprobs", "top_logprobs must be an integer from 0 to 20", "invalid_value")
        if top > 0:
            raise refuse("top_logprobs", "this door returns the sampled token's logprob only (logprobs: true); "
                          "top_logprobs must be 0 or unset")
    _response_format(request.get("response_format"))
    for name in ("presence_penalty", "frequency_penalty"):
        _no_change(request, name, 0.0)
    _no_change(request, "repetition_penalty", 1.0)
    if request.get("logit_bias"):
        raise refuse("logit_bias", "logit_bias would change the policy's distribution, and the recorded logprobs "
                      "with it; leave it unset (the job's sampling decides how the model samples)")
    check_job_sampling(request)
    if request.get("store"):
        raise refuse("store", "completions are not stored by this door (the job's trajectory is the record); "
                      "leave store unset or false")
    seed = request.get("seed")
    if seed is not None and not is_int(seed):
        raise refuse("seed", "seed must be an integer", "invalid_value")
    return CallOptions(messages=messages, tools=tools, parse_tool_calls=parse_calls,
                       parallel_tool_calls=flag(request, "parallel_tool_calls", True),
                       stop=stop_strings(request.get("stop")),
                       max_tokens=_max_tokens(request), logprobs=logprobs, seed=seed, stream=stream,
                       include_usage=include_usage)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_message(index: int, message: dict) -> None:
    """A message the chat template can show as it is: a known role, text content only (an image
    or audio part would be dropped from the prompt, not seen by the model)."""
    role = message.get("role")
    if role not in _ROLES:
        raise DoorError(400, f"messages[{index}].role must be one of {', '.join(_ROLES)} (got {role!r}); the legacy "
                        "'function' role is not served: use tools and 'tool' messages", "invalid_messages",
                        param=f"messages[{index}].role")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    parts = content if isinstance(content, list) else [content]
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal") or not isinstance(part.get(kind), str):
            raise DoorError(400, f"messages[{index}].content holds a {kind or type(part).__name__!s} part; this door "
                            "serves a text model: send text parts ({\"type\": \"text\", \"text\": ...}) only",
                            "unsupported_content", param=f"messages[{index}].content")


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise refuse(name, f"{name} must be true or false", "invalid_value")
    return value


def check_job_sampling(request: dict, names: tuple[str, ...] = _JOB_SAMPLING) -> None:
    """The sampling knobs the job's sampling replaces (see the module docstring): numbers, or refused."""
    for name in names:
        value = request.get(name)
        if value is not None and not is_number(value):
            raise refuse(name, f"{name} must be a number", "invalid_value")


def _no_change(request: dict, name: str, neutral: float) -> None:
    value = request.get(name)
    if value is None:
        return
    if not is_number(value):
        raise refuse(name, f"{name} must be a number", "invalid_value")
    if value != neutral:
        raise refuse(name, f"{name}={value} would change the policy's distribution, and the recorded logprobs "
                      f"with it; leave it unset or {neutral:g} (the job's sampling decides how the model samples)")


def _tools(raw: Any) -> list[dict] | None:
    if not raw:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise DoorError(400, "tools must be a list of tool objects", "invalid_tools", param="tools")
    out = []
    for tool in raw:
        fn = tool.get("function")
        named = isinstance(fn, dict) and isinstance(fn.get("name"), str)
        if tool.get("type", "function") != "function" or not named:
            raise DoorError(400, 'each tool must be {"type": "function", "function": {"name": ..., "parameters": '
                            '...}}; this door serves function tools only', "invalid_tools", param="tools")
        # The tool as the chat template shows it: API-only flags (strict) are the client's business.
        out.append({**tool, "function": {k: v for k, v in fn.items() if k != "strict"}})
    return out


def function_tools(raw: Any, kind: str, default_kind: str | None, schema: str, served: str) -> list[dict] | None:
    """Another API's tools as the chat template's function tools (name, description, parameters,
    in OpenAI's order, as templates show them): those whose ``type`` (``default_kind`` when
    absent) is ``kind``; any other is refused, naming it and saying what ``served`` is."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise DoorError(400, "tools must be a list", "invalid_tools", param="tools")
    out = []
    for i, tool in enumerate(raw):
        got = tool.get("type", default_kind) if isinstance(tool, dict) else None
        if got != kind or not isinstance(tool.get("name"), str):
            raise DoorError(400, f"tools[{i}] is a {got!r} tool; this door serves {served}", "unsupported_tool",
                            param=f"tools[{i}]")
        function = {"name": tool["name"]}
        for key, name in (("description", "description"), (schema, "parameters")):
            if tool.get(key) is not None:
                function[name] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def tool_choice_parses(choice: Any, tools: list[dict] | None, param: str = "tool_choice") -> bool:
    """Whether tool calls are rendered and parsed. "auto" (the default) and "none" are honoured;
    "required" and a named function would need decoding constrained to a tool call, which
    this door does not do (vLLM does it with guided decoding): refused rather than not kept."""
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    if choice == "required" or isinstance(choice, dict):
        what = "required" if choice == "required" else "a named function"
        raise refuse(param, f"tool_choice {what} needs decoding constrained to a tool call, which this door "
                      "does not do: the model would be free to answer without one. Send tool_choice 'auto' (or "
                      "leave it unset) and handle a reply without tool calls", "unsupported_tool_choice")
    raise refuse(param, "tool_choice must be 'auto', 'none', 'required' or a named function", "invalid_value")


def _response_format(fmt: Any) -> None:
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise refuse("response_format", f"response_format {kind} needs constrained decoding, which this door does "
                      "not do; ask for JSON in the prompt and parse the reply")
    raise refuse("response_format", "response_format must be {\"type\": \"text\"}", "invalid_value")


def stop_strings(raw: Any, param: str = "stop") -> list[str]:
    stops = [raw] if isinstance(raw, str) else raw
    if stops is None:
        return []
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise refuse(param, f"{param} must be a string or a list of up to {MAX_STOP_STRINGS} non-empty strings of at "
                      f"most {MAX_STOP_CHARS} characters", "invalid_value")
    return list(dict.fromkeys(stops))


def _max_tokens(request: dict) -> int | None:
    """max_completion_tokens, else max_tokens (the older name), as vLLM reads them; each one sent
    is checked, the one not read too (a junk value is the client's mistake, not silence)."""
    found = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = request.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise refuse(name, f"{name} must be a positive integer", "invalid_value")
        found = value if found is None else found
    return found


def cut_at_stop(text: str, stops: list[str], include_stop: bool, start: int = 0) -> str | None:
    """``text`` cut where the earliest of ``stops`` at or after ``start`` occurs (as the backend
    stopped: vLLM and the built-in server search from the end of the first ``min_tokens``), or
    None if none occurs. The backend ends on the token that completes the match; that token is
    kept in the trajectory, and the text is cut here (before the stop string unless ``include_stop``)."""
    hits = [(at, s) for s in stops for at in [text.find(s, start)] if at >= 0]
    if not hits:
        return None
    at, matched = min(hits)
    return text[: at + len(matched)] if include_stop else text[:at]
