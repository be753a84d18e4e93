"""The update step: from a PaddedBatch to new parameters. Sequences are packed into
micro-batches without padding (trainer/packing.py), the chosen tokens' log-probabilities
computed a chunk at a time from hidden states (trainer/logprobs.py), the DAPO loss
(trainer/loss.py) normalised by the batch's response-token count, backward, clip, AdamW
step. Plain torch, synchronous; the loop runs it in a thread."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rollstream.trainer.batch import PaddedBatch
from rollstream.trainer.config import LossConfig, OptimConfig
from rollstream.trainer.logprobs import packed_token_logprobs, token_logprobs
from rollstream.trainer.loss import dapo_policy_loss
from rollstream.trainer.packing import PackedMicroBatch, micro_batch_rows, pack_rows

__all__ = ["PolicyUpdater", "UpdateStats", "token_logprobs"]


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

    def _micro_batches(self, batch: PaddedBatch) -> list[PackedMicroBatch]:
        config = self.optim_config
        rows = micro_batch_rows(batch, config.micro_batch_size, config.micro_batch_tokens)
        return [pack_rows(batch, group).to(self.device) for group in rows]

    @torch.no_grad()
    def _reference_logprobs(self, micros: list[PackedMicroBatch]) -> list[torch.Tensor]:
        """The reference policy's logprobs of the response tokens: it never changes, so once per batch."""
        reference = self.reference
        if reference is None:
            raise ValueError("kl_coef > 0 needs a reference model: pass reference= to PolicyUpdater")
        was_training = reference.training
        reference.eval()
        try:
            return [packed_token_logprobs(reference, micro, chunk_tokens=self.optim_config.logprob_chunk_tokens)
                    for micro in micros]
        finally:
            reference.train(was_training)

    def step(self, batch: PaddedBatch) -> UpdateStats:
        started = time.perf_counter()
        config, loss_config = self.optim_config, self.loss_config
        self.model.train()
        # trainer-side old logprobs: needed for the TIS correction, and as the ratio's
        # denominator when one batch feeds several optimizer steps. Each mini-batch takes one
        # optimizer step, so its old policy is the model as it stands when its forward runs:
        # they are that forward's own logprobs, detached (no second pass).
        need_old = loss_config.tis_cap is not None or config.mini_batches > 1
        use_reference = self.reference is not None and loss_config.kl_coef > 0
        totals: dict[str, float] = {}
        losses, norms = [], []
        size = len(batch)
        per_mini = -(-size // config.mini_batches)
        minis = [batch.select(slice(start, start + per_mini)) for start in range(0, size, per_mini)]
        packed = [self._micro_batches(mini) for mini in minis]
        refs = [self._reference_logprobs(micros) if use_reference else None for micros in packed]
        for mini, micros, ref in zip(minis, packed, refs):
            num_tokens = float(max(mini.num_response_tokens, 1))
            self.optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            for i, micro in enumerate(micros):
                logprobs = packed_token_logprobs(self.model, micro, chunk_tokens=config.logprob_chunk_tokens)[None]
                out = dapo_policy_loss(
                    logprobs,
                    micro.behaviour_logprobs[None],
                    micro.advantages[None],
                    micro.response_mask[None],
                    old_logprobs=logprobs.detach() if need_old else None,
                    clip_low=loss_config.clip_low,
                    clip_high=loss_config.clip_high,
                    tis_cap=loss_config.tis_cap,
                    ref_logprobs=ref[i][None] if ref is not None else None,
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
