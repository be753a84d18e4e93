"""Fixtures for the LLM side: the tiny local model (from the test model cache, no download) and
a built-in model server process serving it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import model_cache
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Folder with the tiny Qwen2-architecture model and its chat-template tokenizer."""
    return model_cache.load("tiny_model_dir")


@pytest.fixture(scope="session")
def tiny_model_seed1_dir() -> Path:
    """The same architecture with other weights (seed 1): a 'new policy' to load."""
    return model_cache.load("tiny_model_seed1_dir")


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir):
    """The tiny model loaded in this process (fp32, CPU) to recompute what the server says."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def model_server(tiny_model_dir):
    """A built-in server process shared by the read-only tests; yields its base URL."""
    from rollstream.llm.server import start_server_process

    proc, base_url = start_server_process(tiny_model_dir)
    yield base_url
    _stop(proc)


@pytest.fixture
def private_model_server(tiny_model_dir):
    """A server process of its own, for tests that change weights or kill it; yields
    (process, base_url)."""
    from rollstream.llm.server import start_server_process

    proc, base_url = start_server_process(tiny_model_dir)
    yield proc, base_url
    _stop(proc)
