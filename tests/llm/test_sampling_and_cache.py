"""The built-in server's plain parts: next-token filters and the prefix KV cache."""

from __future__ import annotations

import math

import torch

from rollstream.llm import SamplingParams, VLLMClient
from rollstream.llm.server.cache import PrefixCache, kv_length
from rollstream.llm.server.sampling import SequenceSampling, choose_next

EMPTY = torch.tensor([], dtype=torch.long)


def sampler(**kw) -> SequenceSampling:
    s = SequenceSampling(**kw)
    s.make_generator(torch.device("cpu"))
    return s


def test_greedy_picks_the_argmax_and_reports_its_raw_logprob():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    choice = choose_next(logits, sampler(temperature=0.0), EMPTY, EMPTY)
    assert choice.token_id == 1
    assert math.isclose(choice.logprob, float(torch.log_softmax(logits, -1)[1]), abs_tol=1e-6)


def test_top_k_and_top_p_only_ever_sample_allowed_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    top_k = sampler(top_k=2, seed=0)
    assert {choose_next(logits, top_k, EMPTY, EMPTY).token_id for _ in range(200)} == {0, 1}
    top_p = sampler(top_p=0.7, seed=0)
    assert {choose_next(logits, top_p, EMPTY, EMPTY).token_id for _ in range(200)} == {0, 1}
    min_p = sampler(min_p=0.4, seed=0)
    assert {choose_next(logits, min_p, EMPTY, EMPTY).token_id for _ in range(200)} == {0, 1}


def test_processed_logprobs_mode_reports_the_sampled_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    s = sampler(temperature=0.5, top_k=2, seed=1)
    choice = choose_next(logits, s, EMPTY, EMPTY, logprobs_mode="processed_logprobs")
    expected = torch.log_softmax(torch.tensor([float("-inf"), 2.0, 4.0]), -1)[choice.token_id]
    assert math.isclose(choice.logprob, float(expected), abs_tol=1e-6)


def test_min_tokens_holds_back_stop_ids():
    logits = torch.tensor([5.0, 0.0, 0.0])
    s = sampler(temperature=0.0, min_tokens=2, stop_ids=frozenset({0}))
    assert choose_next(logits, s, EMPTY, torch.tensor([1])).token_id != 0
    assert choose_next(logits, s, EMPTY, torch.tensor([1, 2])).token_id == 0


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([2.0, 1.9, 0.0])
    s = sampler(temperature=0.0, repetition_penalty=2.0)
    assert choose_next(logits, s, torch.tensor([0]), EMPTY).token_id == 1


def _kv(n: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    base = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    return [(base + layer, base - layer) for layer in range(layers)]


def test_prefix_cache_returns_the_longest_prefix_leaving_one_token_to_run():
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], _kv(4))
    cache.insert([1, 2, 9], _kv(3))
    hit = cache.lookup([1, 2, 3, 4, 5, 6])
    assert hit.length == 4 and kv_length(hit.kv) == 4
    assert cache.lookup([1, 2, 3, 4]).length == 3  # the last prompt token must be recomputed
    assert cache.lookup([7, 8]) is None
    assert cache.stats.hits == 2 and cache.stats.reused_tokens == 7


def test_prefix_cache_drops_entries_a_longer_one_subsumes_and_evicts_by_bytes():
    cache = PrefixCache()
    cache.insert([1, 2], _kv(2))
    cache.insert([1, 2, 3], _kv(3))
    assert cache.stats.entries == 1
    small = PrefixCache(max_bytes=_kv_bytes(6))
    small.insert([1, 2, 3], _kv(3))
    small.insert([4, 5, 6], _kv(3))
    small.insert([7, 8, 9], _kv(3))
    assert small.lookup([1, 2, 3, 0]) is None and small.lookup([7, 8, 9, 0]).length == 3
    small.clear()
    assert small.lookup([7, 8, 9, 0]) is None


def _kv_bytes(n: int) -> int:
    return sum(k.numel() * 4 + v.numel() * 4 for k, v in _kv(n))


def test_vllm_request_body_sends_ids_and_passes_params_through():
    params = SamplingParams(max_tokens=5, temperature=0.7, stop_token_ids=[2], seed=1, min_p=0.05, logit_bias={"3": -1})
    body = VLLMClient().request_body("m", [4, 5], params)
    assert body["prompt"] == [4, 5] and body["model"] == "m"
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["logprobs"] == 1
    assert body["max_tokens"] == 5 and body["stop_token_ids"] == [2] and body["seed"] == 1 and body["min_p"] == 0.05
    assert body["logit_bias"] == {"3": -1}
    assert "stop" not in body and "repetition_penalty" not in body
