"""Fixtures of the door's tests: a started door server, the arith model's tokenizer, and a door on
the arith server that samples greedily, with the official clients of its APIs."""

from __future__ import annotations

import anthropic
import model_cache
import pytest
from openai import AsyncOpenAI

from rollstream.agent.gateway import Gateway
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import SamplingParams
from rollstream.llm.session import LLMSession

from .test_gateway import RecordingClient

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture
async def gateway():
    gw = await Gateway().start()
    yield gw
    await gw.aclose()


@pytest.fixture(scope="module")
def tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)


@pytest.fixture
async def door(gateway, arith_server, tokenizer):
    """A door on the arith server that samples greedily, its backend link recording each call;
    ``door.client`` speaks OpenAI's APIs to it, ``door.anthropic`` Anthropic's (which adds
    /v1/messages itself and sends the key as x-api-key)."""
    backend = RecordingClient()
    door = gateway.open("job-p", LLMSession(backend, "job-p", backend_url=arith_server), tokenizer,
                        AgentSettings(max_tokens_per_turn=48, max_context_tokens=1024, sampling=GREEDY))
    door.backend = backend
    door.client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    door.anthropic = anthropic.AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=door.key,
                                              max_retries=0)
    yield door
    await door.client.close()
    await door.anthropic.close()
    await backend.aclose()


class PresetServer:
    """One built-in server for the presets' pipeline tests, serving one model at a time: a test's
    model is swapped in as a trainer's weight sync loads a policy (/v1/load_weights), instead of a
    server start (torch and a model load, seconds of CPU) per model. Every model the presets'
    tests serve is the tiny base trained on an episode: same architecture, tokenizer and template."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.model_dir = None
        self._server = None

    def serving(self, model_dir) -> str:
        """The server's base URL, serving ``model_dir``'s weights from now on."""
        import httpx

        from rollstream.llm.server import served_model

        from .node_clis import CLIS

        if self._server is None:
            # The longest context a preset's SWE episode is served (as on vLLM: the presets module's);
            # the arith episodes fit well within it, and no test asks for more.
            longest = max(cli.swe_context_tokens for cli in CLIS.values())
            self._server = served_model(model_dir, device="cpu", extra_args=["--max-model-len", str(longest)])
            self.url = self._server.__enter__()
        elif model_dir != self.model_dir:
            loaded = httpx.post(f"{self.url}/v1/load_weights", json={"path": str(model_dir)}, timeout=300)
            assert loaded.status_code == 200, loaded.text
        self.model_dir = model_dir
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def preset_server():
    """``preset_server.serving(model_dir)``: the URL of the presets' one built-in server, serving
    that model (started on the first test's model; PresetServer)."""
    server = PresetServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def module_settings(redis_url, tmp_path_factory):
    """Pipeline settings of one namespace for a whole module (its module_pool's), on the session Redis."""
    import uuid

    from pipeline_env import FAST

    from rollstream.config import Settings

    return Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}", node="n1",
                    data_dir=tmp_path_factory.mktemp("data"), **FAST)


@pytest.fixture(scope="module")
def module_pool(module_settings, tmp_path_factory):
    """``module_pool(model_dir, env, concurrency=2)``: the module's one worker pool (started at the
    first call, with that tokenizer, the operator's ``env`` and that many jobs in flight per stage;
    later calls get the same pool) on a sandbox root of
    its own: a pool start and stop per test (three processes, the run worker's tokenizer) once
    per module. Each test still submits its own jobs, as its own submitter, to the backend it names
    (node_clis.run_jobs makes it the namespace's only one)."""
    import asyncio
    import os
    import shutil
    import tempfile

    from pipeline_env import settings_env

    from rollstream.sandboxes import reaper
    from rollstream.sandboxes.supervisor_spawn import stop_fork_server
    from rollstream.workers.pool import WorkerPool

    root = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # as tests/conftest.py's sandbox_root
    os.chmod(root, 0o711)
    pools: list[WorkerPool] = []

    def start(model_dir, env: dict[str, str], concurrency: int = 2) -> WorkerPool:
        if not pools:
            s = module_settings.model_copy(update={"model_dir": model_dir, "sandbox_root": root})
            pool = WorkerPool(redis_url=s.redis_url, namespace=s.namespace, node=s.node, data_dir=s.data_dir,
                              env={**settings_env(s), **env}, log_dir=tmp_path_factory.mktemp("pool-logs"))
            pool.start_all(concurrency=concurrency)
            pools.append(pool)
        return pools[0]

    yield start
    for pool in pools:
        pool.stop(timeout_s=15)
    asyncio.run(stop_fork_server(root))
    reaper.reap_finished_children()
    shutil.rmtree(root, ignore_errors=True)


# Each preset's SWE model, by tests/model_cache.py's name for it (the fixture's name: conftest builds
# a missing one before the tests start).
SWE_MODELS = {"mini-swe-agent": "mini_swe_swe_model_dir", "codex": "codex_swe_model_dir",
              "claude-code": "claude_code_swe_model_dir", "qwen-code": "qwen_code_swe_model_dir",
              "opencode": "opencode_swe_model_dir", "openhands-sdk": "openhands_swe_model_dir"}


def _cached(fixture: str):
    def model():
        return model_cache.load(fixture)

    return pytest.fixture(scope="module", name=fixture)(model)


(mini_swe_swe_model_dir, codex_swe_model_dir, claude_code_swe_model_dir, qwen_code_swe_model_dir,
 opencode_swe_model_dir, openhands_swe_model_dir) = (_cached(fixture) for fixture in SWE_MODELS.values())


@pytest.fixture(scope="module")
def tiny_model_dir():
    """The tiny model's random weights (the base every episode model was trained from): a model that
    emits garbage."""
    return model_cache.load("tiny_model_dir")


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The shipped SWE instance's environment image and every preset's layer on it
    (swe_podman_image.py; scripts/install-harnesses built them: cached)."""
    from rollstream.sandboxes.backends.docker import DockerBackend

    from . import swe_podman_image

    if not DockerBackend().available():
        pytest.fail("no container engine answers at DOCKER_HOST (scripts/install-podman sets up podman's)")
    return swe_podman_image.build(tmp_path_factory.mktemp("instances"))


@pytest.fixture(scope="module")
def swe_model_dirs(mini_swe_swe_model_dir, codex_swe_model_dir, claude_code_swe_model_dir, qwen_code_swe_model_dir,
                   opencode_swe_model_dir, openhands_swe_model_dir) -> dict:
    """{preset: the folder of its SWE model}, every shipped preset's."""
    models = locals()
    return {preset: models[fixture] for preset, fixture in SWE_MODELS.items()}
