"""The models the test suite needs, built once into a cache kept across runs
(ROLLSTREAM_TEST_CACHE, else ~/.cache/rollstream/tests) and never inside a test.

`scripts/test` runs `python tests/model_cache.py` before pytest. Fixtures only load from the
cache; when it lacks a model the selected tests need (pytest run directly), conftest's
collection hook builds it before the first test starts, outside every per-test timeout, so
a slow build on a busy machine delays the run instead of failing (or ending) it.

    python tests/model_cache.py            # build what is missing, print each folder
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollstream.demo.arith_model import FORMAT_RECIPE, build_lock, cached_arith_model, recipe_folder_name
from rollstream.llm.tiny_model import _MARKER, _RECIPE_VERSION, build_tiny_model


def cache_dir() -> Path:
    """Built models kept across sessions (ROLLSTREAM_TEST_CACHE, else ~/.cache/rollstream/tests)."""
    return Path(os.environ.get("ROLLSTREAM_TEST_CACHE") or Path.home() / ".cache" / "rollstream" / "tests")


@dataclass(frozen=True)
class CachedModel:
    what: str
    folder: Path
    marker: str  # the file a finished build leaves last
    build: Callable[[], Path]

    @property
    def ready(self) -> bool:
        return (self.folder / self.marker).exists()


def _tiny(seed: int) -> CachedModel:
    folder = cache_dir() / f"tiny-model-v{_RECIPE_VERSION}-seed{seed}"

    def build() -> Path:
        with build_lock(folder):
            return build_tiny_model(folder, seed=seed)

    return CachedModel(f"tiny model, random weights (seed {seed})", folder, _MARKER, build)


def _arith() -> CachedModel:
    return CachedModel("tiny model warmed up on the arith tool-call format",
                       cache_dir() / recipe_folder_name(FORMAT_RECIPE, "arith-model"), "config.json",
                       lambda: cached_arith_model(FORMAT_RECIPE, cache=cache_dir(), prefix="arith-model"))


def _scripted() -> CachedModel:
    from agent.scripted_model import build_scripted_model, recipe_key  # imports torch: only when asked for

    parent = cache_dir() / "agent-model"
    folder = parent / f"scripted-{recipe_key()}"

    def build() -> Path:
        import torch

        # one intra-op thread, as the arith warm-up: two spin-wait on a busy 2-core machine
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with build_lock(folder):
                return build_scripted_model(parent)
        finally:
            torch.set_num_threads(threads)

    return CachedModel("tiny model trained on the agent tests' scripted tool calls", folder, "trained.json", build)


def _verifiers() -> CachedModel:
    # imports verifiers and the test environments: only when asked for
    from tasks.verifiers_scripted import build, trained_folder

    parent = cache_dir() / "verifiers-model"

    def build_it() -> Path:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with build_lock(trained_folder(parent)):
                return build(parent, _tiny(0).build())
        finally:
            torch.set_num_threads(threads)

    return CachedModel("tiny model trained to answer the verifiers test environments", trained_folder(parent),
                       "trained.json", build_it)


def _harness_episode(module: str, which: str, what: str) -> CachedModel:
    """A model that learnt a harness preset's episode by heart (tests/harness/<module>.py: its
    ``trained_folder`` and ``build``, which installs the preset on this host where it is missing)."""
    import importlib

    episodes = importlib.import_module(f"harness.{module}")  # imports torch: only when asked for
    parent = cache_dir() / module
    folder = episodes.trained_folder(parent, which)

    def build() -> Path:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with build_lock(folder):
                return episodes.build(parent, which)
        finally:
            torch.set_num_threads(threads)

    return CachedModel(what, folder, "trained.json", build)


# fixture name -> the model it loads
MODELS: dict[str, Callable[[], CachedModel]] = {
    "tiny_model_dir": lambda: _tiny(0),
    "tiny_model_seed1_dir": lambda: _tiny(1),
    "arith_model_dir": _arith,
    "scripted_model_dir": _scripted,
    "answering_model_dir": _verifiers,
    "mini_swe_arith_model_dir": lambda: _harness_episode("mini_swe_scripted", "arith",
                                                         "tiny model that learnt a mini-SWE-agent arith episode"),
    "mini_swe_swe_model_dir": lambda: _harness_episode("mini_swe_scripted", "swe",
                                                       "tiny model that learnt a mini-SWE-agent SWE episode"),
    "openhands_arith_model_dir": lambda: _harness_episode("openhands_scripted", "arith",
                                                          "tiny model that learnt an OpenHands SDK arith episode"),
    "openhands_swe_model_dir": lambda: _harness_episode("openhands_swe", "swe",
                                                        "tiny model that learnt an OpenHands SDK SWE episode"),
    "qwen_code_model_dir": lambda: _harness_episode("node_clis", "qwen-code",
                                                    "tiny model that learnt a Qwen Code arith episode"),
    "opencode_model_dir": lambda: _harness_episode("node_clis", "opencode",
                                                   "tiny model that learnt an OpenCode arith episode"),
    "codex_model_dir": lambda: _harness_episode("node_clis", "codex",
                                                "tiny model that learnt a Codex CLI arith episode"),
    "claude_code_model_dir": lambda: _harness_episode("node_clis", "claude-code",
                                                      "tiny model that learnt a Claude Code arith episode"),
    "codex_swe_model_dir": lambda: _harness_episode("node_clis", "codex-swe",
                                                    "tiny model that learnt a Codex CLI SWE episode"),
    "claude_code_swe_model_dir": lambda: _harness_episode("node_clis", "claude-code-swe",
                                                          "tiny model that learnt a Claude Code SWE episode"),
    "qwen_code_swe_model_dir": lambda: _harness_episode("node_clis", "qwen-code-swe",
                                                        "tiny model that learnt a Qwen Code SWE episode"),
    "opencode_swe_model_dir": lambda: _harness_episode("node_clis", "opencode-swe",
                                                       "tiny model that learnt an OpenCode SWE episode"),
    # For the real vLLM (one model per server): every preset's arith episode in one model.
    "all_presets_arith_model_dir": lambda: _harness_episode("all_presets_model", "arith",
                                                            "tiny model that learnt every preset's arith episode"),
}


def load(fixture: str) -> Path:
    """The cached folder of ``fixture``'s model; built here only when the cache lacks it
    (conftest builds missing models before the tests start, so this is a fallback)."""
    model = MODELS[fixture]()
    if not model.ready:
        print(f"\n[model cache] building {model.what} into {model.folder} inside a test; "
              "run `python tests/model_cache.py` first", file=sys.stderr)
    return model.build()


def build_missing(fixtures: set[str] | None = None, say: Callable[[str], None] = print) -> list[Path]:
    """Build the models of ``fixtures`` (default: all) that the cache lacks; returns every folder."""
    folders = []
    for name in sorted(MODELS if fixtures is None else fixtures & MODELS.keys()):
        model = MODELS[name]()
        if not model.ready:
            say(f"[model cache] building the {model.what} into {model.folder} (once; cached for later runs)")
            started = time.monotonic()
            model.build()
            say(f"[model cache] built in {time.monotonic() - started:.0f} s")
        folders.append(model.folder)
    return folders


if __name__ == "__main__":  # run as a script, tests/ is on sys.path: `agent.scripted_model` as pytest names it
    for path in build_missing():
        print(path)
