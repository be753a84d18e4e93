"""Log-probabilities of chosen tokens, the only thing the update step (trainer/update.py)
needs from the model's output. Packed forwards (trainer/packing.py) give hidden states;
`chosen_token_logprobs` turns them into log p(token) a chunk of tokens at a time with the
output layer's weight, so neither the [N, V] logits nor a log-softmax of them is ever held
whole, in the forward or the backward. `token_logprobs` is the plain padded computation,
kept as the reference the tests compare with."""

from __future__ import annotations

from typing import Any

import torch

from rollstream.trainer.packed_attention import packed_attention
from rollstream.trainer.packing import PackedMicroBatch

DEFAULT_CHUNK_TOKENS = 1024


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log p(x_t | x_<t) under `model` for a right-padded batch; position 0 (no context) is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    targets = input_ids[:, 1:]
    # gather - logsumexp: never materialises a [B, T, V] log-softmax copy
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1).float()
    logprobs = picked - torch.logsumexp(logits.float(), dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0), value=0.0)


def _chunk_logits_into(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """hidden @ weight.T + bias written into `out` (a float32 buffer reused chunk after chunk:
    on the CPU a fresh [chunk, V] tensor each time costs as much again in page faults)."""
    if weight.dtype == out.dtype:
        torch.mm(hidden, weight.t(), out=out)
    else:
        out.copy_(hidden @ weight.t())
    if bias is not None:
        out.add_(bias)
    return out


class _ChosenTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias)[i, targets[i]], chunk by chunk of rows. The
    backward recomputes each chunk's logits (one more matmul) rather than keep them.

    With p = softmax(logits) and g the incoming gradient, d/d logits = g * (onehot - p): the
    row scale g is applied to the [chunk, H] operands instead of the [chunk, V] probabilities,
    and the onehot term is an index_add of rows, so the [chunk, V] buffer is only written by
    the matmul, shifted and exponentiated."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens):
        tokens = hidden.shape[0]
        out = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        buffer = torch.empty(min(chunk_tokens, tokens), weight.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits_into(buffer[: hidden[rows].shape[0]], hidden[rows], weight, bias)
            picked = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            top = logits.amax(dim=-1)
            lse[rows] = top + logits.sub_(top[:, None]).exp_().sum(dim=-1).log_()
            out[rows] = picked - lse[rows]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        tokens, chunk_tokens = hidden.shape[0], ctx.chunk_tokens
        scaled = hidden * grad_out.to(hidden.dtype)[:, None]  # g * h, [M, H]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # sum over chunks of p.T @ (g * h); float32 unless the weight is float32 and it can be summed in place
        p_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        p_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        buffer = torch.empty(min(chunk_tokens, tokens), weight.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h = hidden[rows]
            probs = _chunk_logits_into(buffer[: h.shape[0]], h, weight, bias).sub_(lse[rows, None]).exp_()
            low = probs if probs.dtype == weight.dtype else probs.to(weight.dtype)
            if need_hidden:
                # g * (W[target] - p @ W)
                grad_hidden[rows] = (weight[targets[rows]] - low @ weight) * grad_out[rows].to(hidden.dtype)[:, None]
            if need_weight:
                if p_weight.dtype == low.dtype:
                    p_weight.addmm_(low.t(), scaled[rows])
                else:
                    p_weight.add_(low.t() @ scaled[rows])
            if need_bias:
                p_bias.add_(probs.t() @ grad_out[rows].float())
        grad_weight = grad_bias = None
        if need_weight:
            grad_weight = p_weight.neg_().index_add_(0, targets, scaled.float()).to(weight.dtype)
        if need_bias:
            grad_bias = p_bias.neg_().index_add_(0, targets, grad_out.float()).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def chosen_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: torch.Tensor | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """[M] float32 log_softmax(hidden @ weight.T + bias)[i, targets[i]] for hidden [M, H],
    weight [V, H]; differentiable in hidden, weight and bias. At most chunk_tokens x V float32
    logits exist at a time."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _ChosenTokenLogprobs.apply(hidden, weight, bias, targets, chunk_tokens)


def _plain_output_layer(model: Any) -> torch.nn.Linear | None:
    """The output layer when logits are exactly lm_head(hidden); None for models that scale
    or soft-cap them (those go through the model's own forward)."""
    head = model.get_output_embeddings()
    config = model.config
    scaled = (getattr(config, "final_logit_softcapping", None) is not None
              or getattr(config, "logit_scale", None) not in (None, 1.0)
              or getattr(config, "logits_scaling", None) not in (None, 1.0))
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if scaled or not isinstance(head, torch.nn.Linear) or base is None or base is model:
        return None
    return head


def packed_forward_kwargs(micro: PackedMicroBatch) -> dict:
    return {
        "input_ids": micro.input_ids[None],
        "position_ids": micro.position_ids[None],
        "use_cache": False,
        # transformers' names for packed-sequence boundaries (its flash kwargs), read by the
        # packed attention
        "cu_seq_lens_q": micro.cu_seqlens,
        "cu_seq_lens_k": micro.cu_seqlens,
        "max_length_q": micro.max_length,
        "max_length_k": micro.max_length,
    }


def packed_token_logprobs(model: Any, micro: PackedMicroBatch, positions: torch.Tensor | None = None,
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """[N] log p(token t | its sequence before t) for a packed micro-batch, at `positions`
    (a [N] bool mask; default: the response tokens, where the loss reads them) and 0 elsewhere.
    Only the chosen positions' logits are ever computed."""
    if positions is None:
        positions = micro.response_mask > 0
    positions = positions.clone()
    positions[micro.cu_seqlens[:-1].long()] = False  # a sequence's first token has no context
    at = positions.nonzero().squeeze(-1)
    out = torch.zeros(micro.num_tokens, dtype=torch.float32, device=micro.input_ids.device)
    kwargs = packed_forward_kwargs(micro)
    head = _plain_output_layer(model)
    with packed_attention(model):
        if head is not None:
            base = getattr(model, model.base_model_prefix)
            hidden = base(**kwargs).last_hidden_state[0]
            picked = chosen_token_logprobs(hidden.index_select(0, at - 1), head.weight, micro.input_ids[at],
                                           bias=head.bias, chunk_tokens=chunk_tokens)
        else:
            logits = model(**kwargs).logits[0].index_select(0, at - 1)
            targets = micro.input_ids[at]
            parts = []
            for start in range(0, logits.shape[0], chunk_tokens):
                chunk = logits[start:start + chunk_tokens].float()
                parts.append(chunk.gather(-1, targets[start:start + chunk_tokens, None]).squeeze(-1)
                             - torch.logsumexp(chunk, dim=-1))
            picked = torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
    return out.index_put((at,), picked)
