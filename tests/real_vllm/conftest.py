"""Fixtures for the tests against a real, unmodified vLLM: ONE vLLM server per test run
(startup costs minutes on a CPU), serving a writable copy of the arith model so that weight
sync can rewrite it; a built-in server on the same weights and context length beside it; the
arith model loaded here as the transformers reference. Tests that kill vLLM run last."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from rollstream.llm.server import free_port, start_server_process

from .vllm_process import MAX_MODEL_LEN, VLLMServer, not_runnable_reason, start_vllm

HERE = Path(__file__).parent
MODEL_NAME = "arith"


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_vllm: kills the session's vLLM server; runs after every other test")


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(str(item.fspath)).parents]
    if not ours:
        return
    reason = not_runnable_reason()
    for item in ours:
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
        # The first test to ask for vLLM waits for its startup (bounded in vllm_process).
        item.add_marker(pytest.mark.timeout(600))
    killers = [item for item in items if item.get_closest_marker("kills_vllm")]
    items[:] = [item for item in items if item not in killers] + killers


@pytest.fixture(scope="session")
def served_model_dir(arith_model_dir, tmp_path_factory) -> Path:
    """A copy of the arith model that vLLM serves and the weight-sync tests rewrite."""
    served = tmp_path_factory.mktemp("vllm-served") / MODEL_NAME
    shutil.copytree(arith_model_dir, served)
    for file in served.iterdir():
        file.chmod(0o644)
    return served


@pytest.fixture(scope="session")
def vllm_server(served_model_dir, tmp_path_factory) -> VLLMServer:
    log_path = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    server = start_vllm(served_model_dir, free_port(), log_path, MODEL_NAME)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_url(vllm_server) -> str:
    return vllm_server.url


@pytest.fixture(scope="session")
def builtin_url(arith_model_dir):
    """The built-in server on the same weights, name and context length as vLLM."""
    proc, url = start_server_process(arith_model_dir, extra_args=[
        "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME, "--max-batch-size", "8"])
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except Exception:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)


@pytest.fixture(scope="session")
def reference_model(arith_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(arith_model_dir, dtype=torch.float32).eval()


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)
