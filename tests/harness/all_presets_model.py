"""One tiny model that has learnt every shipped preset's arith episode (the four Node.js CLIs',
mini-SWE-agent's, OpenHands'), for the tests against the real vLLM, which serves one model per
server: one server then runs every preset. The presets' prompts differ from their first tokens
(each its own system prompt and tools), so one model holds all their episodes. Its examples are
the very ones each preset's own model learnt (kept beside that model: episode_model.py). Built
by tests/model_cache.py, never in a test."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .episode_model import Example, kept_examples, replies, train_episode

# Each preset, and the fixture of its own arith model in tests/model_cache.py.
SOURCES = (("qwen-code", "qwen_code_model_dir"), ("opencode", "opencode_model_dir"), ("codex", "codex_model_dir"),
           ("claude-code", "claude_code_model_dir"), ("mini-swe-agent", "mini_swe_arith_model_dir"),
           ("openhands-sdk", "openhands_arith_model_dir"))


def trained_folder(parent: Path, which: str = "arith") -> Path:
    """Named by the presets' own models (their names change with what they learn) and this file."""
    import model_cache

    parts = [str(model_cache.MODELS[fixture]().folder) for _, fixture in SOURCES]
    key = hashlib.sha1("\n".join(parts).encode() + Path(__file__).read_bytes()).hexdigest()[:12]
    return parent / f"all-presets-{which}-{key}"


def build(parent: Path, which: str = "arith", steps: int = 300) -> Path:
    """Train the tiny model on every preset's examples at once (each preset's own model built
    first where missing: it keeps them)."""

    def examples_of(tokenizer) -> list[Example]:
        return [example for kept in _by_preset(build_missing=True).values() for example in kept]

    return train_episode(trained_folder(parent, which), parent / "base", examples_of, steps)


def _by_preset(build_missing: bool = False) -> dict[str, list[Example]]:
    import model_cache

    out = {}
    for preset, fixture in SOURCES:
        model = model_cache.MODELS[fixture]()
        examples = kept_examples(model.build() if build_missing else model.folder)
        if examples is None:
            raise RuntimeError(f"{model.folder} keeps no examples: run `python tests/model_cache.py`")
        out[preset] = examples
    return out


def expected_replies() -> dict[str, list[list[int]]]:
    """Each preset's model turns as the model learnt them: the ids its job's calls must get."""
    return {preset: replies(examples) for preset, examples in _by_preset().items()}
