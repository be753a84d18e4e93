"""DAPO's objective as plain torch functions: group-normalised advantages, overlong reward
shaping and the clip-higher, token-level policy loss. The update step (trainer/update.py)
calls these; nothing here knows about models, Redis or trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per group: (r - mean) / (std + eps), the unbiased std of the group's rewards.

    `rewards` is [B] floats, `group_index` is [B] ints naming each sample's group (any
    integers). A group of one sample gets advantage 0 (there is nothing to compare it with).
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred**2)
    # unbiased (n - 1) like torch.std, the convention of GRPO/DAPO reference code
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    adv = centred / (std[inverse] + eps)
    return torch.where(counts[inverse] > 1, adv, torch.zeros_like(adv)).to(torch.float32)


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_tokens: int,
    overlong_buffer_tokens: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, to be added to the reward.

    0 while |y| <= L_max - L_cache; falls linearly to -1 across the buffer; -1 past L_max.
    `max_response_tokens` is L_max, `overlong_buffer_tokens` is L_cache.
    """
    lengths = response_lengths.to(torch.float32)
    if overlong_buffer_tokens <= 0:
        return torch.where(lengths > max_response_tokens, -1.0, 0.0) * penalty_factor
    expected = max_response_tokens - overlong_buffer_tokens
    inside = (expected - lengths) / overlong_buffer_tokens
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths), inside)
    penalty = torch.where(lengths > max_response_tokens, -torch.ones_like(lengths), penalty)
    return penalty * penalty_factor


@dataclass
class PolicyLossOutput:
    """The scalar to back-propagate and the numbers worth logging (floats, detached)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def dapo_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
) -> PolicyLossOutput:
    """DAPO's clipped surrogate, averaged over every response token of the batch.

    All tensors are [B, T], aligned per token; `advantages` may be [B] (broadcast).
    - ratio = exp(logprobs - proximal), proximal = `old_logprobs` (the trainer's own
      pre-update logprobs) when given, else `behaviour_logprobs` (what the rollout's
      server reported): PPO's ratio against the policy that sampled the tokens.
    - clip-higher: ratio clipped to [1 - clip_low, 1 + clip_high].
    - `tis_cap`: truncated importance sampling for rollout/trainer mismatch; each token's
      loss is weighted by min(exp(proximal - behaviour), tis_cap) (detached). Only has an
      effect when `old_logprobs` differ from the behaviour logprobs.
    - `num_tokens`: the normaliser; pass the token count of the whole batch when this call
      sees one micro-batch, so that accumulated gradients equal the full-batch loss.
    - `ref_logprobs` + `kl_coef` > 0: adds kl_coef * k3(KL to reference) per token.
    """
    mask = response_mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    advantages = advantages.to(logprobs.dtype)
    proximal = (old_logprobs if old_logprobs is not None else behaviour_logprobs).detach()
    log_ratio = (logprobs - proximal) * mask  # masked positions: ratio 1, no overflow
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)

    tis_weight = torch.ones_like(ratio)
    if tis_cap is not None:
        gap = ((proximal - behaviour_logprobs.detach()) * mask).clamp(max=20.0)
        tis_weight = torch.exp(gap).clamp(max=tis_cap)
        per_token = per_token * tis_weight

    kl = torch.zeros_like(ratio)
    if ref_logprobs is not None and kl_coef > 0.0:
        # k3 estimator (Schulman): unbiased, always >= 0
        delta = ((ref_logprobs.detach() - logprobs) * mask).clamp(-20.0, 20.0)
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl

    denominator = float(num_tokens) if num_tokens is not None else float(mask.sum().clamp(min=1.0).item())
    loss = (per_token * mask).sum() / max(denominator, 1.0)

    with torch.no_grad():
        clipped_high = (advantages > 0) & (ratio > 1.0 + clip_high) & (mask > 0)
        clipped_low = (advantages < 0) & (ratio < 1.0 - clip_low) & (mask > 0)
        count = mask.sum().clamp(min=1.0)
        valid_ratio = ratio[mask > 0]
        metrics = {
            "clip_frac": float(((clipped_high | clipped_low).to(mask.dtype).sum() / count).item()),
            "clip_high_frac": float((clipped_high.to(mask.dtype).sum() / count).item()),
            "clip_low_frac": float((clipped_low.to(mask.dtype).sum() / count).item()),
            "ratio_mean": float(valid_ratio.mean().item()) if valid_ratio.numel() else 1.0,
            "ratio_max": float(valid_ratio.max().item()) if valid_ratio.numel() else 1.0,
            "ratio_min": float(valid_ratio.min().item()) if valid_ratio.numel() else 1.0,
            "tis_weight_mean": float(masked_mean(tis_weight, mask).item()),
            "kl": float(masked_mean(kl, mask).item()),
            "tokens": float(mask.sum().item()),
        }
    return PolicyLossOutput(loss=loss, metrics=metrics)
