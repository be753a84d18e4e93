"""Checkpoints of a training run: model (safetensors via save_pretrained), optimizer,
sampler state, step, policy version and every RNG, written atomically under
`{output_dir}/checkpoints/step-NNNNNN`, so a resumed run takes the same next step."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field

from rollstream.trainer.weight_sync import atomic_folder

log = logging.getLogger(__name__)

_STATE = "trainer_state.json"
_OPTIMIZER = "optimizer.pt"
_RNG = "rng.pt"
_MODEL = "model"


class CheckpointMeta(BaseModel):
    step: int = Field(description="training steps completed")
    policy_version: int = Field(description="policy version the saved weights are published as")
    sampler: dict[str, Any] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path | str,
    *,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    meta: CheckpointMeta,
    keep: int = 2,
) -> Path:
    """Write step-NNNNNN under root (via a temp folder + rename) and prune to `keep`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{meta.step:06d}"
    with atomic_folder(final) as tmp:
        model.save_pretrained(tmp / _MODEL, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / _MODEL)
        torch.save(optimizer.state_dict(), tmp / _OPTIMIZER)
        torch.save(rng_state(), tmp / _RNG)
        (tmp / _STATE).write_text(meta.model_dump_json(indent=2))
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint written: %s", final)
    return final


def list_checkpoints(root: Path | str) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders of interrupted writes are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / _STATE).exists()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def latest_checkpoint(root: Path | str) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def model_dir(checkpoint: Path | str) -> Path:
    """The from_pretrained folder inside a checkpoint."""
    return Path(checkpoint) / _MODEL


def load_checkpoint(
    checkpoint: Path | str, *, optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True
) -> CheckpointMeta:
    """Restore the optimizer (its params must be the model loaded from `model_dir(checkpoint)`)
    and the RNGs; return the step, policy version and sampler state to hand on."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / _STATE).exists():
        raise FileNotFoundError(
            f"{checkpoint} is not a complete checkpoint (no {_STATE}); pick another with list_checkpoints"
        )
    meta = CheckpointMeta.model_validate(json.loads((checkpoint / _STATE).read_text()))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(checkpoint / _OPTIMIZER, map_location="cpu", weights_only=False))
    if restore_rng:
        set_rng_state(torch.load(checkpoint / _RNG, weights_only=False))
    return meta
