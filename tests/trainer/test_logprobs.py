"""Chosen-token log-probabilities a chunk at a time equal the full log-softmax, in value
and in gradient, for every chunk size (one token, uneven, larger than the input)."""

from __future__ import annotations

import pytest
import torch

from rollstream.trainer.logprobs import chosen_token_logprobs


def _inputs(dtype, bias: bool, tokens: int = 11, hidden: int = 16, vocab: int = 50):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_(True)
    b = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_(True) if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    upstream = torch.randn(tokens, generator=gen, dtype=torch.float64)
    return h, w, b, targets, upstream


def _straightforward(h, w, b, targets):
    logits = h @ w.t() + (b if b is not None else 0)
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 11, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax(chunk_tokens, bias):
    h, w, b, targets, upstream = _inputs(torch.float64, bias)
    expected = _straightforward(h, w, b, targets)
    grads_expected = torch.autograd.grad((expected * upstream).sum(), [h, w] + ([b] if bias else []))
    got = chosen_token_logprobs(h, w, targets, bias=b, chunk_tokens=chunk_tokens)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, atol=1e-6)
    grads = torch.autograd.grad((got.double() * upstream).sum(), [h, w] + ([b] if bias else []))
    for name, a, e in zip(("hidden", "weight", "bias"), grads, grads_expected):
        assert torch.allclose(a, e, atol=1e-6), name


def test_chunked_logprobs_in_bfloat16_match_the_float32_computation_to_bfloat16_precision():
    h, w, _b, targets, upstream = _inputs(torch.float32, False, tokens=40, hidden=64, vocab=300)
    expected = _straightforward(h, w, None, targets)
    grad_h, grad_w = torch.autograd.grad((expected * upstream).sum(), [h, w])
    hb, wb = h.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    got = chosen_token_logprobs(hb, wb, targets, chunk_tokens=16)
    got_h, got_w = torch.autograd.grad((got.double() * upstream).sum(), [hb, wb])
    assert got_h.dtype == torch.bfloat16 and got_w.dtype == torch.bfloat16
    assert (got.double() - expected).abs().max() < 0.1
    for a, e in ((got_h, grad_h), (got_w, grad_w)):
        assert torch.allclose(a.double(), e.double(), atol=0.05 * e.abs().max().item())


def test_chunk_size_must_be_positive():
    h, w, _b, targets, _ = _inputs(torch.float32, False)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chosen_token_logprobs(h, w, targets, chunk_tokens=0)
