"""Hermes tool-call parsing and the chat-template token bookkeeping, without a server."""

from __future__ import annotations

import pytest

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.parsing import MalformedToolCall, ToolCall, parse_tool_calls
from rollstream.agent.tools import FunctionToolBox, function_schema

from .scripted_model import TOOLS, prompt


def test_parses_hermes_tool_calls_and_keeps_the_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    turn = parse_tool_calls(text)
    assert turn.content == "Let me compute."
    assert turn.calls == [ToolCall("calculator", {"expression": "1+2"})]


def test_several_calls_and_arguments_given_as_a_json_string():
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
    )
    assert parse_tool_calls(text).calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>{"name": "a", "arguments": {</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "a", "argu', "not closed"),
    ],
)
def test_malformed_calls_say_what_is_wrong(text, reason):
    (call,) = parse_tool_calls(text).calls
    assert isinstance(call, MalformedToolCall) and reason in call.error


def test_observation_ids_are_the_template_delta_after_the_models_end_token(tokenizer):
    renderer = ChatRenderer(tokenizer, TOOLS)
    history = prompt("Q") + [{"role": "assistant", "content": "hi"}]
    tool = [{"role": "tool", "name": "calculator", "content": "42"}]
    ended = renderer.observation_ids(history, tool, model_ended_turn=True)
    cut = renderer.observation_ids(history, tool, model_ended_turn=False)
    assert tokenizer.decode(ended, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert cut == [renderer.end_of_turn_id] + ended
    # prompt + model turn + observation == the template's rendering of the whole exchange
    model_turn = renderer.encode("hi") + [renderer.end_of_turn_id]
    full = renderer.prompt_ids(prompt("Q")) + model_turn + ended
    assert full == renderer.prompt_ids(history + tool)


async def test_function_tool_box_turns_failures_into_error_outputs():
    def divide(a: int, b: int) -> str:
        return str(a / b)

    box = FunctionToolBox().add(function_schema("divide", "a/b", {"a": {}, "b": {}}), divide)
    assert (await box.call("divide", {"a": 6, "b": 3})).text == "2.0"
    zero = await box.call("divide", {"a": 1, "b": 0})
    assert not zero.ok and "ZeroDivisionError" in zero.text
    assert not (await box.call("divide", {"a": 1})).ok
    unknown = await box.call("nope", {})
    assert not unknown.ok and "available: divide" in unknown.text
