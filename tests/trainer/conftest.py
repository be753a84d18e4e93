"""Trainer fixtures: the tiny model (built locally, once per session) and a built-in model
server process of our own for weight-sync tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.llm.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-model")


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
