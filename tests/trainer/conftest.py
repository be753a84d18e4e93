"""Trainer fixtures: the tiny model (from the test model cache) and a built-in model
server process of our own for weight-sync tests."""

from __future__ import annotations

from pathlib import Path

import model_cache
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return model_cache.load("tiny_model_dir")


@pytest.fixture(scope="session")
def model_server(tiny_model_dir):
    """(process, base_url) of a built-in server on the tiny model, shared by the trainer
    tests; each test publishes the weights (and policy version) it asserts on."""
    from rollstream.llm.server import start_server_process

    proc, base_url = start_server_process(tiny_model_dir)
    yield proc, base_url
    proc.terminate()
    try:
        proc.wait(10)
    except Exception:
        proc.kill()
