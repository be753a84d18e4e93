"""Fixtures for the agent-loop tests: a tiny model trained to emit scripted tool calls,
built-in server processes serving it, a calculator tool box, and a recording client (the
real vLLM client, keeping each Generation so tests can compare ids with the trajectory)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import model_cache
import pytest

from rollstream.agent.tools import FunctionToolBox
from rollstream.llm.inference_client import VLLMClient

from .scripted_model import CALCULATOR


@pytest.fixture(scope="session")
def scripted_model_dir() -> Path:
    return model_cache.load("scripted_model_dir")


@pytest.fixture(scope="session")
def tokenizer(scripted_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scripted_model_dir)


@pytest.fixture(scope="session")
def reference_model(scripted_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(scripted_model_dir, dtype=torch.float32).eval()


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def model_server(scripted_model_dir):
    from rollstream.llm.server import start_server_process

    proc, base_url = start_server_process(scripted_model_dir)
    yield base_url
    stop_server(proc)


@pytest.fixture
def two_servers(scripted_model_dir):
    """Two private servers (processes) for tests that kill one; yields [(proc, url), ...]."""
    from concurrent.futures import ThreadPoolExecutor

    from rollstream.llm.server import start_server_process

    with ThreadPoolExecutor(2) as pool:  # start both at once: each takes seconds to load
        servers = list(pool.map(lambda _: start_server_process(scripted_model_dir), range(2)))
    yield servers
    for proc, _ in servers:
        stop_server(proc)


class RecordingClient(VLLMClient):
    """The real client; it also keeps every Generation it returned, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.generations = []

    async def generate(self, base_url, prompt_ids, params, timeout_s=None):
        gen = await super().generate(base_url, prompt_ids, params, timeout_s)
        self.generations.append(gen)
        return gen


@pytest.fixture
async def client():
    c = RecordingClient()
    yield c
    await c.aclose()


def calculate(expression: str) -> str:
    allowed = set("0123456789+-*/() .")
    if not set(expression) <= allowed:
        raise ValueError(f"only arithmetic is allowed, got {expression!r}")
    return str(eval(expression))  # noqa: S307 - restricted to arithmetic characters above


@pytest.fixture
def calculator() -> FunctionToolBox:
    return FunctionToolBox().add(CALCULATOR, calculate)
