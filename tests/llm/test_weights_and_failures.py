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


async def test_load_weights_changes_outputs_and_policy_version(private_model_server, tiny_model_seed1_dir, tokenizer):
    _, url = private_model_server
    client = VLLMClient()
    prompt = tokenizer.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    before = await client.generate(url, prompt, GREEDY)
    assert before.policy_version == 0

    resp = httpx.post(f"{url}/v1/load_weights", json={"path": str(tiny_model_seed1_dir), "policy_version": 7}, timeout=60)
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


async def test_load_weights_waits_for_generations_in_flight(private_model_server, tiny_model_seed1_dir, tokenizer):
    """A generation that started under version 0 finishes under version 0: no turn mixes
    two policies."""
    import asyncio

    _, url = private_model_server
    client = VLLMClient()
    prompt = tokenizer.encode("<|im_start|>user\nWrite a long story.<|im_end|>\n<|im_start|>assistant\n")
    long_turn = asyncio.create_task(client.generate(url, prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)))
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{url}/v1/load_weights", json={"path": str(tiny_model_seed1_dir)}, timeout=120)
    assert resp.json() == {"policy_version": 1}
    old = await long_turn
    assert old.policy_version == 0 and len(old.token_ids) == 300
    await client.aclose()


def test_load_weights_from_a_bad_folder_is_a_400_and_keeps_serving(private_model_server, tmp_path):
    _, url = private_model_server
    resp = httpx.post(f"{url}/v1/load_weights", json={"path": str(tmp_path)}, timeout=30)
    assert resp.status_code == 400 and "safetensors" in resp.json()["error"]["message"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    from safetensors.torch import save_file

    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    resp = httpx.post(f"{url}/v1/load_weights", json={"path": str(tmp_path)}, timeout=30)
    assert resp.status_code == 400 and "does not" in resp.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/policy_version").json() == {"policy_version": 0}


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


async def test_slow_server_times_out_as_a_retryable_backend_error(private_model_server):
    _, url = private_model_server
    client = VLLMClient()
    with pytest.raises(BackendError, match="timed out") as info:
        await client.generate(url, [5] * 50, SamplingParams(max_tokens=3000, ignore_eos=True), timeout_s=0.5)
    assert info.value.retryable
    await client.aclose()
