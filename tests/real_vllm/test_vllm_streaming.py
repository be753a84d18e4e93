"""The door's streamed turns against the real vLLM: what ``generate_stream`` (the httpx client and
the door's pooled link) passes on chunk by chunk adds up to the turn, and the turn is the one
``generate`` gets for the same request: the same ids, logprobs and finish, from vLLM's own stream."""

from __future__ import annotations

import math

import pytest

from rollstream.agent.chat import ChatRenderer
from rollstream.llm.backend_link import PooledVLLMClient
from rollstream.llm.inference_client import SamplingParams, VLLMClient
from rollstream.tasks import arith

from .conftest import MODEL_NAME


@pytest.mark.parametrize("stop", [None, ["echo"]])
@pytest.mark.parametrize("link", [VLLMClient, PooledVLLMClient])
async def test_a_streamed_turn_is_the_whole_turn_vllm_gives_passed_on_as_it_comes(vllm_url, tokenizer, link, stop):
    prompt = ChatRenderer(tokenizer).prompt_ids(arith.prompt({"a": 12, "op": "+", "b": 30}))
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=stop)
    client = link(model=MODEL_NAME)
    pieces: list[tuple[list[int], list[float]]] = []

    async def on_tokens(ids, logprobs):
        pieces.append((ids, logprobs))

    try:
        whole = await client.generate(vllm_url, prompt, params)
        streamed = await client.generate_stream(vllm_url, prompt, params, on_tokens)
        passed_on = list(pieces)
        again = await client.generate_stream(vllm_url, prompt, params, on_tokens)  # the pooled connection, reused
    finally:
        await client.aclose()
    assert len(passed_on) > 1  # passed on in pieces, not at the end
    assert streamed.token_ids == whole.token_ids == again.token_ids
    assert [i for ids, _ in passed_on for i in ids] == streamed.token_ids
    assert [lp for _, lps in passed_on for lp in lps] == streamed.logprobs
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(streamed.logprobs, whole.logprobs, strict=True))
    assert (streamed.finish_reason, streamed.stop_reason) == (whole.finish_reason, whole.stop_reason)
    assert streamed.prompt_tokens == len(prompt)
