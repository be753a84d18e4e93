"""Every segment of a multi-chain job trained by TRL's GRPOTrainer.

A black-box harness job can make several exact segments (sub-agents, a compacted history; README
"Several call chains in one job"). TRL's ``rollout_func`` contract is one completion per prompt
row, so ``RolloutFunc`` hands TRL each job's last segment as the row and its earlier segments
under ``rollstream_segments``. ``RollstreamGRPOTrainer`` lets TRL score and normalise the rows as
usual (one row per job: GRPO's group statistics count jobs, never segments), then adds one row
per earlier segment carrying its job's advantage, its own exact ids, rollout logprobs and loss
mask, before the batch is shuffled and split for the update steps.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    import trl
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError(f"rollstream.integrations.trl_segments needs TRL ({exc}); install it with "
                      "'pip install rollstream[trl]'") from exc

from rollstream.integrations.trl import SEGMENTS_KEY

log = logging.getLogger(__name__)

# Tensors of TRL's generation batch that are [B, completion length], and the value that pads them.
_COMPLETION_PADS = {"completion_ids": None, "completion_mask": 0, "tool_mask": 1, "sampling_per_token_logps": 0.0,
                    "old_per_token_logps": 0.0, "ref_per_token_logps": 0.0}


class RollstreamGRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` that trains every segment of a job that made several (use it with
    ``rollout_func=RolloutFunc(...)``; with one segment per job it is GRPOTrainer unchanged).

    Each earlier segment becomes a row of its own with its job's advantage, so every model token
    of every chain enters the loss once. How much a job's extra rows weigh follows TRL's
    ``loss_type``: per token for "dapo"/"bnpo" (as rollstream's DAPO trainer), per row for "grpo"."""

    trains_every_segment = True  # RolloutFunc warns when a plain GRPOTrainer would drop segments

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return batch  # evaluation scores jobs; it trains nothing
        # TRL merged the rollout function's extra fields into the inputs; the slice is this process's.
        segments = [list(inp.get(SEGMENTS_KEY) or ()) for inp in inputs]
        return add_segment_rows(self, batch, segments)


def add_segment_rows(trainer: Any, batch: dict[str, Any], segments: list[list[dict]]) -> dict[str, Any]:
    """``batch`` (TRL's generation batch, one row per job) with a row per earlier segment appended;
    ``segments[i]`` are job i's earlier segments (``RolloutFunc``'s ``rollstream_segments``)."""
    extra = [(row, seg) for row, segs in enumerate(segments) for seg in segs]
    if "importance_sampling_ratio" in batch and extra:
        raise ValueError("RollstreamGRPOTrainer cannot add segment rows under vLLM importance sampling "
                         "(use_vllm with vllm_importance_sampling_correction): set "
                         "vllm_importance_sampling_correction=False, or run jobs that make one segment")
    # split_tensor_dict cuts the batch into steps_per_generation equal parts and drops the rest:
    # rows with nothing to learn (mask 0, advantage 0) fill the last part.
    steps = max(int(getattr(trainer.args, "steps_per_generation", 1) or 1), 1)
    fill = -(len(batch["prompt_ids"]) + len(extra)) % steps
    pad_id = trainer._tokenizer.pad_token_id
    prompts = [list(seg["prompt_ids"]) for _row, seg in extra] + [[pad_id]] * fill
    completions = [list(seg["completion_ids"]) for _row, seg in extra] + [[pad_id]] * fill
    if not prompts:
        return batch
    device = batch["prompt_ids"].device
    width_p = max(batch["prompt_ids"].size(1), *(len(p) for p in prompts))
    width_c = max(batch["completion_ids"].size(1), *(len(c) for c in completions))

    new: dict[str, torch.Tensor] = {
        "prompt_ids": _rows(prompts, width_p, pad_id, torch.long, left=True),
        "prompt_mask": _rows([[1] * len(p) for p in prompts[:len(extra)]] + [[0]] * fill, width_p, 0, torch.long,
                             left=True),
        "completion_ids": _rows(completions, width_c, pad_id, torch.long),
        "completion_mask": _rows([[1] * len(c) for c in completions[:len(extra)]] + [[0]] * fill, width_c, 0,
                                 torch.long),
        "tool_mask": _rows([list(seg["env_mask"]) for _row, seg in extra] + [[0]] * fill, width_c, 1, torch.long),
        "sampling_per_token_logps": _rows([list(seg["logprobs"]) for _row, seg in extra] + [[0.0]] * fill, width_c,
                                          0.0, torch.float32),
    }
    if getattr(trainer, "mask_truncated_completions", False):  # TRL's rule, applied to the new rows alike
        ends = {*trainer.eos_token_ids, pad_id}
        cut = torch.tensor([c[-1] not in ends for c in completions])
        new["completion_mask"] = new["completion_mask"] * (~cut).unsqueeze(1).long()
    new = {k: v.to(device) for k, v in new.items()}
    advantages = batch["advantages"]
    new["advantages"] = torch.cat([advantages[[row for row, _seg in extra]],
                                   advantages.new_zeros(fill)]) if extra else advantages.new_zeros(fill)
    if "old_per_token_logps" in batch:
        new["old_per_token_logps"] = _logps(trainer, trainer.model, new)
    if "ref_per_token_logps" in batch:
        if trainer.ref_model is None:
            raise ValueError("RollstreamGRPOTrainer adds segment rows with a reference model only "
                             "(beta=0, or a ref_model); a PEFT adapter's base as reference is not supported")
        new["ref_per_token_logps"] = _logps(trainer, trainer.ref_model, new)

    out = dict(batch)
    for key, tensor in new.items():
        if key == "advantages":
            out[key] = torch.cat([batch[key], tensor])
            continue
        if key not in batch:
            continue
        old = batch[key]
        if key.startswith("prompt"):
            old = _widen(old, width_p, pad_id if key == "prompt_ids" else 0, left=True)
        else:
            pad = _COMPLETION_PADS[key]
            old = _widen(old, width_c, pad_id if pad is None else pad)
        out[key] = torch.cat([old, tensor.to(old.dtype)])
    loss_mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
    out["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
    log.debug("added %d segment rows (%d filler) to a batch of %d jobs", len(extra), fill, len(batch["prompt_ids"]))
    return out


def _rows(values: list[list], width: int, pad: Any, dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    out = torch.full((len(values), width), pad, dtype=dtype)
    for i, row in enumerate(values):
        if row:
            start = width - len(row) if left else 0
            out[i, start:start + len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _widen(tensor: torch.Tensor, width: int, pad: Any, left: bool = False) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    filler = tensor.new_full((tensor.size(0), missing), pad)
    return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)


def _logps(trainer: Any, model: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token logprobs of the new rows under ``model``, as TRL computes them for its own."""
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, rows["completion_ids"].size(1), batch_size=trainer.args.per_device_train_batch_size)
    return logps
