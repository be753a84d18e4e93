"""The per-job door against a real built-in server and the real ``openai`` client: every
recorded id and logprob is the backend's own, a call that extends the last one extends its
sequence (mask 0 on what the harness added), a rewritten history starts a new exact
segment, streaming carries tool calls, and a key opens only its own job's door."""

from __future__ import annotations

import json

import openai
import pytest
from openai import AsyncOpenAI

from rollstream.agent.harnesses.openai_chat import SUBMIT
from rollstream.episode_settings import AgentSettings
from rollstream.llm.backend_link import PooledVLLMClient
from rollstream.llm.inference_client import SamplingParams, VLLMClient
from rollstream.llm.session import LLMSession
from rollstream.tasks import arith


class RecordingClient(PooledVLLMClient):
    """The door's real link to backends; it also keeps what each request sent and got back."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    async def generate(self, base_url, prompt_ids, params, timeout_s=None):
        gen = await super().generate(base_url, prompt_ids, params, timeout_s)
        self.calls.append((list(prompt_ids), gen))
        return gen

    async def generate_stream(self, base_url, prompt_ids, params, on_tokens, timeout_s=None):
        gen = await super().generate_stream(base_url, prompt_ids, params, on_tokens, timeout_s)
        self.calls.append((list(prompt_ids), gen))
        return gen


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


async def test_recorded_ids_are_the_backends_own_and_extend_or_segment_exactly(arith_server, arith_model_dir, gateway):
    backend = RecordingClient()
    settings = AgentSettings(max_tokens_per_turn=48, max_context_tokens=1024,
                             sampling=SamplingParams(temperature=1.0, max_tokens=48))
    door = gateway.open("job-1", LLMSession(backend, "job-1", backend_url=arith_server),
                        _tokenizer(arith_model_dir), settings)
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    tools = [arith.BASH_SCHEMA, SUBMIT]
    messages = arith.prompt({"a": 12, "op": "+", "b": 30})
    try:
        first = (await client.chat.completions.create(model="rollstream", messages=messages, tools=tools)).choices[0]
        messages.append(first.message.model_dump(exclude_none=True))
        if first.message.tool_calls:  # answer each call as a harness would
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "42\n"} for c in first.message.tool_calls]
        else:
            messages.append({"role": "user", "content": "Use the tools."})
        # The second call extends the first, streamed: the SDK reassembles the same message.
        stream = await client.chat.completions.create(model="rollstream", messages=messages, tools=tools, stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason in ("stop", "tool_calls", "length")
        # A harness that summarises: its history is rewritten, so a new segment starts.
        rewritten = [messages[0], {"role": "user", "content": "Summary so far: nothing. What is 12 + 30?"}]
        await client.chat.completions.create(model="rollstream", messages=rewritten, tools=tools)
        with pytest.raises(openai.AuthenticationError):
            await AsyncOpenAI(base_url=gateway.base_url, api_key="rs-not-a-job", max_retries=0).chat.completions.create(
                model="rollstream", messages=rewritten)
    finally:
        await client.close()
        await backend.aclose()

    traj = door.recorder.trajectory()
    assert [c["segment"] for c in traj.extra["calls"]] == [0, 0, 1] and len(traj.segments) == 2
    for call, (sent, gen) in zip(traj.extra["calls"], backend.calls):
        seg = traj.segments[call["segment"]]
        sequence = seg.prompt_ids + seg.response_ids
        offset = call["prompt_tokens"]
        # what the backend was sent is the segment up to the call; what it returned follows, unchanged
        assert sequence[:offset] == sent
        assert sequence[offset:offset + len(gen.token_ids)] == gen.token_ids
        lps = (seg.logprobs)[offset - len(seg.prompt_ids):][:len(gen.token_ids)]
        assert lps == gen.logprobs
        assert seg.loss_mask[offset - len(seg.prompt_ids):][:len(gen.token_ids)] == [1] * len(gen.token_ids)
    seg0 = traj.segments[0]
    # between the two calls of segment 0: only what the harness added, masked out
    added = seg0.loss_mask[len(backend.calls[0][1].token_ids):][:traj.extra["calls"][1]["prompt_tokens"]
                                                               - len(backend.calls[0][0])
                                                               - len(backend.calls[0][1].token_ids)]
    assert added and set(added) == {0}
    assert sum(seg0.loss_mask) == len(backend.calls[0][1].token_ids) + len(backend.calls[1][1].token_ids)
    # the last segment is the trajectory's top-level sequence
    assert traj.prompt_ids == traj.segments[1].prompt_ids and traj.response_ids == traj.segments[1].response_ids


async def test_a_closed_door_refuses_its_key_and_nothing_but_chat_completions_is_served(arith_server,
                                                                                      arith_model_dir, gateway):
    import httpx

    door = gateway.open("job-2", LLMSession(VLLMClient(), "job-2", backend_url=arith_server),
                        _tokenizer(arith_model_dir), AgentSettings())
    async with httpx.AsyncClient(base_url=gateway.base_url, headers={"Authorization": f"Bearer {door.key}"}) as http:
        assert (await http.get("/models")).json()["data"][0]["id"] == "rollstream"
        for path in ("/completions", "/../health", "/v1/load_weights"):  # nothing reaches a backend but the job's calls
            assert (await http.post(path, content=json.dumps({"prompt": [1, 2]}))).status_code == 404
        gateway.close(door)
        assert (await http.get("/models")).status_code == 401


async def test_the_doors_limits_end_the_episode_as_the_agents_and_a_dead_backend_as_the_services(
        arith_server, arith_model_dir, gateway):
    tokenizer = _tokenizer(arith_model_dir)
    messages = arith.prompt({"a": 1, "op": "+", "b": 2})
    one_call = gateway.open("job-3", LLMSession(VLLMClient(), "job-3", backend_url=arith_server), tokenizer,
                            AgentSettings(max_turns=1, max_tokens_per_turn=16))
    tiny_context = gateway.open("job-4", LLMSession(VLLMClient(), "job-4", backend_url=arith_server), tokenizer,
                                AgentSettings(max_context_tokens=16))
    dead = gateway.open("job-5", LLMSession(PooledVLLMClient(), "job-5", backend_url="http://127.0.0.1:9",
                                            max_backend_attempts=1), tokenizer, AgentSettings())

    def client(door, retries=0):
        return AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=retries)

    await client(one_call).chat.completions.create(model="rollstream", messages=messages)
    # A spent budget is permanent: a client that retries what may pass later (the SDK's
    # default, 2 retries) gets one answer and gives up at once.
    with pytest.raises(openai.BadRequestError, match="budget of 1 model calls") as refused:
        await client(one_call, retries=2).chat.completions.create(model="rollstream", messages=messages)
    assert refused.value.code == "max_turns_exceeded"
    assert (one_call.requests, one_call.refused) == (2, 1)
    with pytest.raises(openai.BadRequestError, match="context"):
        await client(tiny_context).chat.completions.create(model="rollstream", messages=messages)
    with pytest.raises(openai.APIStatusError, match="no backend could serve"):
        await client(dead).chat.completions.create(model="rollstream", messages=messages)
    assert (one_call.ended, tiny_context.ended, dead.ended) == ("max_turns", "context", "error")
    assert len(one_call.recorder.calls) == 1 and not tiny_context.recorder.calls and not dead.recorder.calls
