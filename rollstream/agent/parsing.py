"""Tool calls in the Hermes / Qwen3 format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
parsed from the decoded text of a model turn (text is only parsed; ids stay the truth)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def as_message(self) -> dict:
        """The assistant message's `tool_calls` entry, as chat templates expect it."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class MalformedToolCall:
    raw: str
    error: str


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text outside the tool-call blocks
    calls: list[ToolCall | MalformedToolCall]


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split a model turn into plain content and tool calls; a block that is not valid JSON
    with a string `name` and an object `arguments` becomes a MalformedToolCall with a reason
    the model can act on."""
    calls: list[ToolCall | MalformedToolCall] = []
    for match in TOOL_CALL_RE.finditer(text):
        raw, closed = match.group(1).strip(), bool(match.group(2))
        calls.append(_parse_one(raw, closed))
    content = TOOL_CALL_RE.sub("", text).strip()
    return ParsedTurn(content=content, calls=calls)


def reply_calls(text: str) -> tuple[str, list[ToolCall]] | None:
    """The content and calls of a reply whose every ``<tool_call>`` block parses, or None (no
    call, or a malformed one: the text is then the reply, as the model wrote it). The content is
    the text before the first call, as a harness streaming the reply sees it."""
    parsed = parse_tool_calls(text)
    calls = [c for c in parsed.calls if isinstance(c, ToolCall)]
    if not calls or len(calls) != len(parsed.calls):
        return None
    return text[: text.index(TOOL_CALL_OPEN)].rstrip(), calls


def _parse_one(raw: str, closed: bool) -> ToolCall | MalformedToolCall:
    if not closed:
        return MalformedToolCall(raw, "the <tool_call> block is not closed with </tool_call>")
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        return MalformedToolCall(raw, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return MalformedToolCall(raw, 'the tool call needs a JSON object with a string "name"')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models send arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return MalformedToolCall(raw, f'"arguments" is a string that is not JSON ({exc.msg})')
    if not isinstance(arguments, dict):
        return MalformedToolCall(raw, '"arguments" must be a JSON object')
    return ToolCall(payload["name"], arguments)


def malformed_call_observation(call: MalformedToolCall) -> str:
    """What the model reads after a tool call that could not be parsed: why, and the form."""
    return (
        f"Error: could not parse tool call: {call.error}. "
        'Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    )
