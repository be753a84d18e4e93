"""How weights travel to the built-in server (rollstream/llm/weights_transfer.py): the file
format against safetensors itself, the shared-memory folder's life (reused, cleaned, never seen
half-written), a truncated file refused by a real server that keeps serving, and the choice of
transfer. CUDA IPC needs a GPU: here only its refusal on a CPU server and the choice are tested."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from rollstream.llm.weights_transfer import (
    Placement,
    choose_transfer,
    mapped_safetensors,
    write_safetensors,
)
from rollstream.trainer.weight_sync import (
    SHM_PREFIX,
    BuiltinServerBackend,
    WeightPublisher,
    WeightSyncError,
    remove_stale_shm_folders,
)

PROMPT = [5, 17, 42, 99, 7]


def _mixed_tensors() -> dict[str, torch.Tensor]:
    """Odd sizes first, so that later tensors start at offsets their dtype does not divide."""
    torch.manual_seed(0)
    return {
        "a.bf16_odd": torch.randn(3).to(torch.bfloat16),
        "b.f32": torch.randn(4, 5),
        "c.bool": torch.tensor([True, False, True]),
        "d.i64": torch.arange(7),
        "e.empty": torch.zeros(0, 4),
        "f.f16": torch.randn(2, 3).half(),
    }


def test_our_file_is_read_by_safetensors_and_safetensors_files_are_read_by_ours(tmp_path):
    tensors = _mixed_tensors()
    write_safetensors(tensors, tmp_path / "ours.safetensors")
    with safe_open(tmp_path / "ours.safetensors", "pt") as theirs:
        assert sorted(theirs.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(theirs.get_tensor(name), tensor), name
    (tmp_path / "theirs").mkdir()
    save_file(tensors, tmp_path / "theirs" / "model.safetensors")
    with mapped_safetensors(tmp_path / "theirs") as mapped:
        assert sorted(mapped) == sorted(tensors)
        for name, tensor in tensors.items():
            assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name


def test_a_reused_file_holds_exactly_the_new_tensors(tmp_path):
    write_safetensors({"big": torch.ones(10_000)}, tmp_path / "old.safetensors")
    new = _mixed_tensors()
    write_safetensors(new, tmp_path / "new.safetensors", reuse=tmp_path / "old.safetensors")
    write_safetensors(new, tmp_path / "fresh.safetensors")
    assert not (tmp_path / "old.safetensors").exists()
    assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()


def test_the_mapped_writer_rewrites_its_file_in_place_and_falls_back_when_the_layout_changes(tmp_path):
    from rollstream.llm.weights_transfer import MappedWriter

    writer = MappedWriter()
    first, second = _mixed_tensors(), {k: v.clone() for k, v in _mixed_tensors().items()}
    second["b.f32"].add_(1.0)
    writer.write(first, tmp_path / "v1.safetensors")
    writer.write(second, tmp_path / "v2.safetensors", reuse=tmp_path / "v1.safetensors")  # same inode, mapped
    write_safetensors(second, tmp_path / "fresh.safetensors")
    assert (tmp_path / "v2.safetensors").read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()
    other = {"only": torch.arange(5)}  # another layout: written anew
    writer.write(other, tmp_path / "v3.safetensors", reuse=tmp_path / "v2.safetensors")
    writer.close()
    (tmp_path / "v3").mkdir()
    (tmp_path / "v3.safetensors").rename(tmp_path / "v3" / "model.safetensors")
    with mapped_safetensors(tmp_path / "v3") as mapped:
        assert list(mapped) == ["only"] and torch.equal(mapped["only"], other["only"])


def test_a_truncated_file_is_refused_before_anything_is_read(tmp_path):
    write_safetensors(_mixed_tensors(), tmp_path / "model.safetensors")
    whole = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(whole[:-4])
    with pytest.raises(ValueError, match="truncated"), mapped_safetensors(tmp_path):
        pass


async def test_server_refuses_a_half_written_file_and_keeps_serving_the_weights_it_had(
        tiny_model_dir, model_server, tmp_path):
    _, base_url = model_server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    publisher = WeightPublisher(tmp_path / "weights", [BuiltinServerBackend(base_url)], transfer="shm")
    try:
        report = await publisher.publish(model, None, 41)
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 0, "ignore_eos": True}
        before = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)
        half = tmp_path / "half"
        half.mkdir()
        write_safetensors(dict(model.state_dict()), half / "model.safetensors")
        data = (half / "model.safetensors").read_bytes()
        (half / "model.safetensors").write_bytes(data[: len(data) // 2])  # a writer that died half-way
        refused = httpx.post(f"{base_url}/v1/load_weights", json={"path": str(half), "policy_version": 42}, timeout=60)
        assert refused.status_code == 400 and "truncated" in refused.text
        assert httpx.get(f"{base_url}/v1/policy_version").json()["policy_version"] == 41
        after = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
        # the same weights (within float noise of a prefix-cache hit), not the tripled ones
        assert after["tokens"] == before["tokens"]
        assert after["token_logprobs"] == pytest.approx(before["token_logprobs"], abs=1e-4)
        assert report.transfer == "shm"
    finally:
        publisher.close()


async def test_a_cpu_server_refuses_cuda_ipc_handles_and_says_what_to_use_instead(model_server, tiny_model_dir,
                                                                                  tmp_path):
    _, base_url = model_server
    answer = httpx.post(f"{base_url}/v1/load_weights", json={"cuda_ipc": {}, "policy_version": 1}, timeout=60)
    assert answer.status_code == 400 and "'shm' or 'disk'" in answer.text
    both = httpx.post(f"{base_url}/v1/load_weights", json={"cuda_ipc": {}, "path": str(tmp_path)}, timeout=60)
    assert both.status_code == 400 and "exactly one" in both.text
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    publisher = WeightPublisher(tmp_path, [BuiltinServerBackend(base_url)], transfer="cuda_ipc")
    with pytest.raises(WeightSyncError, match="needs the model on a GPU"):
        await publisher.publish(model, None, 1)


def test_stale_shm_folders_of_dead_trainers_are_removed_and_live_ones_kept(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = tmp_path / f"{SHM_PREFIX}{int(gone.stdout)}-abc"
    live = tmp_path / f"{SHM_PREFIX}{os.getpid()}-def"
    for folder in (dead, live):
        (folder / "policy-v000001").mkdir(parents=True)
    assert remove_stale_shm_folders(tmp_path) == [dead]
    assert live.exists() and not dead.exists()


def test_a_trainer_that_exits_leaves_nothing_in_shared_memory(tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import asyncio
        from pathlib import Path
        from transformers import AutoModelForCausalLM
        from rollstream.trainer.weight_sync import WeightPublisher
        model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})
        publisher = WeightPublisher({str(tmp_path / 'disk')!r}, [], transfer="shm", shm_root={str(tmp_path)!r})
        for version in (1, 2, 3):
            report = asyncio.run(publisher.publish(model, None, version))
        folder = report.weights_dir.parent
        print(sorted(p.name for p in folder.iterdir()), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['policy-v000003']"  # one version at a time
    assert list(tmp_path.glob(f"{SHM_PREFIX}*")) == []  # and none after exit
    assert not (tmp_path / "disk").exists()


def test_the_transfer_follows_where_the_server_runs():
    cpu = Placement(boot_id="boot-1", shm="33:1", device="cpu")
    gpu = Placement(boot_id="boot-1", shm="33:1", device="cuda:0", gpu_uuid="GPU-a")
    same_gpu_server = Placement(boot_id="boot-1", shm="33:1", device="cuda:0", gpu_uuid="GPU-a")
    other_gpu_server = Placement(boot_id="boot-1", shm="33:1", device="cuda:1", gpu_uuid="GPU-b")
    container = Placement(boot_id="boot-1", shm="99:1", device="cpu")  # same kernel, its own /dev/shm
    remote = Placement(boot_id="boot-2", shm="33:1", device="cpu")
    assert choose_transfer("auto", gpu, [same_gpu_server]) == "cuda_ipc"
    assert choose_transfer("auto", gpu, [same_gpu_server, other_gpu_server]) == "shm"
    assert choose_transfer("auto", cpu, [same_gpu_server]) == "shm"
    assert choose_transfer("auto", cpu, [cpu, container]) == "disk"
    assert choose_transfer("auto", cpu, [remote]) == "disk"
    assert choose_transfer("auto", cpu, [cpu, None]) == "disk"  # a server that did not say
    assert choose_transfer("auto", cpu, []) == "disk"
    assert choose_transfer("auto", Placement(boot_id="boot-1", shm=None, device="cpu"), [cpu]) == "disk"
    assert choose_transfer("disk", gpu, [same_gpu_server]) == "disk"
