"""SGLangClient against a real HTTP server with SGLang's /generate shape (sglang_shim.py,
since SGLang itself needs a GPU): request mapping, ids, logprobs, finish reasons, errors."""

from __future__ import annotations

import pytest

from rollstream.llm import BackendError, SamplingParams, SGLangClient, make_client
from rollstream.llm.server.engine import Engine, EngineConfig

from .llm_refs import greedy_reference, recompute_logprobs
from .sglang_shim import SGLangShim


@pytest.fixture(scope="module")
def sglang(tiny_model_dir):
    with SGLangShim(Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu"))) as shim:
        yield shim


@pytest.fixture
async def client():
    c = make_client("sglang")
    assert isinstance(c, SGLangClient)
    yield c
    await c.aclose()


def test_request_maps_vllm_names_to_sglang_names():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=-1, stop=["\n\n"], stop_token_ids=[2], seed=9,
                            include_stop_str_in_output=True, repetition_penalty=1.1)
    body = SGLangClient().request_body([1, 2, 3], params)
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 7 and sp["temperature"] == 0.5 and sp["top_k"] == -1
    assert sp["stop"] == ["\n\n"] and sp["stop_token_ids"] == [2] and sp["no_stop_trim"] is True
    assert sp["sampling_seed"] == 9 and sp["repetition_penalty"] == 1.1
    assert "max_tokens" not in sp and "presence_penalty" not in sp


async def test_sglang_ids_and_logprobs_are_the_models(sglang, client, tokenizer, reference_model):
    prompt = tokenizer.encode("<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n")
    gen = await client.generate(sglang.base_url, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert gen.token_ids == greedy_reference(reference_model, prompt, 12)
    assert gen.finish_reason == "length" and gen.backend == sglang.base_url and gen.policy_version == 0
    sampled = await client.generate(sglang.base_url, prompt, SamplingParams(max_tokens=12, seed=5, ignore_eos=True))
    recomputed = recompute_logprobs(reference_model, prompt, sampled.token_ids)
    assert max(abs(a - b) for a, b in zip(sampled.logprobs, recomputed)) < 1e-4
    assert sglang.received[-1]["sampling_params"]["sampling_seed"] == 5


async def test_sglang_stop_token_maps_to_stop_with_the_matched_id(sglang, client, tokenizer, reference_model):
    prompt = tokenizer.encode("<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n")
    free = greedy_reference(reference_model, prompt, 12)
    position = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    gen = await client.generate(
        sglang.base_url, prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[free[position]])
    )
    assert gen.token_ids == free[: position + 1]
    assert gen.finish_reason == "stop" and gen.stop_reason == free[position]


async def test_sglang_abort_is_a_retryable_backend_error(sglang, client):
    with pytest.raises(BackendError, match="aborted") as info:
        await client.generate(sglang.base_url, [5, 6], SamplingParams(max_tokens=2, abort_me=True))
    assert info.value.retryable


def test_ids_come_from_logprob_triples_when_output_ids_are_absent():
    body = {"text": "ab", "meta_info": {"finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                                        "output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None]]}}
    gen = SGLangClient().parse_response("http://x", body)
    assert gen.token_ids == [11, 12] and gen.logprobs == [-0.5, -1.5] and gen.finish_reason == "length"


async def test_sglang_health(sglang, client):
    assert await client.health(sglang.base_url)
