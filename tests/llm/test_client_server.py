"""VLLMClient against the built-in server with the tiny model: the ids are exactly what the
model generated, logprobs match a recomputation, stops are honoured, concurrent requests are
batched without changing results, the prefix cache is reused, errors are BackendErrors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rollstream.llm import BackendError, ContextLengthError, SamplingParams, VLLMClient

from .llm_refs import greedy_reference, recompute_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered)


@pytest.fixture
async def client():
    c = VLLMClient()
    yield c
    await c.aclose()


async def test_generated_ids_are_exactly_the_models_greedy_tokens(model_server, client, tokenizer, reference_model):
    prompt = chat_prompt(tokenizer, "Write a function that adds two numbers.")
    gen = await client.generate(model_server, prompt, GREEDY)
    assert gen.token_ids == greedy_reference(reference_model, prompt, GREEDY.max_tokens)
    assert gen.finish_reason == "length"
    assert len(gen.logprobs) == len(gen.token_ids) == GREEDY.max_tokens
    assert gen.prompt_tokens == len(prompt)
    assert gen.backend == model_server and gen.policy_version == 0


async def test_sampled_logprobs_match_a_recomputation(model_server, client, tokenizer, reference_model):
    prompt = chat_prompt(tokenizer, "What is 12 + 30?")
    gen = await client.generate(model_server, prompt,
                                SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True))
    recomputed = recompute_logprobs(reference_model, prompt, gen.token_ids)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, recomputed)) < 1e-4


async def test_logprobs_are_raw_model_logprobs_whatever_the_temperature(model_server, client, tokenizer,
                                                                         reference_model):
    """Like vLLM's default logprobs mode: log-softmax of the raw logits, before temperature
    and top-k/top-p."""
    prompt = chat_prompt(tokenizer, "Say something.")
    params = SamplingParams(temperature=0.6, top_p=0.9, top_k=50, max_tokens=20, seed=11, ignore_eos=True)
    gen = await client.generate(model_server, prompt, params)
    recomputed = recompute_logprobs(reference_model, prompt, gen.token_ids)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, recomputed)) < 1e-4


async def test_stop_token_id_ends_generation_and_is_returned(model_server, client, tokenizer):
    prompt = chat_prompt(tokenizer, "Count to five.")
    free = await client.generate(model_server, prompt, GREEDY)
    # The first id that does not occur earlier in the output is a stop we know will be hit.
    position = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i])
    stop_id = free.token_ids[position]
    gen = await client.generate(model_server, prompt, GREEDY.model_copy(update={"stop_token_ids": [stop_id]}))
    assert gen.token_ids == free.token_ids[: position + 1]
    assert gen.finish_reason == "stop" and gen.stop_reason == stop_id


async def test_stop_string_cuts_text_but_keeps_the_generated_ids(model_server, client, tokenizer):
    prompt = chat_prompt(tokenizer, "Tell me about files.")
    free = await client.generate(model_server, prompt, GREEDY)
    full_text = tokenizer.decode(free.token_ids, skip_special_tokens=True)
    # A stop string made of the 4th token's text (stripped so that it is non-empty).
    stop = tokenizer.decode(free.token_ids[3:4]).strip() or tokenizer.decode(free.token_ids[3:5]).strip()
    assert stop and stop in full_text
    gen = await client.generate(model_server, prompt, GREEDY.model_copy(update={"stop": [stop]}))
    assert gen.finish_reason == "stop" and gen.stop_reason == stop
    assert gen.token_ids == free.token_ids[: len(gen.token_ids)]
    assert stop not in gen.text and full_text.startswith(gen.text)
    with_stop = await client.generate(
        model_server, prompt, GREEDY.model_copy(update={"stop": [stop], "include_stop_str_in_output": True})
    )
    assert with_stop.text.endswith(stop)


async def test_concurrent_requests_are_batched_and_match_running_alone(model_server, client, tokenizer):
    prompts = [chat_prompt(tokenizer, f"Task number {i}: " + "please check the file " * (i % 4)) for i in range(8)]
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=1.0, max_tokens=24, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    alone = [await client.generate(model_server, p, sp) for p, sp in zip(prompts, params)]
    before = httpx.get(f"{model_server}/v1/engine_stats").json()
    together = await asyncio.gather(*[client.generate(model_server, p, sp) for p, sp in zip(prompts, params)])
    after = httpx.get(f"{model_server}/v1/engine_stats").json()
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert after["max_batch_seen"] > 1
    # Batched: far fewer decode steps than tokens generated.
    assert after["steps"] - before["steps"] < after["generated_tokens"] - before["generated_tokens"]


async def test_same_seed_same_sample_other_seed_other_sample(model_server, client, tokenizer):
    prompt = chat_prompt(tokenizer, "Pick random words.")
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=42, ignore_eos=True)
    a = await client.generate(model_server, prompt, sp)
    b = await client.generate(model_server, prompt, sp)
    c = await client.generate(model_server, prompt, sp.model_copy(update={"seed": 43}))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_next_turn_reuses_the_prefix_cache_without_changing_results(model_server, client, tokenizer,
                                                                           reference_model):
    prompt = chat_prompt(tokenizer, "Run the tests and tell me what failed.")
    first = await client.generate(model_server, prompt, GREEDY)
    observation = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n2 passed\n</tool_response>"
                                   "<|im_end|>\n<|im_start|>assistant\n")
    second_prompt = prompt + first.token_ids + observation
    body = {"prompt": second_prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    resp = httpx.post(f"{model_server}/v1/completions", json=body, timeout=60).json()
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt)
    choice = resp["choices"][0]
    assert choice["token_ids"] == greedy_reference(reference_model, second_prompt, 12)
    again = await client.generate(model_server, second_prompt,
                                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert again.cached_tokens == len(second_prompt) - 1 and again.token_ids == choice["token_ids"]
    recomputed = recompute_logprobs(reference_model, second_prompt, choice["token_ids"])
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], recomputed)) < 1e-4


async def test_response_has_vllm_shape(model_server, tokenizer):
    prompt = chat_prompt(tokenizer, "hi")
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": 2, "return_tokens_as_token_ids": True, "temperature": 0}
    resp = httpx.post(f"{model_server}/v1/completions", json=body, timeout=60).json()
    choice = resp["choices"][0]
    assert resp["object"] == "text_completion"
    assert resp["usage"]["completion_tokens"] == len(choice["logprobs"]["tokens"])
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"])
    assert choice["token_ids"] is None  # only with return_token_ids, as in vLLM
    # Older vLLM has no return_token_ids: the client falls back to the token_id:N names.
    parsed = VLLMClient().parse_response(model_server, resp)
    assert [f"token_id:{t}" for t in parsed.token_ids] == choice["logprobs"]["tokens"]


async def test_health_models_and_policy_version(model_server, tiny_model_dir):
    assert httpx.get(f"{model_server}/health").status_code == 200
    models = httpx.get(f"{model_server}/v1/models").json()
    # the built-in server serves a model under its folder's name
    assert models["data"][0]["id"] == tiny_model_dir.name and models["data"][0]["max_model_len"] > 0
    assert httpx.get(f"{model_server}/v1/policy_version").json() == {"policy_version": 0}
    assert await VLLMClient().health(model_server)


async def test_too_long_prompt_is_a_context_length_error(model_server, client):
    with pytest.raises(ContextLengthError) as info:
        await client.generate(model_server, [5] * 4100, SamplingParams(max_tokens=200))
    assert not info.value.retryable
    # As vLLM does, max_tokens past the context is clamped to the room the prompt leaves.
    clamped = await client.generate(model_server, [5] * 4090, SamplingParams(max_tokens=200, ignore_eos=True))
    assert len(clamped.token_ids) == 6 and clamped.finish_reason == "length"


async def test_unsupported_request_is_a_non_retryable_error(model_server, client):
    with pytest.raises(BackendError) as info:
        await client.generate(model_server, [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, n=2))  # as vLLM
    assert not info.value.retryable and info.value.status_code == 400
    with pytest.raises(BackendError, match="outside the vocabulary"):
        await client.generate(model_server, [10**6], SamplingParams(max_tokens=2))


async def test_wrong_model_name_is_rejected(model_server):
    with pytest.raises(BackendError, match="does not exist"):
        await VLLMClient(model="other-model").generate(model_server, [5, 6], SamplingParams(max_tokens=2))
