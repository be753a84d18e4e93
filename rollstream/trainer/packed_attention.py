"""Attention over packed sequences (trainer/packing.py) for a transformers causal LM: each
token attends causally within its own sequence only, given the sequences' boundaries
(cu_seqlens) - no [N, N] mask is built and no work is spent across sequences.

Registered with transformers' AttentionInterface as "rollstream_packed"; `packed_attention`
switches a model to it for the duration of a packed forward. On CUDA with half-precision
weights it runs PyTorch's own variable-length flash attention (torch.nn.attention.varlen);
elsewhere (CPU, float32, an older torch) one causal SDPA call over the sequences right-padded
side by side (attention alone sees the padding)."""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTN_NAME = "rollstream_packed"
_registered = False
_varlen_broken: str | None = None  # why the varlen kernel was given up, once it failed


def _varlen_function():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


_VARLEN, _VARLEN_PARAMS = _varlen_function()
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _repeat_heads(key: torch.Tensor, value: torch.Tensor, groups: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return key.repeat_interleave(groups, dim=dim), value.repeat_interleave(groups, dim=dim)


def _varlen(query, key, value, cu_seqlens, max_length, scaling):
    """query [N, Hq, D], key/value [N, Hkv, D] -> [N, Hq, D]."""
    kwargs: dict[str, Any] = {"scale": scaling}
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)  # causal (torch >= 2.11)
    else:
        kwargs["is_causal"] = True  # torch 2.10
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            key, value = _repeat_heads(key, value, groups, dim=1)
    return _VARLEN(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, **kwargs)


def _padded_sdpa(query, key, value, bounds: list[int], scaling):
    """query [1, Hq, N, D], key/value [1, Hkv, N, D] -> [1, Hq, N, D]: the sequences
    right-padded side by side ([S, H, longest, D]) for one causal SDPA call. Right padding needs
    no mask: a real token's causal window holds only real tokens of its own sequence, and what
    the padding rows compute is dropped. Only attention sees padding; the rest of the model
    runs on the packed row. (One call per sequence instead costs a few small operations per
    sequence and layer, which on a busy CPU cost more than the padding.)"""
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    longest, device = max(lengths), query.device
    starts = torch.tensor(bounds[:-1], device=device)
    offsets = torch.arange(longest, device=device)
    valid = offsets[None, :] < torch.tensor(lengths, device=device)[:, None]  # [S, longest]
    tokens = query.shape[2]
    gather = torch.where(valid, starts[:, None] + offsets[None, :], tokens).view(-1)  # padding -> a zero row
    groups = query.shape[1] // key.shape[1]
    extra: dict[str, Any] = {}
    if groups > 1:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            key, value = _repeat_heads(key, value, groups, dim=1)

    def padded(x):  # [1, H, N, D] -> [S, H, longest, D]
        rows = torch.cat([x[0].transpose(0, 1), x.new_zeros(1, x.shape[1], x.shape[3])])  # [N + 1, H, D]
        return rows.index_select(0, gather).view(len(lengths), longest, x.shape[1], x.shape[3]).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(query), padded(key), padded(value), is_causal=True, scale=scaling,
                                         **extra)
    out = out.transpose(1, 2).reshape(len(lengths) * longest, query.shape[1], query.shape[3])
    return out.index_select(0, valid.view(-1).nonzero().squeeze(-1)).transpose(0, 1).unsqueeze(0)


def _use_varlen(query: torch.Tensor) -> bool:
    """torch's varlen kernel is flash attention: CUDA, half precision."""
    return (_VARLEN is not None and _varlen_broken is None and query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16))


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers attention function: query [1, Hq, N, D], key/value [1, Hkv, N, D] ->
    ([1, N, Hq, D], None). Needs `cu_seq_lens_q` and `max_length_q` in kwargs (the names
    transformers' flash-attention kwargs use), as packed_forward passes them."""
    global _varlen_broken
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    max_length = kwargs.get("max_length_q")
    if cu_seqlens is None or max_length is None:
        raise ValueError(f"attention '{ATTN_NAME}' runs packed forwards only (cu_seq_lens_q and max_length_q); "
                         "call it through rollstream.trainer.logprobs.packed_forward")
    if query.shape[0] != 1:
        raise ValueError(f"a packed forward has one row, got a batch of {query.shape[0]}")
    if sliding_window is not None and max_length > sliding_window:
        raise ValueError(f"a sequence of {max_length} tokens exceeds this model's sliding window ({sliding_window}); "
                         "packed attention does not implement sliding windows: lower optim.max_seq_len")
    if kwargs.get("softcap") is not None:
        raise ValueError("packed attention does not implement attention logit soft-capping (softcap)")
    if dropout:
        raise ValueError("packed attention does not implement attention dropout; set the model's "
                         "attention_dropout to 0")
    if _use_varlen(query):
        try:
            out = _varlen(query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1).contiguous(),
                          value[0].transpose(0, 1).contiguous(), cu_seqlens, max_length, scaling)
            return out.unsqueeze(0), None
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            # an older or different build: stay correct with padded SDPA, and say so once
            _varlen_broken = f"{type(exc).__name__}: {exc}"
            log.warning("torch varlen attention failed (%s); packed attention falls back to SDPA over the "
                        "sequences right-padded", _varlen_broken)
    out = _padded_sdpa(query, key, value, cu_seqlens.tolist(), scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """Mask builder for the packed attention: none is needed, the boundaries travel in cu_seqlens."""
    return


def register() -> None:
    """Make "rollstream_packed" known to transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53 builds masks without this registry
        pass
    else:
        AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    _registered = True


@contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` with packed attention inside the block, its own attention after."""
    register()
    config: Any = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = before
