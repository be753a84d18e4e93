"""The harness tests' episode models: a tiny model trained on a harness's calls as the door rendered
them (each call's prompt, then the scripted reply the model is to give: mask 1), saved with those
examples beside it, so that a model of several presets (all_presets_model.py) learns the very same
ones. The per-preset modules (node_clis, mini_swe_scripted, openhands_scripted) capture; this trains."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import groupby
from pathlib import Path

Example = tuple[list[int], list[int]]  # token ids, loss mask (1 on the model's reply)
EXAMPLES = "examples.json"


def train_episode(out: Path, base_folder: Path, examples_of: Callable[..., list[Example]], steps: int = 300) -> Path:
    """The tiny model (built in ``base_folder``) trained on ``examples_of(tokenizer)``, saved to
    ``out`` with its examples; nothing is done when ``out`` holds a trained model already."""
    import torch
    from agent.scripted_model import train_and_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.llm.tiny_model import build_tiny_model

    if (out / "trained.json").exists():
        return out
    base = build_tiny_model(base_folder)
    tokenizer = AutoTokenizer.from_pretrained(base)
    examples = examples_of(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    train_and_save(model, tokenizer, examples, out, steps)
    tmp = out / f".{EXAMPLES}.partial"
    tmp.write_text(json.dumps([[ids, mask] for ids, mask in examples]))
    tmp.rename(out / EXAMPLES)
    return out


def kept_examples(folder: Path) -> list[Example] | None:
    """The examples the model in ``folder`` learnt (None: built before they were kept)."""
    path = folder / EXAMPLES
    return [(ids, mask) for ids, mask in json.loads(path.read_text())] if path.exists() else None


def replies(examples: list[Example]) -> list[list[int]]:
    """The model's own turns in ``examples``: each run of mask 1, in order, each once (a preset
    whose episode was captured in two places, bwrap and podman, learnt the same replies twice)."""
    runs = [tuple(token for token, _ in run) for ids, mask in examples
            for learnt, run in groupby(zip(ids, mask), key=lambda pair: pair[1]) if learnt]
    return [list(run) for run in dict.fromkeys(runs)]
