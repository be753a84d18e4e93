"""The built-in server's lifecycle seen from the client: new weights change the outputs and
the policy version, EOS from the checkpoint's generation config ends a turn, and a dead
server is a retryable BackendError at once."""

from __future__ import annotations

import json
import shutil
import signal

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.llm import BackendError, SamplingParams, VLLMClient
from rollstream.llm.server import free_port, start_server_process

from .conftest import _stop
from .llm_refs import greedy_reference, recompute_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def weights_server(tiny_model_dir):
    """One server for the weight-loading tests; each test states the weights it starts from."""
    proc, url = start_server_process(tiny_model_dir)
    yield url
    _stop(proc)


def load(url: str, path, version: int | None = None) -> httpx.Response:
    body = {"path": str(path)} if version is None else {"path": str(path), "policy_version": version}
    return httpx.post(f"{url}/v1/load_weights", json=body, timeout=120)


async def test_load_weights_changes_outputs_and_policy_version(weights_server, tiny_model_dir, tiny_model_seed1_dir,
                                                               tokenizer):
    url = weights_server
    client = VLLMClient()
    prompt = tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert load(url, tiny_model_dir, 6).json() == {"policy_version": 6}
    before = await client.generate(url, prompt, GREEDY)
    assert before.policy_version == 6

    resp = load(url, tiny_model_seed1_dir, 7)
    assert resp.status_code == 200 and resp.json() == {"policy_version": 7}
    assert httpx.get(f"{url}/v1/policy_version").json() == {"policy_version": 7}

    after = await client.generate(url, prompt, GREEDY)
    new_policy = AutoModelForCausalLM.from_pretrained(tiny_model_seed1_dir, dtype=torch.float32).eval()
    assert after.policy_version == 7
    assert after.token_ids != before.token_ids
    # The prefix cache was dropped with the old weights: outputs are the new model's own.
    assert after.token_ids == greedy_reference(new_policy, prompt, GREEDY.max_tokens)
    recomputed = recompute_logprobs(new_policy, prompt, after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, recomputed)) < 1e-4
    await client.aclose()


async def test_load_weights_waits_for_generations_in_flight(weights_server, tiny_model_dir, tokenizer):
    """A generation that started under one version finishes under it: no turn mixes two
    policies; the version without an explicit number is the current one plus one."""
    import asyncio

    url = weights_server
    client = VLLMClient()
    start_version = load(url, tiny_model_dir).json()["policy_version"]
    prompt = tokenizer.encode("<|im_start|>user\nWrite a long story.<|im_end|>\n<|im_start|>assistant\n")
    long_turn = asyncio.create_task(
        client.generate(url, prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)))
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{url}/v1/load_weights", json={"path": str(tiny_model_dir)}, timeout=120)
    assert resp.json() == {"policy_version": start_version + 1}
    old = await long_turn
    assert old.policy_version == start_version and len(old.token_ids) == 300
    await client.aclose()


def test_load_weights_from_a_bad_folder_is_a_400_and_keeps_serving(weights_server, tmp_path):
    url = weights_server
    version = httpx.get(f"{url}/v1/policy_version").json()
    resp = load(url, tmp_path)
    assert resp.status_code == 400 and "safetensors" in resp.json()["error"]["message"]
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    resp = load(url, tmp_path)
    assert resp.status_code == 400 and "does not" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/policy_version").json() == version
    assert httpx.get(f"{url}/health").status_code == 200


async def test_eos_from_generation_config_ends_the_turn(tiny_model_dir, tmp_path, tokenizer):
    """Checkpoints list several EOS ids in generation_config.json (Qwen3 has two); the server
    stops on any of them unless ignore_eos."""
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    free = greedy_reference(reference, prompt, 16)
    position = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    gen_config = json.loads((model_dir / "generation_config.json").read_text())
    gen_config["eos_token_id"] = [tokenizer.eos_token_id, free[position]]
    (model_dir / "generation_config.json").write_text(json.dumps(gen_config))

    proc, url = start_server_process(model_dir)
    client = VLLMClient()
    try:
        stopped = await client.generate(url, prompt, SamplingParams(temperature=0, max_tokens=16))
        ignored = await client.generate(url, prompt, GREEDY)
    finally:
        _stop(proc)
        await client.aclose()
    assert stopped.token_ids == free[: position + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == free and ignored.finish_reason == "length"


async def test_dead_server_raises_a_retryable_backend_error(private_model_server):
    proc, url = private_model_server
    client = VLLMClient()
    assert await client.health(url)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    with pytest.raises(BackendError) as info:
        await client.generate(url, [5, 6, 7], SamplingParams(max_tokens=4), timeout_s=30)
    assert info.value.retryable and info.value.backend == url
    assert "unreachable" in str(info.value)
    assert not await client.health(url)
    await client.aclose()


async def test_nothing_listening_is_a_retryable_backend_error():
    url = f"http://127.0.0.1:{free_port()}"
    client = VLLMClient(model="m")
    with pytest.raises(BackendError) as info:
        await client.generate(url, [1, 2], SamplingParams(max_tokens=1), timeout_s=10)
    assert info.value.retryable
    await client.aclose()


async def test_slow_request_times_out_and_the_server_drops_it(model_server):
    import asyncio

    client = VLLMClient()
    with pytest.raises(BackendError, match="timed out") as info:
        await client.generate(model_server, [5] * 50, SamplingParams(max_tokens=3000, ignore_eos=True), timeout_s=0.5)
    assert info.value.retryable
    # The server noticed the closed connection and freed the batch slot.
    for _ in range(100):
        if httpx.get(f"{model_server}/v1/engine_stats").json()["active"] == 0:
            break
        await asyncio.sleep(0.1)
    assert httpx.get(f"{model_server}/v1/engine_stats").json()["active"] == 0
    await client.aclose()


async def test_server_registers_itself_with_the_balancer_and_leaves_on_exit(tiny_model_dir, redis_url, namespace):
    from rollstream.llm.balancer import list_backends
    from rollstream.pipeline.connection import async_redis

    proc, url = start_server_process(
        tiny_model_dir, extra_args=["--register"], env={"REDIS_URL": redis_url, "ROLLSTREAM_NAMESPACE": namespace}
    )
    redis = async_redis(redis_url)
    try:
        listed = [b.url for b in await list_backends(redis, namespace=namespace)]
        assert url in listed
        _stop(proc)
        assert url not in [b.url for b in await list_backends(redis, namespace=namespace)]
    finally:
        _stop(proc)
        await redis.aclose()
