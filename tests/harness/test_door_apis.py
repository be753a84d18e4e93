"""The door's OpenAI Responses and Anthropic Messages APIs and its real streaming, through the
official client libraries (``openai``'s responses.create / responses.stream, ``anthropic``'s
messages.create / messages.stream) against a real built-in server: the recorded ids are the
backend's own, tool calls round-trip in each API's own form and extend the same exact sequence,
the first streamed text reaches the harness while the backend is still generating, and a bad
request is a 400 in the API's own error format."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI

from rollstream.agent.door_stream import ReplyText
from rollstream.agent.harness import HarnessContext
from rollstream.agent.harnesses.openai_chat import SUBMIT
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import Generation
from rollstream.llm.session import LLMSession
from rollstream.tasks import arith

from .conftest import GREEDY
from .test_gateway import RecordingClient

CHAT_TOOLS = [arith.BASH_SCHEMA, SUBMIT]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]


def _system_and_user() -> tuple[str, str]:
    system, user = arith.prompt({"a": 12, "op": "+", "b": 30})
    return system["content"], user["content"]


def _assert_exact(door) -> None:
    """Every call's prompt is its segment up to the call, and its completion follows unchanged."""
    traj = door.recorder.trajectory()
    for index, (call, (sent, gen)) in enumerate(zip(traj.extra["calls"], door.backend.calls, strict=True)):
        seg = traj.segments[call["segment"]]
        assert index in seg.call_indices
        sequence, offset = seg.prompt_ids + seg.response_ids, call["prompt_tokens"]
        assert sequence[:offset] == sent
        assert sequence[offset:offset + len(gen.token_ids)] == gen.token_ids
        start = offset - len(seg.prompt_ids)
        assert seg.logprobs[start:start + len(gen.token_ids)] == gen.logprobs
        assert seg.loss_mask[start:start + len(gen.token_ids)] == [1] * len(gen.token_ids)


async def test_responses_round_trip_a_function_call_and_the_streamed_follow_up_extends_the_same_sequence(door):
    system, user = _system_and_user()
    # as Codex 0.169 sends them: some functions grouped in a namespace, and its client_metadata
    tools = [{"type": "namespace", "name": "shell", "description": "Shell tools.", "tools": RESPONSES_TOOLS[:1]},
             *RESPONSES_TOOLS[1:]]
    first = await door.client.responses.create(model="rollstream", instructions=system, input=user, tools=tools,
                                               store=False,
                                               extra_body={"client_metadata": {"turn_id": "1"}})
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "bash" and "command" in json.loads(calls[0].arguments)
    assert calls[0].namespace == "shell"  # the call names the namespace of its function
    assert first.usage.input_tokens == len(door.backend.calls[0][0])
    # Codex's loop: the whole input again, the response's items, each call's output; streamed.
    follow_up = [{"role": "user", "content": user}, *[item.model_dump(exclude_none=True) for item in first.output],
                 *[{"type": "function_call_output", "call_id": c.call_id, "output": "42\n"} for c in calls]]
    async with door.client.responses.stream(model="rollstream", instructions=system, input=follow_up, tools=tools,
                                            store=False) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert final.status == "completed" and final.output
    assert [c["segment"] for c in door.recorder.trajectory().extra["calls"]] == [0, 0]
    _assert_exact(door)


async def test_anthropic_round_trips_tool_use_and_the_streamed_follow_up_extends_the_same_sequence(door):
    system, user = _system_and_user()
    # as Claude Code sends it: context editing it cannot switch off (the door renders the history whole)
    editing = {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
    first = await door.anthropic.messages.create(model="rollstream", max_tokens=40, system=system,
                                                 tools=ANTHROPIC_TOOLS,
                                                 messages=[{"role": "user", "content": user}], extra_body=editing)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses[0].name == "bash" and "command" in uses[0].input
    counted = await door.anthropic.messages.count_tokens(model="rollstream", system=system, tools=ANTHROPIC_TOOLS,
                                                         messages=[{"role": "user", "content": user}])
    assert counted.input_tokens == len(door.backend.calls[0][0])
    # Claude Code's loop: the assistant's blocks back, then a user turn of tool_result blocks.
    history = [{"role": "user", "content": user},
               {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "42\n"}
                                            for u in uses]},
               # as Claude Code 2.1 sends its environment: a system message amid the turns
               {"role": "system", "content": [{"type": "text", "text": "The working directory is /work."}]}]
    async with door.anthropic.messages.stream(model="rollstream", max_tokens=40, system=system, tools=ANTHROPIC_TOOLS,
                                              messages=history) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert final.stop_reason in ("end_turn", "tool_use", "max_tokens") and final.content
    assert [c["segment"] for c in door.recorder.trajectory().extra["calls"]] == [0, 0]
    _assert_exact(door)


class HeldBackend(RecordingClient):
    """The real link, paused after the first tokens it passes on until the test releases it: what
    the harness has received by then was sent while the backend was still generating."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.finished = False

    async def generate_stream(self, base_url, prompt_ids, params, on_tokens, timeout_s=None):
        async def held(ids, logprobs):
            await on_tokens(ids, logprobs)
            await self.release.wait()

        gen = await super().generate_stream(base_url, prompt_ids, params, held, timeout_s)
        self.finished = True
        return gen


async def _first_text(api: str, client, system: str, user: str):
    """The streamed call of ``api`` (no tool calls parsed: all its text is text); yields each text
    delta as the harness's SDK delivers it."""
    if api == "chat":
        stream = await client.chat.completions.create(model="rollstream", stream=True, tool_choice="none", messages=[
            {"role": "system", "content": system}, {"role": "user", "content": user}])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content
    elif api == "responses":
        async with client.responses.stream(model="rollstream", instructions=system, input=user, store=False,
                                           tool_choice="none") as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    yield event.delta
    else:
        async with client.messages.stream(model="rollstream", max_tokens=40, system=system,
                                          tool_choice={"type": "none"},
                                          messages=[{"role": "user", "content": user}]) as stream:
            async for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    yield event.delta.text


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
async def test_the_first_text_reaches_the_harness_while_the_backend_is_still_generating(
        api, gateway, arith_server, tokenizer):
    backend = HeldBackend()
    door = gateway.open(f"job-{api}", LLMSession(backend, "job", backend_url=arith_server), tokenizer,
                        AgentSettings(max_tokens_per_turn=48, sampling=GREEDY))
    client = anthropic.AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=door.key) \
        if api == "anthropic" else AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    system, user = _system_and_user()
    pieces = []

    async def read() -> None:
        async for piece in _first_text(api, client, system, user):
            if not pieces:
                # the backend is paused after its first tokens: it has not finished generating
                assert not backend.finished and len(backend.calls) == 0
                backend.release.set()
            pieces.append(piece)

    try:
        await asyncio.wait_for(read(), 120)
    finally:
        backend.release.set()
        await client.close()
        await backend.aclose()
    gen = backend.calls[0][1]
    assert backend.finished and len(gen.token_ids) > 1
    # what was streamed is the reply the trajectory's next call must echo
    assert "".join(pieces) == door.recorder.chains[0].messages[-1]["content"]
    assert door.recorder.segments[0].response_ids == gen.token_ids


async def test_a_streamed_reply_never_shows_text_past_a_stop_string(door, tokenizer):
    system, user = _system_and_user()
    # The greedy reply is '<tool_call>\n{"name": "bash", ...': "as" ends inside the token "bash".
    stream = await door.client.chat.completions.create(model="rollstream", stream=True, stop=["as"], tools=CHAT_TOOLS,
                                                       messages=[{"role": "system", "content": system},
                                                                 {"role": "user", "content": user}])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    gen = door.backend.calls[0][1]
    whole = tokenizer.decode(gen.token_ids, skip_special_tokens=False)
    assert "as" in whole and text == whole[:whole.find("as")]
    assert door.recorder.segments[0].response_ids == gen.token_ids
    # Token by token, the text shown never reaches into a stop string before it is known to be one.
    reply = "Let me compute: 12 + 30 = 42, as asked."
    held = ReplyText(tokenizer, None, ["= 4"], tool_calls=True)
    shown = "".join(held.feed([i], [0.0])[0] for i in tokenizer.encode(reply, add_special_tokens=False))
    assert shown == "Let me compute: 12 + 30"  # the space before "= 4" waits too: it may precede a call


def test_streamed_text_never_splits_a_character_whose_bytes_span_tokens(tokenizer):
    text = "crab 🦀 naïve 中文"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some character is split over tokens
    stream = ReplyText(tokenizer, None, [], tool_calls=False)
    pieces = [stream.feed([i], [0.0])[0] for i in ids]
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == text


@pytest.mark.parametrize(("api", "body", "param"), [
    ("responses", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ("responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input[0].content"),
    ("responses", {"input": "hi", "tool_choice": "required", "tools": RESPONSES_TOOLS}, "tool_choice"),
    ("responses", {"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),  # no stream
    ("responses", {"input": "hi", "text": {"format": {"type": "json_object"}}}, "text"),
    ("anthropic", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"},
                   "tools": ANTHROPIC_TOOLS}, "tool_choice"),
    ("anthropic", {"messages": [{"role": "user", "content": "hi"}],
                   "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ("anthropic", {"messages": [{"role": "user", "content": "hi"}], "extra_body": {"context_management": "all"}},
     "context_management"),
    ("anthropic", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[0].content[0]"),
])
async def test_a_bad_request_is_a_400_in_the_apis_own_error_format(door, api, body, param):
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as refused:
        if api == "responses":
            await door.client.responses.create(model="rollstream", **body)
        else:
            await door.anthropic.messages.create(model="rollstream", max_tokens=8, **body)
    error = refused.value.body
    if api == "responses":
        assert error["param"] == param and error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert param in error["error"]["message"]
    assert not door.backend.calls and not door.recorder.calls


async def test_errors_on_the_anthropic_path_are_anthropic_errors_and_x_api_key_opens_the_door(door, gateway):
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        wrong = await http.post("/messages", headers={"x-api-key": "rs-not-a-job"}, content=b"{}")
        bad_json = await http.post("/messages", headers={"x-api-key": door.key}, content=b"{not json")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"
    assert bad_json.json()["error"]["type"] == "invalid_request_error"


class ThinkingBackend:
    """A backend whose every turn opens with the model's thinking (the tiny model has none to
    give): the door's answer in Anthropic's thinking and text blocks is under test, not a model."""

    def __init__(self, tokenizer) -> None:
        self.text = "<think>\nLet me add 12 and 30.\n</think>\n\nThe answer is 42."
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ids = tokenizer.encode(self.text, add_special_tokens=False) + [end]
        self.prompts: list[list[int]] = []

    async def generate(self, base_url, prompt_ids, params, timeout_s=None) -> Generation:
        self.prompts.append(list(prompt_ids))
        return Generation(token_ids=self.ids, logprobs=[-0.5] * len(self.ids), finish_reason="stop", backend=base_url)

    async def generate_stream(self, base_url, prompt_ids, params, on_tokens, timeout_s=None) -> Generation:
        gen = await self.generate(base_url, prompt_ids, params, timeout_s)
        for token_id in gen.token_ids:  # token by token: the tags arrive split from the text around them
            await on_tokens([token_id], [-0.5])
        return gen


async def test_the_models_thinking_is_a_thinking_block_and_sent_back_it_extends_the_same_sequence(gateway, tokenizer):
    backend = ThinkingBackend(tokenizer)
    door = gateway.open("job-t", LLMSession(backend, "job-t", backend_url="http://backend"), tokenizer,
                        AgentSettings())
    client = anthropic.AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=door.key, max_retries=0)
    system, user = _system_and_user()
    try:
        whole = await client.messages.create(model="rollstream", max_tokens=64, system=system,
                                             messages=[{"role": "user", "content": user}])
        history = [{"role": "user", "content": user},
                   {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
                   {"role": "user", "content": "Are you sure?"}]
        async with client.messages.stream(model="rollstream", max_tokens=64, system=system, messages=history) as stream:
            deltas = [event.delta.type async for event in stream if event.type == "content_block_delta"]
            streamed = await stream.get_final_message()
    finally:
        await client.close()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
        ("thinking", "\nLet me add 12 and 30.\n"), ("text", "\n\nThe answer is 42.")]
    assert [b.model_dump(exclude_none=True) for b in streamed.content] == \
        [b.model_dump(exclude_none=True) for b in whole.content]
    assert "thinking_delta" in deltas and "text_delta" in deltas
    # the thinking block sent back is the model's text again: the second call extends the first
    assert [c["segment"] for c in door.recorder.trajectory().extra["calls"]] == [0, 0]
    assert backend.prompts[1][:len(backend.prompts[0]) + len(backend.ids)] == backend.prompts[0] + backend.ids


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
async def test_a_backend_lost_once_a_stream_began_ends_it_with_an_error_in_the_apis_own_form(api, gateway, tokenizer):
    door = gateway.open(f"job-{api}", LLMSession(RecordingClient(), "job", backend_url="http://127.0.0.1:9",
                                                 max_backend_attempts=1), tokenizer, AgentSettings())
    client = anthropic.AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=door.key, max_retries=0) \
        if api == "anthropic" else AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    system, user = _system_and_user()
    try:
        if api == "responses":  # Responses reports a failed response as its own event
            async with client.responses.stream(model="rollstream", instructions=system, input=user,
                                               store=False) as stream:
                kinds = [event.type async for event in stream]
            assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
        else:
            with pytest.raises((openai.APIError, anthropic.APIError), match="no backend could serve"):
                async for _ in _first_text(api, client, system, user):
                    pass
    finally:
        await client.close()
    assert door.ended == "error" and not door.recorder.calls


class ToolContext(HarnessContext):
    """A harness context whose tools answer at once (the loop through the door is under test)."""

    async def call_tool(self, name: str, arguments: dict) -> str:
        return "42\n"


@pytest.mark.parametrize("loop", ["codex_like", "claude_like"])
async def test_the_readmes_responses_and_anthropic_loops_run_through_the_door_and_extend_one_sequence(
        loop, gateway, arith_server, tokenizer):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    source = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if f"def {loop}(" in block)
    namespace: dict = {}
    exec(compile(source, f"README.md:{loop}", "exec"), namespace)  # noqa: S102 (the block as a user copies it)
    backend = RecordingClient()
    settings = AgentSettings(max_turns=3, max_tokens_per_turn=48, sampling=GREEDY)
    door = gateway.open("job-r", LLMSession(backend, "job-r", backend_url=arith_server), tokenizer, settings)
    door.backend = backend
    ctx = ToolContext(job_id="job-r", instance={}, messages=arith.prompt({"a": 12, "op": "+", "b": 30}),
                      tools=CHAT_TOOLS, base_url=gateway.base_url, api_key=door.key, settings=settings)
    try:
        await namespace[loop](ctx)
    finally:
        await backend.aclose()
    calls = door.recorder.trajectory().extra["calls"]
    assert len(calls) >= 2 and all(c["extended"] for c in calls[1:])  # one exact sequence, call after call
    _assert_exact(door)


async def test_a_prompt_past_the_jobs_context_is_refused_in_the_words_claude_code_compacts_on(
        gateway, arith_server, tokenizer):
    door = gateway.open("job-x", LLMSession(RecordingClient(), "job-x", backend_url=arith_server), tokenizer,
                        AgentSettings(max_context_tokens=16))
    client = anthropic.AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=door.key, max_retries=0)
    system, user = _system_and_user()
    try:
        with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 16 maximum") as refused:
            await client.messages.create(model="rollstream", max_tokens=8, system=system,
                                         messages=[{"role": "user", "content": user}])
    finally:
        await client.close()
    assert refused.value.body["error"]["type"] == "invalid_request_error" and door.ended == "context"
