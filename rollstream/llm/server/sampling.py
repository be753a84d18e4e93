"""Next-token choice for the built-in server, one sequence at a time, in vLLM's order:
penalties, then temperature, then top-k / top-p / min-p, then a draw from a per-request
seeded generator. Logprobs are reported like vLLM's default `raw_logprobs` mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]

# vLLM treats temperatures this small as greedy (and refuses n > 1 for them).
GREEDY_EPS = 1e-5


@dataclass
class SequenceSampling:
    """One request's sampling settings plus the state they need across steps."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    # Ids that end generation (EOS unless ignore_eos, plus stop_token_ids): masked out
    # until min_tokens have been generated.
    stop_ids: frozenset[int] = frozenset()
    num_top_logprobs: int = 0
    seed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False)

    def make_generator(self, device: torch.device) -> None:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        self.generator = gen

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Choice:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


def _apply_penalties(
    logits: torch.Tensor, s: SequenceSampling, prompt_ids: torch.Tensor, output_ids: torch.Tensor
) -> torch.Tensor:
    if s.repetition_penalty != 1.0:
        # vLLM (like HF) penalises every token seen in the prompt or the output so far.
        seen = torch.unique(torch.cat([prompt_ids, output_ids]))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
    if output_ids.numel() and (s.presence_penalty != 0.0 or s.frequency_penalty != 0.0):
        counts = torch.bincount(output_ids, minlength=logits.numel()).to(logits.dtype)
        logits -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, s: SequenceSampling) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, top-p and min-p exclude."""
    vocab = logits.numel()
    if 0 < s.top_k < vocab:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest head whose mass reaches top_p (the top token always stays).
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before > s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if s.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < s.min_p * probs.max(), float("-inf"))
    return logits


def choose_next(
    logits: torch.Tensor,
    s: SequenceSampling,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    logprobs_mode: LogprobsMode = "raw_logprobs",
) -> Choice:
    """Pick the next token from one sequence's last-position logits ([vocab], any dtype)."""
    raw = logits.float()
    processed = raw.clone()
    if s.needs_history:
        processed = _apply_penalties(processed, s, prompt_ids, output_ids)
    if output_ids.numel() < s.min_tokens and s.stop_ids:
        processed[list(s.stop_ids)] = float("-inf")
    if s.greedy:
        token = int(torch.argmax(processed))
        scaled = processed
    else:
        scaled = _filter(processed / s.temperature, s)
        probs = torch.softmax(scaled, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=s.generator))
    # vLLM's default: log-softmax of the raw model logits (before penalties, temperature
    # and top-k/top-p); processed_logprobs: of the distribution actually sampled from.
    source = raw if logprobs_mode == "raw_logprobs" else scaled
    logprobs = torch.log_softmax(source, dim=-1)
    top: list[tuple[int, float]] = []
    if s.num_top_logprobs > 0:
        values, ids = torch.topk(logprobs, min(s.num_top_logprobs, logprobs.numel()))
        top = list(zip(ids.tolist(), values.tolist()))
    return Choice(token_id=token, logprob=float(logprobs[token]), top_logprobs=top)
