"""Fixtures of the door's tests: a started door server, the arith model's tokenizer, and a door on
the arith server that samples greedily, with the official clients of its APIs."""

from __future__ import annotations

import anthropic
import pytest
from openai import AsyncOpenAI

from rollstream.agent.gateway import Gateway
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import SamplingParams
from rollstream.llm.session import LLMSession

from .test_gateway import RecordingClient

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture
async def gateway():
    gw = await Gateway().start()
    yield gw
    await gw.aclose()


@pytest.fixture(scope="module")
def tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)


@pytest.fixture
async def door(gateway, arith_server, tokenizer):
    """A door on the arith server that samples greedily, its backend link recording each call;
    ``door.client`` speaks OpenAI's APIs to it, ``door.anthropic`` Anthropic's (which adds
    /v1/messages itself and sends the key as x-api-key)."""
    backend = RecordingClient()
    door = gateway.open("job-p", LLMSession(backend, "job-p", backend_url=arith_server), tokenizer,
                        AgentSettings(max_tokens_per_turn=48, max_context_tokens=1024, sampling=GREEDY))
    door.backend = backend
    door.client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    door.anthropic = anthropic.AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=door.key,
                                              max_retries=0)
    yield door
    await door.client.close()
    await door.anthropic.close()
    await backend.aclose()
