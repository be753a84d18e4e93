"""The trainer: the consumer side of rollstream. DAPO loss (loss.py), dynamic sampling
(sampler.py), batches (batch.py), the update step (update.py), weight sync
(weight_sync.py), checkpoints (checkpoint.py) and the loop that joins them (loop.py).

Names are imported lazily so that `import rollstream.trainer` does not import torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "config",
    "LossConfig": "config",
    "OptimConfig": "config",
    "SamplerConfig": "sampler",
    "DynamicSampler": "sampler",
    "RolloutSource": "sampler",
    "Trainer": "loop",
    "train": "loop",
    "ClientRolloutSource": "source",
    "DirectServerSource": "direct_source",
    "WeightPublisher": "weight_sync",
    "BackendSpec": "weight_sync",
    "dapo_policy_loss": "loss",
    "group_advantages": "loss",
    "overlong_penalty": "loss",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollstream.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rollstream.trainer.{module}"), name)
