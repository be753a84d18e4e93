"""The update step: from a PaddedBatch to new parameters. Forward in micro-batches,
DAPO loss (trainer/loss.py) normalised by the batch's response-token count, backward,
clip, AdamW step. Plain torch, synchronous; the loop runs it in a thread."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rollstream.trainer.batch import PaddedBatch
from rollstream.trainer.config import LossConfig, OptimConfig
from rollstream.trainer.loss import dapo_policy_loss


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log p(x_t | x_<t) under `model`; position 0 (no context) is 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    targets = input_ids[:, 1:]
    # gather - logsumexp: never materialises a [B, T, V] log-softmax copy
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1).float()
    logprobs = picked - torch.logsumexp(logits.float(), dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0), value=0.0)


@dataclass
class UpdateStats:
    loss: float
    grad_norm: float
    tokens: int
    response_tokens: int
    seconds: float
    metrics: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class PolicyUpdater:
    """Owns the optimizer; `step(batch)` does one DAPO update on the model in place."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: LossConfig,
        optim: OptimConfig,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.loss_config = loss
        self.optim_config = optim
        self.reference = reference
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
        )

    @torch.no_grad()
    def _logprobs_of(self, model: torch.nn.Module, batch: PaddedBatch) -> list[torch.Tensor]:
        was_training = model.training
        model.eval()
        out = []
        for micro in batch.micro_batches(self.optim_config.micro_batch_size):
            micro = micro.to(self.device)
            out.append(token_logprobs(model, micro.input_ids, micro.attention_mask))
        model.train(was_training)
        return out

    def step(self, batch: PaddedBatch) -> UpdateStats:
        started = time.perf_counter()
        config, loss_config = self.optim_config, self.loss_config
        self.model.train()
        # trainer-side old logprobs: needed for the TIS correction, and as the ratio's
        # denominator when one batch feeds several optimizer steps
        need_old = loss_config.tis_cap is not None or config.mini_batches > 1
        totals: dict[str, float] = {}
        losses, norms = [], []
        size = len(batch)
        per_mini = -(-size // config.mini_batches)
        for start in range(0, size, per_mini):
            mini = batch.select(slice(start, start + per_mini))
            old = self._logprobs_of(self.model, mini) if need_old else None
            ref = self._logprobs_of(self.reference, mini) if self.reference is not None and loss_config.kl_coef > 0 else None
            num_tokens = float(max(mini.num_response_tokens, 1))
            self.optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            for i, micro in enumerate(mini.micro_batches(config.micro_batch_size)):
                micro = micro.to(self.device)
                logprobs = token_logprobs(self.model, micro.input_ids, micro.attention_mask)
                out = dapo_policy_loss(
                    logprobs,
                    micro.behaviour_logprobs,
                    micro.advantages,
                    micro.response_mask,
                    old_logprobs=old[i] if old is not None else None,
                    clip_low=loss_config.clip_low,
                    clip_high=loss_config.clip_high,
                    tis_cap=loss_config.tis_cap,
                    ref_logprobs=ref[i] if ref is not None else None,
                    kl_coef=loss_config.kl_coef,
                    num_tokens=num_tokens,
                )
                out.loss.backward()
                mini_loss += float(out.loss.item())
                weight = out.metrics["tokens"]
                for key, value in out.metrics.items():
                    if key in ("ratio_max",):
                        totals[key] = max(totals.get(key, value), value)
                    elif key in ("ratio_min",):
                        totals[key] = min(totals.get(key, value), value)
                    elif key == "tokens":
                        totals[key] = totals.get(key, 0.0) + value
                    else:  # token-weighted means
                        totals[key] = totals.get(key, 0.0) + value * weight
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            self.optimizer.step()
            losses.append(mini_loss)
            norms.append(float(norm))
        token_count = max(totals.get("tokens", 0.0), 1.0)
        metrics = {
            k: (v if k in ("ratio_max", "ratio_min", "tokens") else v / token_count) for k, v in totals.items()
        }
        return UpdateStats(
            loss=sum(losses) / len(losses),
            grad_norm=sum(norms) / len(norms),
            tokens=batch.num_tokens,
            response_tokens=batch.num_response_tokens,
            seconds=time.perf_counter() - started,
            metrics=metrics,
        )
