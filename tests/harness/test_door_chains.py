"""Concurrent call chains of one job through its door (a CLI's sub-agents, its side calls such as
a title): calls made at the same time are served at the same time, each follow-up extends its own
chain's exact sequence, a side call starts a segment of its own, two calls that would extend one
chain at once fork it (the second starts a new segment), and each segment names its calls."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import SamplingParams
from rollstream.llm.session import LLMSession

from .test_door_apis import _assert_exact
from .test_gateway import RecordingClient


class TogetherBackend(RecordingClient):
    """The real link, which starts a generation only once ``together`` of the door's calls are
    being generated at once: what it serves was, by construction, served concurrently."""

    def __init__(self) -> None:
        super().__init__()
        self.door = None
        self.together = 1

    async def _all_in(self) -> None:
        for _ in range(6000):
            if self.door.calling >= self.together:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.door.calling} calls in generation; {self.together} were sent at once")

    async def generate(self, base_url, prompt_ids, params, timeout_s=None):
        await self._all_in()
        return await super().generate(base_url, prompt_ids, params, timeout_s)

    async def generate_stream(self, base_url, prompt_ids, params, on_tokens, timeout_s=None):
        await self._all_in()
        return await super().generate_stream(base_url, prompt_ids, params, on_tokens, timeout_s)


async def test_concurrent_sub_agents_build_a_chain_each_and_a_side_call_a_segment_of_its_own(
        gateway, arith_server, tokenizer):
    backend = TogetherBackend()
    door = backend.door = gateway.open("job-c", LLMSession(backend, "job-c", backend_url=arith_server), tokenizer,
                        AgentSettings(max_tokens_per_turn=24, sampling=SamplingParams(temperature=0.0)))
    door.backend = backend
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)

    async def ask(messages: list[dict], stream: bool = False) -> list[dict]:
        if stream:
            chunks = [c async for c in await client.chat.completions.create(model="rollstream", messages=messages,
                                                                            stream=True)]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = await client.chat.completions.create(model="rollstream", messages=messages)
            content = reply.choices[0].message.content
        return [*messages, {"role": "assistant", "content": content}]

    system = {"role": "system", "content": "You are a careful assistant."}
    try:
        # Two sub-agents start at once; then each goes on while a title is asked for beside them,
        # and the first sub-agent's follow-up is sent twice at once (a harness retrying it).
        backend.together = 2
        first_a, first_b = await asyncio.gather(ask([system, {"role": "user", "content": "What is 2 + 2?"}]),
                                                ask([system, {"role": "user", "content": "Name a color."}], True))
        follow_a = [*first_a, {"role": "user", "content": "And 3 + 3?"}]
        backend.together = 4
        await asyncio.gather(ask(follow_a, True), ask(follow_a), ask([*first_b, {"role": "user", "content": "More?"}]),
                             ask([{"role": "user", "content": "A title for: What is 2 + 2?"}]))
    finally:
        await client.close()
        await backend.aclose()

    traj = door.recorder.trajectory()
    calls = traj.extra["calls"]
    # four segments: sub-agent A (its first call and one of its two follow-ups), sub-agent B (two
    # calls), the title, and the follow-up that forked A; each names its calls
    assert len(calls) == 6 and sum(c["extended"] for c in calls) == 2
    assert sorted(len(seg.call_indices) for seg in traj.segments) == [1, 1, 2, 2]
    for number, seg in enumerate(traj.segments):
        assert seg.call_indices == [i for i, c in enumerate(calls) if c["segment"] == number]
        assert seg.num_calls == len(seg.call_indices)
    _assert_exact(door)
