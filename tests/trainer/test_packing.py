"""Packed micro-batches: sequences laid end to end in one row give the same per-token
log-probabilities and gradients as each sequence run on its own, and the update step on them
is the DAPO update of the padded batch."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.trainer.batch import build_batch
from rollstream.trainer.config import LossConfig, OptimConfig
from rollstream.trainer.logprobs import packed_token_logprobs, token_logprobs
from rollstream.trainer.loss import dapo_policy_loss
from rollstream.trainer.packing import micro_batch_rows, pack_rows
from rollstream.trainer.update import PolicyUpdater
from rollstream.trajectory import Trajectory

LENGTHS = [(3, 9), (5, 2), (2, 14), (4, 6)]  # (prompt, response) tokens per sequence


def _load(path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch(seed: int = 0, lengths=LENGTHS, advantages=(1.0, -0.5, 0.25, -1.0)):
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for prompt_len, response_len in lengths:
        ids = torch.randint(3, 1500, (prompt_len + response_len,), generator=gen).tolist()
        mask = [1] * response_len
        mask[len(mask) // 2] = 0  # a tool observation inside the response
        logprobs = (-torch.rand(response_len, generator=gen) * 3).tolist()
        trajs.append(Trajectory(prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:], loss_mask=mask,
                                logprobs=logprobs))
    return build_batch(trajs, list(advantages), pad_token_id=0)


def _close(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal to float32 summation-order noise, relative to the tensor's largest entry."""
    return bool((got - expected).abs().max() <= rel * expected.abs().max() + 1e-8)


def _alone(model, ids: torch.Tensor) -> torch.Tensor:
    """log p(x_t | x_<t) for one sequence run by itself, the plain way (full log-softmax)."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[1:, None]).squeeze(-1)


def test_packed_logprobs_equal_each_sequence_run_alone(tiny_model_dir):
    model = _load(tiny_model_dir).eval()
    batch = _batch()
    micro = pack_rows(batch, list(range(len(batch))))
    assert micro.num_tokens == batch.num_tokens  # no padding in the packed row
    every = torch.ones(micro.num_tokens, dtype=torch.bool)
    with torch.no_grad():
        packed = packed_token_logprobs(model, micro, positions=every, chunk_tokens=7)
        bounds = micro.cu_seqlens.tolist()
        for s, e in itertools.pairwise(bounds):
            alone = _alone(model, micro.input_ids[s:e])
            assert packed[s] == 0.0  # a sequence's first token has no context
            assert torch.allclose(packed[s + 1:e].double(), alone, atol=2e-5), (s, e)


def test_a_sequence_in_a_packed_row_does_not_see_its_neighbours(tiny_model_dir):
    model = _load(tiny_model_dir).eval()
    batch = _batch()
    micro = pack_rows(batch, [0, 1, 2])
    changed = pack_rows(batch, [0, 1, 2])
    first_end, second_end = micro.cu_seqlens[1].item(), micro.cu_seqlens[2].item()
    changed.input_ids[:first_end] = (micro.input_ids[:first_end] * 7 + 11) % 1400 + 3  # rewrite the first sequence
    every = torch.ones(micro.num_tokens, dtype=torch.bool)
    with torch.no_grad():
        a = packed_token_logprobs(model, micro, positions=every)
        b = packed_token_logprobs(model, changed, positions=every)
    assert not torch.allclose(a[:first_end], b[:first_end])
    assert torch.allclose(a[first_end:], b[first_end:], atol=1e-6)
    assert second_end < micro.num_tokens


def test_packed_gradients_equal_the_padded_batch_gradients(tiny_model_dir):
    batch = _batch(1)
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(3)) * batch.response_mask
    padded_model, packed_model = _load(tiny_model_dir), _load(tiny_model_dir)
    (token_logprobs(padded_model, batch.input_ids, batch.attention_mask) * weights).sum().backward()
    micro = pack_rows(batch, list(range(len(batch))))
    flat_weights = torch.cat([weights[row, :n] for row, n in enumerate(batch.attention_mask.sum(1).tolist())])
    (packed_token_logprobs(packed_model, micro, chunk_tokens=5) * flat_weights).sum().backward()
    for (name, a), b in zip(padded_model.named_parameters(), packed_model.parameters()):
        assert _close(b.grad, a.grad), name


def test_micro_batches_close_at_the_token_budget_and_keep_long_sequences_whole():
    lengths = [(2, 6), (2, 6), (2, 20), (2, 3), (2, 3), (2, 3)]  # 8, 8, 22, 5, 5, 5 tokens
    batch = _batch(2, lengths=lengths, advantages=[1.0] * len(lengths))
    assert micro_batch_rows(batch, 4) == [[0, 1, 2, 3], [4, 5]]
    assert micro_batch_rows(batch, 4, micro_batch_tokens=16) == [[0, 1], [2], [3, 4, 5]]
    packed = [pack_rows(batch, rows) for rows in micro_batch_rows(batch, 4, micro_batch_tokens=16)]
    assert sum(m.num_response_tokens for m in packed) == batch.num_response_tokens
    assert [m.position_ids.tolist()[:9] for m in packed[:1]] == [[0, 1, 2, 3, 4, 5, 6, 7, 0]]


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(tis_cap=1.5, kl_coef=0.3, clip_high=0.1)],
                         ids=["dapo", "dapo+tis+kl"])
def test_packed_update_equals_the_padded_dapo_update(tiny_model_dir, loss):
    batch = _batch(4)
    model = _load(tiny_model_dir)
    reference = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # behaviour near the policy, some ratios outside the clip range
        current = token_logprobs(model.eval(), batch.input_ids, batch.attention_mask)
        noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(5)) * 0.3
        batch.behaviour_logprobs = (current + noise) * batch.response_mask
    for p in reference.parameters():  # a reference that differs from the policy
        p.add_(torch.randn_like(p) * 0.01)

    # the straightforward computation: the whole padded batch, full logits, one backward
    expected_model = copy.deepcopy(model).train()
    logprobs = token_logprobs(expected_model, batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        ref = token_logprobs(reference, batch.input_ids, batch.attention_mask)
    out = dapo_policy_loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.response_mask,
                           old_logprobs=logprobs.detach() if loss.tis_cap else None, clip_low=loss.clip_low,
                           clip_high=loss.clip_high, tis_cap=loss.tis_cap, ref_logprobs=ref, kl_coef=loss.kl_coef)
    out.loss.backward()
    assert out.metrics["clip_frac"] > 0 or loss.tis_cap

    updater = PolicyUpdater(model, loss, OptimConfig(micro_batch_size=3, logprob_chunk_tokens=4), reference=reference)
    updater.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = updater.step(batch)
    assert stats.loss == pytest.approx(out.loss.item(), rel=1e-4)
    assert stats.metrics["clip_frac"] == pytest.approx(out.metrics["clip_frac"])
    scale = min(1.0, 1.0 / (stats.grad_norm + 1e-6))  # the update clips to max_grad_norm 1 in place
    for (name, expected), got in zip(expected_model.named_parameters(), model.parameters()):
        assert _close(got.grad, expected.grad * scale), name


def _varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     is_causal=False, enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract ([N, H, D] tensors, cumulative
    lengths; causal as window (-1, 0) from torch 2.11, as is_causal in 2.10), on the CPU, where
    the flash kernel does not run."""
    assert (window_size == (-1, 0) or is_causal) and cu_seq_q is cu_seq_k and max_q == max_k
    assert enable_gqa or query.shape[1] == key.shape[1]
    bounds = cu_seq_q.tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[s:e].transpose(0, 1), key[s:e].transpose(0, 1), value[s:e].transpose(0, 1), is_causal=True,
        scale=scale, enable_gqa=enable_gqa).transpose(0, 1) for s, e in itertools.pairwise(bounds)]
    return torch.cat(outs)


@pytest.mark.parametrize("kernel", ["torch 2.11", "torch 2.10", "fails"])
def test_the_cuda_varlen_route_gives_the_cpu_route_logprobs(tiny_model_dir, monkeypatch, kernel):
    from rollstream.trainer import packed_attention

    model = _load(tiny_model_dir).eval()
    micro = pack_rows(_batch(), list(range(4)))
    every = torch.ones(micro.num_tokens, dtype=torch.bool)
    with torch.no_grad():
        expected = packed_token_logprobs(model, micro, positions=every)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(packed_attention, "_VARLEN", broken if kernel == "fails" else _varlen_stand_in)
    params = {"window_size", "enable_gqa", "scale"} if kernel == "torch 2.11" else {"is_causal", "scale"}
    monkeypatch.setattr(packed_attention, "_VARLEN_PARAMS", params)
    monkeypatch.setattr(packed_attention, "_varlen_broken", None)
    monkeypatch.setattr(packed_attention, "_use_varlen", lambda query: packed_attention._varlen_broken is None)
    with torch.no_grad():
        got = packed_token_logprobs(model, micro, positions=every)
    assert torch.allclose(got, expected, atol=1e-5)
    # a kernel that fails is given up once, with its reason, and the CPU route answers
    assert (packed_attention._varlen_broken is None) == (kernel != "fails")


def test_several_mini_batches_take_the_old_logprobs_of_the_policy_each_one_starts_from(tiny_model_dir):
    """mini_batches=2: each half is one optimizer step whose ratio is taken against the model
    as that step finds it (recomputed, as the update always did), with TIS against behaviour."""
    loss = LossConfig(tis_cap=1.5)
    batch = _batch(6)
    model = _load(tiny_model_dir)
    with torch.no_grad():
        current = token_logprobs(model.eval(), batch.input_ids, batch.attention_mask)
        noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(7)) * 0.3
        batch.behaviour_logprobs = (current + noise) * batch.response_mask
    expected_model = copy.deepcopy(model)
    sgd = torch.optim.SGD(expected_model.parameters(), lr=0.5)
    for half in (slice(0, 2), slice(2, 4)):
        mini = batch.select(half)
        with torch.no_grad():  # the recomputation the update used to make before each mini-batch
            old = token_logprobs(expected_model.eval(), mini.input_ids, mini.attention_mask)
        sgd.zero_grad()
        logprobs = token_logprobs(expected_model.train(), mini.input_ids, mini.attention_mask)
        dapo_policy_loss(logprobs, mini.behaviour_logprobs, mini.advantages, mini.response_mask, old_logprobs=old,
                         tis_cap=1.5).loss.backward()
        torch.nn.utils.clip_grad_norm_(expected_model.parameters(), 1.0)
        sgd.step()

    updater = PolicyUpdater(model, loss, OptimConfig(micro_batch_size=1, mini_batches=2))
    updater.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    updater.step(batch)
    for (name, expected), got in zip(expected_model.named_parameters(), model.parameters()):
        assert _close(got.detach(), expected.detach(), rel=1e-5), name


def test_a_model_whose_logits_are_not_plain_lm_head_output_goes_through_its_own_forward(tiny_model_dir, monkeypatch):
    from rollstream.trainer import logprobs

    model = _load(tiny_model_dir).eval()
    micro = pack_rows(_batch(), list(range(4)))
    with torch.no_grad():
        expected = packed_token_logprobs(model, micro, chunk_tokens=5)
        monkeypatch.setattr(logprobs, "_plain_output_layer", lambda model: None)  # e.g. soft-capped logits
        got = packed_token_logprobs(model, micro, chunk_tokens=5)
    assert got.abs().sum() > 0
    assert torch.allclose(got, expected, atol=1e-5)
