"""Publishing weights: the built-in server serves them after sync; the vLLM strategy sends
vLLM's documented dev-mode calls (vLLM itself is not installed here)."""

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.llm.weights_transfer import SHM_ROOT
from rollstream.trainer.update import token_logprobs
from rollstream.trainer.weight_sync import (
    BackendSpec,
    BuiltinServerBackend,
    VllmReloadBackend,
    WeightPublisher,
    WeightSyncError,
)

PROMPT = [5, 17, 42, 99, 7]


def _served_logprobs(base_url: str, n: int = 4) -> tuple[list[int], list[float], int]:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0.0, "logprobs": 0, "return_token_ids": True,
            "ignore_eos": True}
    out = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], out["policy_version"]


@pytest.mark.parametrize("transfer", ["disk", "auto"])
async def test_builtin_server_serves_the_new_weights_after_each_sync(tiny_model_dir, model_server, tmp_path, transfer):
    _, base_url = model_server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    publisher = WeightPublisher(tmp_path / "weights", [BuiltinServerBackend(base_url)], keep_versions=1,
                                transfer=transfer)
    for version in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        report = await publisher.publish(model, tokenizer, version)
        # a server on this host, seeing this /dev/shm: auto goes through shared memory
        assert report.transfer == ("disk" if transfer == "disk" else "shm")
        assert report.policy_version == version and report.total_s > 0
        ids, served, served_version = _served_logprobs(base_url)
        assert served_version == version
        assert httpx.get(f"{base_url}/v1/policy_version").json()["policy_version"] == version
        # the server's logprobs are this model's logprobs for the tokens it chose
        seq = torch.tensor([PROMPT + ids])
        with torch.no_grad():
            ours = token_logprobs(model.eval(), seq, torch.ones_like(seq))[0, len(PROMPT):]
        assert torch.allclose(ours, torch.tensor(served), atol=1e-3)
    if transfer == "disk":  # only the newest version folder is kept
        assert [p.name for p in (tmp_path / "weights").iterdir()] == ["policy-v000002"]
    else:  # nothing on disk; in /dev/shm only the newest version, and nothing once closed
        assert not (tmp_path / "weights").exists()
        shm = report.weights_dir.parent
        assert shm.parent == SHM_ROOT and [p.name for p in shm.iterdir()] == ["policy-v000002"]
        publisher.close()
        assert not shm.exists()


async def test_a_backend_that_refuses_the_weights_fails_the_sync_with_its_url(tiny_model_dir, tmp_path):
    async def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "wrong architecture"})

    class Refusing(BuiltinServerBackend):
        async def load(self, client, weights_dir, policy_version):
            async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as own:
                await super().load(own, weights_dir, policy_version)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    publisher = WeightPublisher(tmp_path, [Refusing("http://gpu7:8000")])
    with pytest.raises(WeightSyncError, match="gpu7:8000.*wrong architecture"):
        await publisher.publish(model, None, 1)


async def test_vllm_strategy_replaces_served_files_then_reloads_and_resets_the_prefix_cache(tiny_model_dir, tmp_path):
    calls = []

    def record(request: httpx.Request) -> httpx.Response:
        calls.append((request.method, request.url.path, dict(request.url.params), request.content.decode()))
        return httpx.Response(200, json={})

    served = tmp_path / "served"
    served.mkdir()
    (served / "model-00001-of-00002.safetensors").write_text("old shard layout")
    backend = VllmReloadBackend("http://vllm:8000", served, sleep_first=True)
    weights = tmp_path / "v1"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(weights)
    async with httpx.AsyncClient(transport=httpx.MockTransport(record)) as client:
        await backend.load(client, weights, 1)
    assert [(m, p, q) for m, p, q, _ in calls] == [
        ("POST", "/sleep", {"level": "2"}),
        ("POST", "/wake_up", {"tags": "weights"}),
        ("POST", "/collective_rpc", {}),
        ("POST", "/wake_up", {"tags": "kv_cache"}),
        ("POST", "/reset_prefix_cache", {}),
    ]
    assert json.loads(calls[2][3]) == {"method": "reload_weights"}
    assert sorted(p.name for p in served.glob("*.safetensors")) == ["model.safetensors"]
    assert (served / "model.safetensors").read_bytes() == (weights / "model.safetensors").read_bytes()


async def test_vllm_without_dev_mode_says_how_to_enable_it(tiny_model_dir, tmp_path):
    transport = httpx.MockTransport(lambda request: httpx.Response(404, text="Not Found"))
    weights = tmp_path / "v1"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(weights)
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
            await VllmReloadBackend("http://vllm:8000", tmp_path / "served").load(client, weights, 1)


def test_backend_specs_build_their_strategy():
    assert isinstance(BackendSpec(url="http://a:1").build(), BuiltinServerBackend)
    reload = BackendSpec(type="vllm_reload", url="http://b:2", served_model_dir="/m")
    assert isinstance(reload.build(), VllmReloadBackend)
    with pytest.raises(ValueError, match="served_model_dir"):
        BackendSpec(type="vllm_reload", url="http://b:2").build()


async def test_vllm_strategy_keeps_file_modes_and_restores_the_served_files_when_the_reload_fails(
        tiny_model_dir, tmp_path):
    """Runs everywhere; tests/real_vllm checks the same against a real vLLM."""
    from rollstream.trainer.weight_sync import PREVIOUS_WEIGHTS_DIR, served_version

    served = tmp_path / "served"
    served.mkdir()
    old = served / "model.safetensors"
    old.write_bytes(b"the weights vLLM serves")
    old.chmod(0o644)
    weights = tmp_path / "v1"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(weights)
    backend = VllmReloadBackend("http://vllm:8000", served)
    failing = httpx.MockTransport(lambda request: httpx.Response(500, text="reload failed"))
    async with httpx.AsyncClient(transport=failing) as client:
        with pytest.raises(WeightSyncError, match="reload failed"):
            await backend.load(client, weights, 1)
    assert old.read_bytes() == b"the weights vLLM serves" and (old.stat().st_mode & 0o777) == 0o644
    assert not (served / PREVIOUS_WEIGHTS_DIR).exists() and served_version(served) is None
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200))) as client:
        await backend.load(client, weights, 1)
    assert old.read_bytes() == (weights / "model.safetensors").read_bytes()
    assert (old.stat().st_mode & 0o777) == 0o644 and served_version(served) == 1


def test_saved_weights_are_what_save_pretrained_writes_and_load_back_bit_for_bit_in_bfloat16(tmp_path):
    from safetensors import safe_open
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rollstream.trainer.weight_sync import save_weights

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    save_weights(model, None, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs", safe_serialization=True)
    with safe_open(tmp_path / "ours" / "model.safetensors", "pt") as ours, \
            safe_open(tmp_path / "theirs" / "model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())  # the tied lm_head is left out as transformers does
        for name in theirs.keys():  # noqa: SIM118 - a safetensors handle: keys(), no iteration
            assert ours.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(ours.get_tensor(name), theirs.get_tensor(name)), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
