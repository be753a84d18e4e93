"""`vllm_reload` weight sync into a real vLLM (dev mode): from the trainer's WeightPublisher and
from the TRL callback, vLLM's next outputs are the new policy's; the served files keep their
mode; a sync that fails leaves the folder holding the weights vLLM serves; the balancer
records which version each backend serves."""

from __future__ import annotations

import stat

import httpx
import pytest
import torch
from redis.asyncio import Redis
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState

from rollstream.integrations.trl_weight_sync import WeightSyncCallback
from rollstream.llm import SamplingParams, VLLMClient
from rollstream.llm.balancer import Balancer
from rollstream.llm.server import free_port
from rollstream.tasks import arith
from rollstream.trainer.weight_sync import (
    PREVIOUS_WEIGHTS_DIR,
    VllmReloadBackend,
    WeightPublisher,
    WeightSyncError,
    save_weights,
    served_version,
)

from .refs import max_abs_diff, recompute_logprobs
from .test_vllm_rollouts import renderer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
async def restore_served_weights(vllm_url, served_model_dir, arith_model_dir):
    """Whatever a test published, vLLM serves the original arith model again afterwards."""
    yield
    async with httpx.AsyncClient(timeout=300) as http:
        await VllmReloadBackend(vllm_url, served_model_dir).load(http, arith_model_dir, 0)


def load_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def perturb(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def served_error(client, vllm_url, prompt, model) -> tuple[list[int], float]:
    """vLLM's greedy ids for `prompt` and how far its logprobs are from `model`'s."""
    gen = await client.generate(vllm_url, prompt, GREEDY)
    return gen.token_ids, max_abs_diff(gen.logprobs, recompute_logprobs(model, prompt, gen.token_ids))


async def test_trainer_sync_makes_vllm_serve_each_new_policy_and_records_it(
        vllm_url, served_model_dir, arith_model_dir, tokenizer, reference_model, redis_url, namespace, tmp_path,
        restore_served_weights):
    prompt = renderer(tokenizer).prompt_ids(arith.prompt({"a": 5, "op": "+", "b": 8}))
    client = VLLMClient()
    before, error = await served_error(client, vllm_url, prompt, reference_model)
    assert error < 1e-3
    redis = Redis.from_url(redis_url)
    balancer = Balancer(redis, namespace=namespace)
    await balancer.register(vllm_url, {"model": "arith"})
    publisher = WeightPublisher(tmp_path / "weights", [VllmReloadBackend(vllm_url, served_model_dir)],
                                redis=redis, namespace=namespace)
    policy = load_model(arith_model_dir)
    for version in (1, 2):
        perturb(policy, seed=version)
        report = await publisher.publish(policy, tokenizer, version)
        assert report.served == {vllm_url: version}
        ids, error = await served_error(client, vllm_url, prompt, policy)
        assert error < 1e-3, f"v{version}: vLLM does not serve the published weights"
        assert ids != before
        assert served_version(served_model_dir) == version
        # 0644 stays 0644: a vLLM running as another user can still read what it reloads.
        assert mode(served_model_dir / "model.safetensors") == 0o644
        assert not (served_model_dir / PREVIOUS_WEIGHTS_DIR).exists()
        [row] = await balancer.backends()
        assert row.info["policy_version"] == version and row.info["model"] == "arith"
    await client.aclose()
    await redis.aclose()


async def test_a_sync_that_fails_leaves_the_folder_holding_what_vllm_serves(
        vllm_url, served_model_dir, tokenizer, reference_model, redis_url, namespace, tmp_path):
    """The reload call fails (here: the server is unreachable when the trainer calls it)
    after the new files were written: the old files come back, so a vLLM restart would serve
    what vLLM serves now, and the balancer says the backend kept its version."""
    weights = served_model_dir / "model.safetensors"
    original, version_before = weights.read_bytes(), served_version(served_model_dir)
    policy = load_model(served_model_dir)
    perturb(policy, seed=9)
    new_weights = save_weights(policy, None, tmp_path / "v9")
    unreachable = f"http://127.0.0.1:{free_port()}"
    redis = Redis.from_url(redis_url)
    balancer = Balancer(redis, namespace=namespace)
    await balancer.register(unreachable, {"policy_version": 3})
    publisher = WeightPublisher(tmp_path / "weights", [VllmReloadBackend(unreachable, served_model_dir)],
                                redis=redis, namespace=namespace)
    with pytest.raises(WeightSyncError, match=unreachable):
        await publisher.publish(policy, None, 9)
    assert weights.read_bytes() == original and mode(weights) == 0o644
    assert served_version(served_model_dir) == version_before
    assert sorted(p.name for p in served_model_dir.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
    assert not (served_model_dir / PREVIOUS_WEIGHTS_DIR).exists()
    [row] = await balancer.backends()
    assert row.info["policy_version"] == 3 and "did not load v9" in row.info["policy_sync_error"]
    # And the real vLLM still serves exactly what the folder holds.
    prompt = renderer(tokenizer).prompt_ids(arith.prompt({"a": 1, "op": "+", "b": 2}))
    client = VLLMClient()
    _, error = await served_error(client, vllm_url, prompt, load_model(served_model_dir))
    assert error < 1e-3
    await client.aclose()
    await redis.aclose()
    assert new_weights.exists()


def test_trl_callback_syncs_vllm_after_each_optimizer_step(
        vllm_url, served_model_dir, arith_model_dir, tokenizer, redis_url, settings, tmp_path,
        restore_served_weights):
    import asyncio

    callback = WeightSyncCallback(tmp_path / "weights", settings=settings,
                                  backends=[VllmReloadBackend(vllm_url, served_model_dir)])
    policy = load_model(arith_model_dir)
    prompt = renderer(tokenizer).prompt_ids(arith.prompt({"a": 7, "op": "+", "b": 6}))
    try:
        for step in (1, 2):
            perturb(policy, seed=100 + step)
            callback.on_step_end(None, TrainerState(global_step=step), TrainerControl(), model=policy,
                                 processing_class=tokenizer)
            assert callback.published_version == step and served_version(served_model_dir) == step
            assert callback.connection.run(callback.connection.client.policy_version()) == step

            async def check() -> float:
                async with VLLMClient() as client:
                    return (await served_error(client, vllm_url, prompt, policy))[1]

            assert asyncio.run(check()) < 1e-3
    finally:
        callback.on_train_end(None, TrainerState(), TrainerControl())
