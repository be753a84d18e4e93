"""Every parameter the door accepts is applied, and every one it cannot honour is refused with a
400 naming it, as the real ``openai`` client sends them to a door on a real built-in server:
stop strings cut the reply where the backend stopped while the trajectory keeps each token up
to the one that completed the match (as vLLM returns them), tool_choice "none" shows the model
no tools, a seed and max_completion_tokens reach the backend, logprobs are the backend's own,
parallel_tool_calls=false keeps the first call (as vLLM does). A model the door does not serve is
refused as each real API refuses one (a 404 its clients take as final), streaming or not, and a
parameter another one overrides (max_tokens beside max_completion_tokens) is still checked."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from openai import AsyncOpenAI

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.harnesses.openai_chat import SUBMIT
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import Generation, SamplingParams, VLLMClient
from rollstream.llm.session import LLMSession
from rollstream.tasks import arith

from .conftest import GREEDY
from .test_gateway import RecordingClient

TOOLS = [arith.BASH_SCHEMA, SUBMIT]


def _messages() -> list[dict]:
    return arith.prompt({"a": 12, "op": "+", "b": 30})


async def test_a_stop_string_cuts_the_reply_and_the_trajectory_keeps_the_tokens_up_to_the_one_that_matched(
        door, tokenizer, arith_server):
    # The greedy reply is '<tool_call>\n{"name": "bash", ...': "as" ends inside the token "bash".
    reply = await door.client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS,
                                                      stop=["as"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    recorded = list(door.recorder.segments[0].response_ids)
    assert recorded == door.backend.calls[0][1].token_ids  # the backend's ids, unchanged
    text = tokenizer.decode(recorded, skip_special_tokens=False)
    # the text ends before the stop string; the last recorded token is the one that completed it
    assert choice.message.content == text[:text.find("as")] and "as" not in choice.message.content
    assert "as" not in tokenizer.decode(recorded[:-1]) and tokenizer.decode(recorded).endswith("bash")
    # exactly what the model produces unstopped, up to that token
    again = await VLLMClient().generate(arith_server, door.backend.calls[0][0], GREEDY)
    assert again.token_ids[:len(recorded)] == recorded and len(again.token_ids) > len(recorded)
    # The harness sends back the message it got: the next call extends the same exact sequence.
    messages = [*_messages(), {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": "go on"}]
    await door.client.chat.completions.create(model="rollstream", messages=messages, tools=TOOLS, stop="as")
    calls = door.recorder.trajectory().extra["calls"]
    assert [c["segment"] for c in calls] == [0, 0]
    assert door.backend.calls[1][0][:len(door.backend.calls[0][0]) + len(recorded)] == \
        door.backend.calls[0][0] + recorded


async def test_tool_choice_none_shows_the_model_no_tools_and_returns_its_text(door, tokenizer):
    reply = await door.client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS,
                                                      tool_choice="none")
    sent, gen = door.backend.calls[0]
    assert sent == ChatRenderer(tokenizer).prompt_ids(_messages())  # rendered without the tools
    assert reply.choices[0].message.tool_calls is None
    ended = gen.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert reply.choices[0].message.content == tokenizer.decode(gen.token_ids[:-1] if ended else gen.token_ids,
                                                                skip_special_tokens=False)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "bash"}}])
async def test_a_tool_choice_that_needs_constrained_decoding_is_refused_before_any_generation(door, tool_choice):
    with pytest.raises(openai.BadRequestError, match="constrained") as refused:
        await door.client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS,
                                                  tool_choice=tool_choice)
    assert refused.value.code == "unsupported_tool_choice" and refused.value.param == "tool_choice"
    assert not door.backend.calls and not door.recorder.calls


UNHONOURED = [
    ("n", {"n": 2}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": -0.5}),
    ("logit_bias", {"logit_bias": {"17": 5}}),
    ("store", {"store": True}),
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("max_tokens", {"max_completion_tokens": 5, "max_tokens": 0}),  # checked though max_completion_tokens wins
    ("max_tokens", {"max_completion_tokens": 5, "max_tokens": "all"}),
    ("stop", {"stop": [f"s{i}" for i in range(17)]}),
    ("stop", {"stop": [""]}),
    ("seed", {"seed": "seven"}),
    ("best_of", {"extra_body": {"best_of": 2}}),  # a vLLM/legacy parameter the door does not serve
    ("functions", {"extra_body": {"functions": [{"name": "bash"}]}}),  # the legacy form of tools
]


@pytest.mark.parametrize(("param", "fields"), UNHONOURED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(UNHONOURED)])
async def test_a_parameter_the_door_cannot_honour_is_refused_with_a_400_naming_it(door, param, fields):
    with pytest.raises(openai.BadRequestError) as refused:
        await door.client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS, **fields)
    assert refused.value.param == param and param in str(refused.value)
    assert not door.backend.calls and not door.recorder.calls


async def test_message_content_the_text_model_would_not_see_is_refused_not_dropped(door):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    asks = [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, image]},
            {"role": "function", "name": "bash", "content": "42"}]
    for i, message in enumerate(asks):
        with pytest.raises(openai.BadRequestError) as refused:
            await door.client.chat.completions.create(model="rollstream", messages=[*_messages(), message])
        assert refused.value.param.startswith(f"messages[{len(_messages())}]"), i
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "1+1?"}]}]
    await door.client.chat.completions.create(model="rollstream", messages=text_parts)
    assert door.recorder.last_messages[0]["content"] == "What is 1+1?"
    assert len(door.backend.calls) == 1


async def test_max_completion_tokens_seed_and_logprobs_are_applied(door, gateway, arith_server, tokenizer):
    reply = await door.client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS,
                                                      max_completion_tokens=5, logprobs=True)
    choice = reply.choices[0]
    gen = door.backend.calls[0][1]
    assert reply.usage.completion_tokens == len(gen.token_ids) == 5 and choice.finish_reason == "length"
    assert [t.logprob for t in choice.logprobs.content] == gen.logprobs
    assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([i]) for i in gen.token_ids]
    # A seed where the job sets none: a sampling job (temperature 1) draws the same tokens twice.
    sampling = RecordingClient()
    sampled = gateway.open("job-s", LLMSession(sampling, "job-s", backend_url=arith_server), tokenizer,
                           AgentSettings(max_tokens_per_turn=24, sampling=SamplingParams(temperature=1.0)))
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=sampled.key, max_retries=0)
    try:
        for _ in range(2):
            await client.chat.completions.create(model="rollstream", messages=[{"role": "user", "content": "Say"}],
                                                 seed=7)
    finally:
        await client.close()
        await sampling.aclose()
    assert sampling.calls[0][1].token_ids == sampling.calls[1][1].token_ids


class TwoCallsBackend:
    """A backend whose every turn is two tool calls (the tiny model rarely writes two): the
    door's handling of the reply is under test, not the model."""

    def __init__(self, tokenizer) -> None:
        text = "".join(f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "echo {i}"}}}}\n</tool_call>\n'
                       for i in (1, 2))
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    async def generate(self, base_url, prompt_ids, params, timeout_s=None) -> Generation:
        return Generation(token_ids=self.ids, logprobs=[-0.5] * len(self.ids), finish_reason="stop", backend=base_url)


async def test_parallel_tool_calls_false_returns_the_first_call_and_records_every_token(gateway, tokenizer):
    backend = TwoCallsBackend(tokenizer)
    door = gateway.open("job-2", LLMSession(backend, "job-2", backend_url="http://backend"), tokenizer,
                        AgentSettings())
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    try:
        both = await client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS)
        first = await client.chat.completions.create(model="rollstream", messages=_messages(), tools=TOOLS,
                                                     parallel_tool_calls=False)
    finally:
        await client.close()
    assert [json.loads(c.function.arguments)["command"] for c in both.choices[0].message.tool_calls] == \
        ["echo 1", "echo 2"]
    assert [json.loads(c.function.arguments)["command"] for c in first.choices[0].message.tool_calls] == ["echo 1"]
    assert door.recorder.segments[-1].response_ids == backend.ids



async def test_a_model_the_door_does_not_serve_is_a_404_in_each_apis_words_streamed_or_not(door):
    user = [{"role": "user", "content": "hi"}]
    asks = {
        "chat": lambda stream: door.client.chat.completions.create(model="gpt-9", messages=user, stream=stream),
        "responses": lambda stream: door.client.responses.create(model="gpt-9", input="hi", store=False,
                                                                 stream=stream),
        "anthropic": lambda stream: door.anthropic.messages.create(model="claude-haiku-9", max_tokens=8,
                                                                   messages=user, stream=stream),
        "count_tokens": lambda stream: door.anthropic.messages.count_tokens(model="claude-haiku-9", messages=user),
    }
    for api, ask in asks.items():
        for stream in (False, True) if api != "count_tokens" else (False,):
            with pytest.raises((openai.NotFoundError, anthropic.NotFoundError)) as refused:
                await ask(stream)
            body = refused.value.body
            if api in ("chat", "responses"):  # OpenAI's: code model_not_found, naming the parameter
                assert isinstance(refused.value, openai.NotFoundError), (api, stream)
                assert (refused.value.code, refused.value.param) == ("model_not_found", "model"), (api, body)
            else:  # Anthropic's: an error of type not_found_error
                assert isinstance(refused.value, anthropic.NotFoundError), (api, stream)
                assert body["type"] == "error" and body["error"]["type"] == "not_found_error", body
            assert "rollstream" in str(refused.value)  # what is served instead
    assert not door.backend.calls and not door.recorder.calls
    assert door.requests == door.refused == 6  # model calls refused (count_tokens is no model call)


async def test_the_served_model_is_listed_and_retrieved_by_both_apis_clients_and_no_other(door):
    assert [m.id async for m in door.client.models.list()] == ["rollstream"]
    assert (await door.client.models.retrieve("rollstream")).id == "rollstream"
    assert [m.id async for m in door.anthropic.models.list()] == ["rollstream"]
    assert (await door.anthropic.models.retrieve("rollstream")).id == "rollstream"
    with pytest.raises(openai.NotFoundError) as refused:
        await door.client.models.retrieve("gpt-9")
    assert refused.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError):
        await door.anthropic.models.retrieve("claude-haiku-9")
    reply = await door.client.chat.completions.create(model="rollstream", messages=_messages(), max_tokens=4)
    assert reply.model == "rollstream"
