"""The door's requests as typed models (rollstream/agent/door_models.py): whatever an API's checks
accept is parsed into that API's model (never a 500, never a second refusal in other words), the
client's bookkeeping is typed and kept as sent (junk in it refused), and the fields a Responses
answer echoes come back as sent."""

from __future__ import annotations

import random

import pytest

from rollstream.agent.door_anthropic import _ACCEPTED as ANTHROPIC_FIELDS
from rollstream.agent.door_anthropic import AnthropicApi
from rollstream.agent.door_anthropic import parse as anthropic_checks
from rollstream.agent.door_chat import ChatApi
from rollstream.agent.door_models import AnthropicRequest, ChatRequest, ResponsesRequest
from rollstream.agent.door_request import _ACCEPTED as CHAT_FIELDS
from rollstream.agent.door_request import DoorError, parse_request
from rollstream.agent.door_responses import _ACCEPTED as RESPONSES_FIELDS
from rollstream.agent.door_responses import ResponsesApi, ResponsesEvents
from rollstream.agent.door_responses import parse as responses_checks
from rollstream.agent.door_stream import Completed

USER = [{"role": "user", "content": "hi"}]
# Values of every JSON kind, the neutral ones each check lets through among them.
VALUES = [None, 0, 1, 1.0, 0.0, 2, -1, 0.5, True, False, "", "x", "auto", "none", "disabled", "required", [], [""],
          ["a", "b"], {}, {"type": "text"}, {"type": "auto"}, {"type": "none"}, {"include_usage": True},
          {"type": "enabled"}, {"edits": []}, ["reasoning.encrypted_content"], {"format": {"type": "text"}},
          [{"type": "function", "function": {"name": "f", "parameters": {}}}],
          [{"type": "function", "name": "f", "parameters": {}}], [{"name": "f", "input_schema": {}}],
          [{"type": "function"}], float("inf")]
APIS = [
    ("chat", parse_request, ChatApi().parse, CHAT_FIELDS, {"messages": USER}),
    ("responses", responses_checks, ResponsesApi().parse, RESPONSES_FIELDS, {"input": "hi"}),
    ("anthropic", anthropic_checks, AnthropicApi().parse, ANTHROPIC_FIELDS, {"messages": USER, "max_tokens": 8}),
    ("count_tokens", lambda r: anthropic_checks(r, True), lambda r: AnthropicApi().parse(r, count_only=True),
     ANTHROPIC_FIELDS, {"messages": USER}),
]


@pytest.mark.parametrize(("name", "checks", "parse", "fields", "base"), APIS, ids=[a[0] for a in APIS])
def test_every_request_the_checks_accept_is_typed_by_its_model_and_every_other_refused_with_a_400(
        name, checks, parse, fields, base):
    rng, accepted = random.Random(name), 0
    for _ in range(4000):
        request = dict(base)
        for field in rng.sample(sorted(fields), rng.randint(1, 3)):
            request[field] = rng.choice(VALUES)
        try:
            checks(request)
        except DoorError as refused:
            assert refused.status == 400 and refused.param, request
            continue
        accepted += 1
        typed, _options = parse(request)  # a DoorError here would be a refusal the checks did not word
        assert typed.model == request.get("model"), request
    assert accepted > 200  # the draw reaches the accepting side, not only refusals (seeded: the same draw)


def test_bookkeeping_is_typed_and_kept_as_sent_and_sampling_numbers_keep_their_json_type():
    typed, _ = ChatApi().parse({"messages": USER, "user": "u-1", "metadata": {"run": "7"}, "temperature": 1,
                                "top_p": 0.5, "model": "gpt-x", "stop": "END", "service_tier": "flex"})
    assert isinstance(typed, ChatRequest)
    assert (typed.user, typed.metadata, typed.service_tier) == ("u-1", {"run": "7"}, "flex")
    assert (typed.temperature, typed.top_p, typed.model, typed.stop) == (1, 0.5, "gpt-x", "END")
    assert isinstance(typed.temperature, int)
    typed, _ = AnthropicApi().parse({"messages": USER, "max_tokens": 8, "cache_control": {"type": "ephemeral"}})
    assert isinstance(typed, AnthropicRequest) and typed.cache_control == {"type": "ephemeral"}


@pytest.mark.parametrize(("parse", "base", "junk"), [
    (ChatApi().parse, {"messages": USER}, {"user": 7}),
    (ChatApi().parse, {"messages": USER}, {"metadata": {"run": 7}}),
    (ChatApi().parse, {"messages": USER}, {"service_tier": "gold"}),
    (ChatApi().parse, {"messages": USER}, {"model": ["a"]}),
    (ResponsesApi().parse, {"input": "hi"}, {"prompt_cache_key": 1}),
    (ResponsesApi().parse, {"input": "hi"}, {"reasoning": "high"}),
    (AnthropicApi().parse, {"messages": USER, "max_tokens": 8}, {"metadata": "u"}),
    (AnthropicApi().parse, {"messages": USER, "max_tokens": 8}, {"service_tier": "flex"}),
    (lambda r: AnthropicApi().parse(r, count_only=True), {"messages": USER}, {"max_tokens": "lots"}),
], ids=["user", "metadata", "tier", "model", "cache-key", "reasoning", "a-metadata", "a-tier", "count-max-tokens"])
def test_bookkeeping_that_changes_nothing_is_still_refused_when_it_is_junk(parse, base, junk):
    with pytest.raises(DoorError) as refused:
        parse({**base, **junk})
    assert refused.value.status == 400 and refused.value.param == next(iter(junk))


@pytest.mark.parametrize(("sent", "echoed"), [({}, True), ({"parallel_tool_calls": None}, None),
                                              ({"parallel_tool_calls": False}, False)])
def test_a_responses_answer_echoes_what_the_request_sent(sent, echoed):
    request = {"input": "hi", "temperature": 1, "tools": [], "metadata": None, **sent}
    typed, options = ResponsesApi().parse(request)
    assert isinstance(typed, ResponsesRequest)
    done = Completed(content="ok", calls=[], finish="stop", prompt_tokens=3, completion_tokens=1)
    body = ResponsesApi().body(done, typed, options, tokenizer=None)
    assert body["parallel_tool_calls"] is echoed
    assert (body["temperature"], body["tools"], body["metadata"], body["tool_choice"]) == (1, [], {}, "auto")
    assert ResponsesEvents(typed).response(done, [])["parallel_tool_calls"] is echoed


def test_an_include_entry_that_is_not_a_name_is_refused_with_a_400_not_a_crash():
    with pytest.raises(DoorError) as refused:
        ResponsesApi().parse({"input": "hi", "include": [{"type": "x"}]})
    assert refused.value.status == 400 and refused.value.param == "include"
