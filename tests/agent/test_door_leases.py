"""The door gives a call's backend slot back once the call's answer is on its way (the release's
round trip to Redis is off the answer's path), and never keeps one: after whole, streamed and
failed calls through the balancer, the backend's in-flight count is back to zero."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, BadRequestError

from rollstream.agent.gateway import Gateway
from rollstream.episode_settings import AgentSettings
from rollstream.llm.backend_link import PooledVLLMClient
from rollstream.llm.balancer import Balancer
from rollstream.llm.inference_client import SamplingParams
from rollstream.llm.session import LLMSession
from rollstream.pipeline.connection import async_redis
from rollstream.tasks import arith


@pytest.fixture(scope="module")
def arith_tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)


async def test_every_door_call_gives_its_backend_slot_back_once_answered(
        redis_url, namespace, arith_server, arith_tokenizer, wait_until):
    redis = async_redis(redis_url)
    balancer = Balancer(redis, namespace=namespace)
    await balancer.register(arith_server)
    link = PooledVLLMClient()
    gateway = await Gateway().start()
    session = LLMSession(link, "job-lease", "group-lease", balancer=balancer)
    settings = AgentSettings(max_turns=3, max_tokens_per_turn=8, max_context_tokens=4096,
                             sampling=SamplingParams(temperature=0.0))
    door = gateway.open("job-lease", session, arith_tokenizer, settings)
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    messages = arith.prompt({"a": 2, "op": "+", "b": 3})

    async def all_given_back() -> bool:
        return set((await balancer.in_flight()).values()) == {0}

    try:
        await client.chat.completions.create(model="rollstream", messages=messages)
        await wait_until(all_given_back, what="the whole call's slot given back")
        stream = await client.chat.completions.create(model="rollstream", messages=messages, stream=True)
        assert [chunk async for chunk in stream]
        await wait_until(all_given_back, what="the streamed call's slot given back")
        await client.chat.completions.create(model="rollstream", messages=messages)
        with pytest.raises(BadRequestError, match="max_turns_exceeded|budget"):  # refused: nothing generated
            await client.chat.completions.create(model="rollstream", messages=messages)
        await wait_until(all_given_back, what="every slot given back")
        assert len(door.recorder.calls) == 3 and not session._finished
    finally:
        gateway.close(door)
        await session.close()
        await client.close()
        await gateway.aclose()
        await link.aclose()
        await redis.aclose()
    assert await all_given_back()
