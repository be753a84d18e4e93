"""End-to-end fixtures: the arith-warmed tiny model (built once and cached across sessions),
the built-in server serving it, registered in the balancer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLSTREAM_TEST_CACHE", Path.home() / ".cache" / "rollstream" / "tests"))


@pytest.fixture(scope="session")
def arith_model_dir() -> Path:
    from rollstream.llm.format_pretrain import build_arith_model

    return build_arith_model(cache_dir() / "arith-model")


@pytest.fixture(scope="session")
def arith_server(arith_model_dir):
    from rollstream.llm.server.app import start_server_process

    proc, url = start_server_process(arith_model_dir, device="cpu")
    yield url
    proc.terminate()
    proc.wait(30)
