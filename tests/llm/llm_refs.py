"""Reference computations with the model in the test process: what the server's ids and
logprobs must equal."""

from __future__ import annotations

import torch


@torch.inference_mode()
def recompute_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log-softmax of the model's fp32 logits at each output position, one full forward pass."""
    ids = torch.tensor([prompt_ids + output_ids])
    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1
    return [float(logprobs[start + i, t]) for i, t in enumerate(output_ids)]


@torch.inference_mode()
def greedy_reference(model, prompt_ids: list[int], steps: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Greedy decoding by full recomputation each step (no cache, no batching)."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(torch.argmax(logits))
        out.append(token)
        ids.append(token)
        if token in stop_ids:
            break
    return out
