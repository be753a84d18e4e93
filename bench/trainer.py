"""Benchmark of the trainer (issues #4, #28).

0. DAPO update vs a plain transformers training step (#28): the same real tokens through the
   same model, once as rollstream's `PolicyUpdater.step` (packed micro-batches, chunked
   chosen-token logprobs, DAPO loss) and once as transformers users train (padded
   micro-batches of the same sequences, `model(input_ids, attention_mask, labels)` causal-LM
   loss, backward, clip, AdamW). Each variant runs in a process of its own, so that its peak
   memory is its own (ru_maxrss on the CPU, max_memory_allocated on CUDA). The model is a
   Qwen3-shaped causal LM built from a config (no download) with Qwen3's 151,936-token
   vocabulary and a small body, so that the vocabulary matters as it does in a real model.
1. Update step throughput on the tiny model: tokens/s of one DAPO update against a plain SFT
   step (cross-entropy on the same response tokens, same micro-batching, same optimizer).
2. Weight sync: time from a finished update to weights served again = save + the built-in
   server loading them (POST /v1/load_weights), on a Qwen3-0.6B-shaped model in bf16 (RESULT
   sync_s; `--sync-model tiny` for the tiny one, whose figure is tiny_sync_s either way), by the
   transfer the trainer picks on one host (shared memory) and by disk in the same run
   (sync_disk_s); `--only-sync` runs this section alone.
3. End to end on this machine (bench/arith_rl.py): DAPO on the arith tool-use task through
   the whole pipeline (worker pools, bwrap sandboxes, built-in server, weight sync after each
   step), reward per step; `--e2e digits` runs the older toy instead (share of digit tokens
   in an 8-token completion, sampled straight from the server, no pipeline).
On a CUDA machine 0 is repeated on the GPU with the Qwen3-0.6B shape in bf16 (64 sequences
of 512 + 768-1,536 tokens, micro-batch 8, as in #28), and 1 and 2 with a ~150M Qwen2.

    python bench/trainer.py [--e2e-steps 12] [--e2e arith|digits] [--quick] [--skip-e2e]
    python bench/trainer.py --accelerator-only   (a GPU node: the CUDA sections alone)
Last line: RESULT {json} with dapo_over_plain_step, dapo_tok_s, plain_tok_s, dapo_peak_mb,
plain_peak_mb, tokens_per_s, sync_s, reward_first, reward_last, ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rollstream from this checkout
from machine import describe, require, say

# The model stack and what rollstream imports, checked before anything is imported or measured
MODULES = ["torch", "transformers", "safetensors", "numpy", "fastapi", "uvicorn", "httpx", "pydantic",
           "pydantic_settings", "redis", "msgpack", "ormsgpack", "psutil"]
if __name__ == "__main__" and "--variant" not in sys.argv:
    require("bench/trainer.py", MODULES, cpu_only="--cpu-only" in sys.argv)

import torch
from sync_measure import measure_sync, sync_device, sync_rows  # noqa: E402  (bench/, after the checks)

from rollstream.llm.server import start_server_process
from rollstream.llm.tiny_model import build_tiny_model
from rollstream.trainer.batch import PaddedBatch, build_batch
from rollstream.trainer.config import LossConfig, OptimConfig, TrainConfig
from rollstream.trainer.direct_source import DirectServerSource
from rollstream.trainer.logprobs import packed_token_logprobs
from rollstream.trainer.loop import Trainer
from rollstream.trainer.packing import micro_batch_rows, pack_rows
from rollstream.trainer.sampler import SamplerConfig
from rollstream.trainer.update import PolicyUpdater, token_logprobs
from rollstream.trainer.weight_sync import BuiltinServerBackend, WeightPublisher
from rollstream.trajectory import Trajectory

OUT = Path(__file__).parent / "out"


def synthetic_batch(model, vocab: int, sequences: int, prompt_len: int, response_len: int, device) -> PaddedBatch:
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for _ in range(sequences):
        n = int(torch.randint(response_len // 2, response_len + 1, (1,), generator=gen))
        ids = torch.randint(3, vocab, (prompt_len + n,), generator=gen).tolist()
        trajs.append(Trajectory(prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:], loss_mask=[1] * n,
                                logprobs=[0.0] * n))
    advantages = torch.randn(sequences, generator=gen)
    batch = build_batch(trajs, advantages, pad_token_id=0)
    with torch.no_grad():  # on-policy behaviour logprobs, as a rollout would report
        parts = []
        for i in range(0, sequences, 8):
            micro = batch.select(slice(i, i + 8)).to(device)
            lp = token_logprobs(model, micro.input_ids, micro.attention_mask)
            full = torch.zeros(lp.shape[0], batch.input_ids.shape[1], device=device)
            full[:, : lp.shape[1]] = lp
            parts.append(full.cpu())
        batch.behaviour_logprobs = torch.cat(parts) * batch.response_mask
    return batch


def sft_step(model, optimizer, batch: PaddedBatch, micro_batch_size: int, device) -> None:
    """Baseline: cross-entropy on the response tokens, token-averaged, same micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    total = float(batch.num_response_tokens)
    for micro in batch.micro_batches(micro_batch_size):
        micro = micro.to(device)
        lp = token_logprobs(model, micro.input_ids, micro.attention_mask)
        (-(lp * micro.response_mask).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def measure_update(model, batch: PaddedBatch, device, micro_batch_size: int, reps: int) -> dict:
    """DAPO update and SFT baseline alternate rep by rep, so that load from other processes
    on a shared machine hits both alike."""
    import copy

    model.to(device)
    baseline_model = copy.deepcopy(model)
    updater = PolicyUpdater(model, LossConfig(), OptimConfig(lr=1e-6, micro_batch_size=micro_batch_size))
    optimizer = torch.optim.AdamW(baseline_model.parameters(), lr=1e-6)
    updater.step(batch)  # warm-up (allocator, kernels)
    sft_step(baseline_model, optimizer, batch, micro_batch_size, device)
    dapo, sft = [], []
    for _ in range(reps):
        for run, times in ((lambda: updater.step(batch), dapo),
                           (lambda: sft_step(baseline_model, optimizer, batch, micro_batch_size, device), sft)):
            sync_device(device)
            t = time.perf_counter()
            run()
            sync_device(device)
            times.append(time.perf_counter() - t)
    tokens = batch.num_tokens
    return {
        "tokens": tokens,
        "update_s": statistics.median(dapo),
        "tokens_per_s": tokens / statistics.median(dapo),
        "baseline_sft_tokens_per_s": tokens / statistics.median(sft),
    }


async def e2e(model_dir: Path, base_url: str, steps: int, out: Path) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    digits = {i for i in range(len(tokenizer)) if any(c.isdigit() for c in tokenizer.decode([i]))}
    source = DirectServerSource(base_url, lambda p, ids: sum(i in digits for i in ids) / max(len(ids), 1),
                                {"max_tokens": 8})
    prompts = [{"prompt_ids": tokenizer.encode(f"Say some numbers: {i}")} for i in range(64)]
    config = TrainConfig(model_dir=model_dir, task="direct", prompts_file=out / "unused.jsonl", output_dir=out,
                         steps=steps, device="cpu", sampler=SamplerConfig(groups_per_batch=4, group_size=8),
                         optim=OptimConfig(lr=3e-3, micro_batch_size=16), checkpoint_every_steps=10**6,
                         progress=False, resume=False)
    publisher = WeightPublisher(out / "weights", [BuiltinServerBackend(base_url)])
    try:
        summary = await Trainer(config, source=source, publisher=publisher, prompts=prompts).run()
    finally:
        await source.aclose()
    return [json.loads(line) for line in summary.metrics_path.read_text().splitlines()]


def larger_model(small: bool = False):
    """A randomly initialised Qwen2 (no download): ~150M parameters, or a toy for dry runs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=2000 if small else 32000, hidden_size=64 if small else 768,
                         intermediate_size=128 if small else 2048, num_hidden_layers=2 if small else 12,
                         num_attention_heads=4 if small else 12, num_key_value_heads=2 if small else 4,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config), config.vocab_size


def accelerator_section(device, model_dir: Path, tokenizer, batch: PaddedBatch, reps: int, rows: list, result: dict,
                        small: bool = False) -> None:
    """Update throughput and weight sync on the accelerator (tiny model, then a larger Qwen2)."""
    from transformers import AutoModelForCausalLM

    result["gpu_name"] = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    tiny = measure_update(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), batch, device, 8, reps)
    result.update(gpu_tokens_per_s=tiny["tokens_per_s"],
                  gpu_baseline_sft_tokens_per_s=tiny["baseline_sft_tokens_per_s"])
    rows.append((f"update, tiny model, {device.type}", f"{tiny['tokens_per_s']:.0f} tok/s",
                 f"SFT baseline {tiny['baseline_sft_tokens_per_s']:.0f} tok/s"))
    big, vocab = larger_model(small)
    big = big.to(device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    shape = (8, 16, 48) if small else (64, 256, 768)
    big_batch = synthetic_batch(big, vocab, *shape, device)
    big_upd = measure_update(big, big_batch, device, micro_batch_size=16, reps=reps)
    params = sum(p.numel() for p in big.parameters())
    result.update(gpu_big_params=params, gpu_big_tokens_per_s=big_upd["tokens_per_s"],
                  gpu_big_baseline_sft_tokens_per_s=big_upd["baseline_sft_tokens_per_s"])
    rows.append((f"update, Qwen2 {params / 1e6:.0f}M, {device.type}", f"{big_upd['tokens_per_s']:.0f} tok/s",
                 f"SFT baseline {big_upd['baseline_sft_tokens_per_s']:.0f} tok/s"))
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        big.save_pretrained(Path(tmp) / "model")
        tokenizer.save_pretrained(Path(tmp) / "model")  # sampled ids are never decoded here
        proc, base_url = start_server_process(Path(tmp) / "model", device=device.type)
        try:
            gsync = asyncio.run(measure_sync(big, None, base_url, Path(tmp) / "weights", reps, proc.pid))
        finally:
            proc.terminate()
            proc.wait(30)
    result["gpu_big_batch_to_served_s"] = big_upd["update_s"] + gsync["sync_s"]
    sync_rows(f"Qwen2 {params / 1e6:.0f}M, {device.type} server", gsync, "gpu_big_", rows, result)


# ---- 0. DAPO update vs a plain transformers training step -------------------------------
# name -> (Qwen3 config overrides, workload: sequences, prompt tokens, response tokens min..max, micro-batch)
PRESETS = {
    # Qwen3's vocabulary on a small body: the output layer is most of the work, as the
    # vocabulary is in a real model's training step; a minute or two on 2 cores
    "cpu": (dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16), (12, 48, 32, 160, 6)),
    "cpu-small": (dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16), (8, 16, 8, 32, 4)),
    # Qwen3-0.6B's shape, and #28's workload
    "qwen3-0.6b": (dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0), (64, 512, 768, 1536, 8)),
}


def qwen3_model(preset: str, device: torch.device, dtype: torch.dtype):
    """A randomly initialised Qwen3-shaped causal LM (no download), built on `device`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
                 attn_implementation="sdpa")
    shape.update(PRESETS[preset][0])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    return model.to(dtype=dtype), shape["vocab_size"]


def workload_batch(preset: str, vocab: int) -> tuple[PaddedBatch, int]:
    """The preset's sequences (random tokens, response lengths uniform in the range), and its micro-batch size."""
    sequences, prompt_len, low, high, micro_batch_size = PRESETS[preset][1]
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for _ in range(sequences):
        n = int(torch.randint(low, high + 1, (1,), generator=gen))
        ids = torch.randint(3, vocab, (prompt_len + n,), generator=gen).tolist()
        trajs.append(Trajectory(prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:], loss_mask=[1] * n,
                                logprobs=[0.0] * n))
    return build_batch(trajs, torch.randn(sequences, generator=gen), pad_token_id=0), micro_batch_size


def plain_step(model, optimizer, batch: PaddedBatch, groups: list[list[int]], device) -> None:
    """A training step as transformers users write it: padded micro-batches (the longest row of
    each), labels = input ids with -100 on padding, the model's own causal-LM loss summed over
    the batch's label tokens (num_items_in_batch), backward, clip, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    label_tokens = int(sum(int(batch.attention_mask[g].sum()) - len(g) for g in groups))
    for group in groups:
        length = int(batch.attention_mask[group].sum(dim=1).max())
        input_ids = batch.input_ids[group, :length].to(device)
        attention_mask = batch.attention_mask[group, :length].to(device)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                    num_items_in_batch=torch.tensor(label_tokens, device=device), use_cache=False)
        out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def run_variant(variant: str, preset: str, device_name: str, reps: int, micro_batch: int | None = None) -> dict:
    """One variant in this process: a warm-up step, then `reps` timed steps; peak memory of
    the whole process (CPU: ru_maxrss; CUDA: max_memory_allocated)."""
    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, vocab = qwen3_model(preset, device, dtype)
    batch, micro_batch_size = workload_batch(preset, vocab)
    micro_batch_size = micro_batch or micro_batch_size
    groups = micro_batch_rows(batch, micro_batch_size)
    if variant == "dapo":
        with torch.no_grad():  # on-policy behaviour logprobs, as a rollout reports them
            flat = [packed_token_logprobs(model.eval(), pack_rows(batch, [row]).to(device)).cpu()
                    for row in range(len(batch))]
        for row, logprobs in enumerate(flat):
            batch.behaviour_logprobs[row, : logprobs.shape[0]] = logprobs
        batch.behaviour_logprobs *= batch.response_mask
        updater = PolicyUpdater(model, LossConfig(), OptimConfig(lr=1e-6, micro_batch_size=micro_batch_size))

        def step():
            return updater.step(batch)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        model.train()

        def step():
            return plain_step(model, optimizer, batch, groups, device)
    rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, cpu_times = [], []
    for i in range(reps + 1):
        sync_device(device)
        started, cpu_started = time.perf_counter(), time.process_time()
        step()
        sync_device(device)
        if i > 0:  # the first step warms up allocator and kernels
            times.append(time.perf_counter() - started)
            cpu_times.append(time.process_time() - cpu_started)
    padded = sum(len(g) * int(batch.attention_mask[g].sum(dim=1).max()) for g in groups)
    peak_mb = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {
        "variant": variant, "preset": preset, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()), "vocab": vocab, "sequences": len(batch),
        "micro_batch_size": micro_batch_size, "tokens": batch.num_tokens, "padded_tokens": padded,
        "response_tokens": batch.num_response_tokens, "step_s": statistics.median(times), "steps_s": times,
        "cpu_s": cpu_times,
        "tok_s": batch.num_tokens / statistics.median(times), "peak_mb": peak_mb, "rss_before_steps_mb": rss_before_mb,
    }


class VariantFailed(RuntimeError):
    def __init__(self, variant: str, message: str):
        super().__init__(message)
        self.variant = variant
        self.out_of_memory = "OutOfMemoryError" in message


def variant_in_subprocess(variant: str, preset: str, device: str, reps: int, timeout_s: float,
                          micro_batch: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--preset", preset, "--device", device,
           "--reps", str(reps)] + (["--micro-batch", str(micro_batch)] if micro_batch else [])
    env = os.environ.copy()
    if device == "cuda":  # both variants alike: freed blocks are reused whatever their size
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VARIANT ")]
    if proc.returncode != 0 or not lines:
        raise VariantFailed(variant, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("VARIANT "))


def plain_that_fits(preset: str, device: str, reps: int, micro: int | None, result: dict, prefix: str):
    """The plain step's run and micro-batch: on an accelerator (``prefix``), its micro-batch halved
    while its full [rows, length, vocab] logits do not fit, said in ``result`` (DAPO keeps the preset's)."""
    while True:
        try:
            return variant_in_subprocess("plain", preset, device, reps, 3600, micro), micro
        except VariantFailed as exc:
            tried = micro or PRESETS[preset][1][4]
            if not (prefix and exc.out_of_memory and tried > 1):
                raise
            result.setdefault(f"{prefix}plain_out_of_memory_at_micro_batch", []).append(tried)
            micro = tried // 2


def dapo_vs_plain(preset: str, device: str, reps: int, rounds: int, rows: list, result: dict, prefix: str = "") -> None:
    """Section 0: both variants, `rounds` times in alternation (load from other processes
    hits both alike); the median step time over all rounds, the largest peak."""
    runs: dict[str, list[dict]] = {"dapo": [], "plain": []}
    load = os.getloadavg()[0]
    plain_micro_batch = None  # the preset's, until it does not fit
    try:
        for _ in range(rounds):
            runs["dapo"].append(variant_in_subprocess("dapo", preset, device, reps, 3600))
            plain, plain_micro_batch = plain_that_fits(preset, device, reps, plain_micro_batch, result, prefix)
            runs["plain"].append(plain)
    except VariantFailed as exc:
        if not prefix:
            raise
        # on an accelerator a variant may not fit: say which, go on
        result[f"{prefix}dapo_vs_plain_error"] = f"{exc.variant}: {str(exc)[-1000:]}"
        rows.append((f"DAPO vs plain step, {device}, {preset}", "failed",
                     f"{exc.variant}: {str(exc).splitlines()[-1][:200]}"))
        return
    figures = {}
    for variant, found in runs.items():
        step_s = statistics.median(t for r in found for t in r["steps_s"])
        cpu_s = statistics.median(t for r in found for t in r["cpu_s"])
        figures[variant] = {"tok_s": found[0]["tokens"] / step_s, "peak_mb": max(r["peak_mb"] for r in found),
                            "step_s": step_s, "cpu_s": cpu_s}
    first = runs["dapo"][0]
    ratio = figures["dapo"]["tok_s"] / figures["plain"]["tok_s"]
    plain_first = runs["plain"][0]
    padding = 1 - plain_first["tokens"] / plain_first["padded_tokens"]
    result.update({
        f"{prefix}dapo_over_plain_step": ratio,
        f"{prefix}dapo_tok_s": figures["dapo"]["tok_s"], f"{prefix}plain_tok_s": figures["plain"]["tok_s"],
        f"{prefix}dapo_peak_mb": figures["dapo"]["peak_mb"], f"{prefix}plain_peak_mb": figures["plain"]["peak_mb"],
        f"{prefix}dapo_vs_plain_model": f"Qwen3 shape '{preset}', {first['params'] / 1e6:.0f}M params, "
                                        f"vocab {first['vocab']}, {first['dtype']}, {first['device']}",
        f"{prefix}dapo_vs_plain_tokens": first["tokens"], f"{prefix}plain_padding_share": padding,
        f"{prefix}dapo_vs_plain_load_1m": load, f"{prefix}plain_micro_batch": plain_first["micro_batch_size"],
        # process CPU seconds per step: less sensitive than wall time to other processes on a shared machine
        f"{prefix}dapo_over_plain_step_cpu_time": figures["plain"]["cpu_s"] / figures["dapo"]["cpu_s"],
    })
    where = f"{first['device']}, Qwen3 {first['params'] / 1e6:.0f}M/{first['vocab']} vocab"
    rows.append((f"DAPO update, {where}", f"{figures['dapo']['tok_s']:.0f} tok/s",
                 f"peak {figures['dapo']['peak_mb']:.0f} MB; {first['sequences']} seqs, {first['tokens']} real tokens, "
                 f"micro-batch {first['micro_batch_size']}, packed"))
    rows.append((f"plain transformers step, {where}", f"{figures['plain']['tok_s']:.0f} tok/s",
                 f"peak {figures['plain']['peak_mb']:.0f} MB; same tokens padded ({padding:.0%} padding), "
                 f"micro-batch {plain_first['micro_batch_size']}"
                 + (f" (out of memory at {result[f'{prefix}plain_out_of_memory_at_micro_batch']})"
                    if f"{prefix}plain_out_of_memory_at_micro_batch" in result else "")))
    rows.append((f"DAPO / plain step, {where}", f"{ratio:.2f}x",
                 f"memory {figures['dapo']['peak_mb'] / figures['plain']['peak_mb']:.2f}x; by process CPU time "
                 f"{figures['plain']['cpu_s'] / figures['dapo']['cpu_s']:.2f}x; load avg {load:.1f}"))


def sync_row(preset: str, device: torch.device, tokenizer, reps: int, rows: list, result: dict, prefix: str,
             sync_threads: int | None = None) -> None:
    """Weight sync of a Qwen3-shaped model trained in bf16: from a finished update to the
    built-in server (on `device`) serving the new weights = save + load."""
    sync_threads = sync_threads or 1
    model, _ = qwen3_model(preset, device, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        model.save_pretrained(Path(tmp) / "model")
        tokenizer.save_pretrained(Path(tmp) / "model")  # sampled ids are never decoded here
        # The server's and the copy floor's threads: one by default. On this 2-core machine two
        # were slower even when it was quiet (copy floor 0.40 s vs 0.21 s, load avg 0.9), and under
        # other work a copy split over two threads waits for the slower one (figures scatter 5x).
        proc, base_url = start_server_process(Path(tmp) / "model", device=device.type,
                                              env={"OMP_NUM_THREADS": str(sync_threads)})
        threads = torch.get_num_threads()
        torch.set_num_threads(sync_threads)
        try:
            sync = asyncio.run(measure_sync(model, None, base_url, Path(tmp) / "weights", reps, proc.pid))
        finally:
            torch.set_num_threads(threads)
            proc.terminate()
            proc.wait(30)
    result.update({f"{prefix}sync_params": params, f"{prefix}sync_load_1m": load,
                   f"{prefix}sync_threads": sync_threads})
    served = "fp32 CPU server" if device.type == "cpu" else f"{device.type} server"
    sync_rows(f"Qwen3 {params / 1e6:.0f}M bf16 -> {served}", sync, prefix, rows, result, f"load avg {load:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e-steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 6 e2e steps")
    parser.add_argument("--accelerator-section-on-cpu", action="store_true",
                        help="run the CUDA section on the CPU with a toy model (checks the code path)")
    parser.add_argument("--skip-e2e", action="store_true", help="no end-to-end training run")
    parser.add_argument("--e2e", choices=("arith", "digits"), default="arith",
                        help="arith: the tool-use task through the pipeline (bench/arith_rl.py); digits: direct source")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model and workload of the DAPO-vs-plain comparison on the CPU")
    parser.add_argument("--gpu-preset", choices=sorted(PRESETS), default="qwen3-0.6b",
                        help="model and workload of the DAPO-vs-plain comparison on CUDA")
    parser.add_argument("--rounds", type=int, default=1, help="DAPO/plain process pairs, in alternation")
    parser.add_argument("--only-dapo-vs-plain", action="store_true",
                        help="section 0 alone (CPU, and CUDA where there is one)")
    parser.add_argument("--sync-model", choices=("tiny", "qwen3-0.6b"), default="qwen3-0.6b",
                        help="model of the CPU weight-sync row, RESULT sync_s (qwen3-0.6b: bf16 trainer, fp32 CPU "
                             "server); the tiny model's is tiny_sync_s either way")
    parser.add_argument("--only-sync", action="store_true", help="the weight-sync section alone")
    parser.add_argument("--sync-threads", type=int, default=None,
                        help="threads of the weight-sync server and copy floor "
                             "(default 1: steadier, and faster on 2 cores)")
    parser.add_argument("--accelerator-only", action="store_true",
                        help="the accelerator sections alone (a GPU node's lease is short: no CPU sections)")
    parser.add_argument("--cpu-only", action="store_true",
                        help="CPU sections only, even where CUDA is (or the driver sees GPUs torch cannot use)")
    parser.add_argument("--variant", choices=("dapo", "plain"), help=argparse.SUPPRESS)  # one child process
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.variant:
        print("VARIANT " + json.dumps(run_variant(args.variant, args.preset, args.device, args.reps or 3,
                                                      args.micro_batch)), flush=True)
        return
    cuda = torch.cuda.is_available() and not args.cpu_only
    e2e_arith = not (args.skip_e2e or args.only_sync or args.only_dapo_vs_plain or args.accelerator_only) \
        and args.e2e == "arith"
    if e2e_arith:  # bwrap sandboxes and a Redis: say now, not after the other sections' minutes
        require("bench/trainer.py (the end-to-end run; --skip-e2e leaves it out)", [], ("redis-server", "bwrap"))
    say(f"bench/trainer.py on {describe()}")
    say("  CUDA sections: " + (f"on {torch.cuda.get_device_name(0)}" if cuda else
                               "none (no CUDA)" if not args.cpu_only else "none (--cpu-only)"))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    reps = 2 if args.quick else 4
    steps = 6 if args.quick else args.e2e_steps
    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(OUT / "tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows: list[tuple[str, str, str]] = []
    result: dict = {}

    result["machine"] = describe()
    if args.accelerator_only:
        accelerator_sections(args, cuda, model_dir, tokenizer, reps, rows, result)
        print_table(rows, result)
        return
    if args.only_sync:
        say(f"  weight sync, {args.sync_model}")
        result["sync_model"] = args.sync_model
        sync_row(args.sync_model if args.sync_model != "tiny" else "cpu-small", torch.device("cpu"), tokenizer,
                 reps, rows, result, prefix="", sync_threads=args.sync_threads)
        print_table(rows, result)
        return
    say(f"  0. DAPO update vs a plain training step, cpu, preset {args.preset}")
    dapo_vs_plain(args.preset, "cpu", 2 if args.quick else 3, args.rounds, rows, result)
    if args.only_dapo_vs_plain:
        if cuda:
            say(f"  0. DAPO update vs a plain training step, cuda, preset {args.gpu_preset}")
            dapo_vs_plain(args.gpu_preset, "cuda", 3, args.rounds, rows, result, prefix="gpu_")
        print_table(rows, result)
        return

    say("  1. update throughput, tiny model; 2. weight sync, tiny model")
    cpu = torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = synthetic_batch(model, len(tokenizer), 32, 64, 192, cpu)
    upd = measure_update(model, batch, cpu, micro_batch_size=8, reps=reps)
    result.update(tokens_per_s=upd["tokens_per_s"], baseline_sft_tokens_per_s=upd["baseline_sft_tokens_per_s"],
                  update_s=upd["update_s"], update_tokens=upd["tokens"])
    rows.append(("update, tiny model, cpu", f"{upd['tokens_per_s']:.0f} tok/s",
                 f"SFT baseline {upd['baseline_sft_tokens_per_s']:.0f} tok/s "
                 f"(DAPO/SFT {upd['tokens_per_s'] / upd['baseline_sft_tokens_per_s']:.2f})"))

    proc, base_url = start_server_process(model_dir, device="cpu")
    try:
        with tempfile.TemporaryDirectory(dir=OUT) as tmp:
            sync = asyncio.run(measure_sync(model, tokenizer, base_url, Path(tmp), reps, proc.pid))
        result["batch_to_served_s"] = upd["update_s"] + sync["sync_s"]
        sync_rows("tiny model, cpu", sync, "tiny_", rows, result,
                  f"full batch -> served {result['batch_to_served_s']:.2f} s")
        metrics: list[dict] = []
        if not args.skip_e2e and args.e2e == "digits":
            with tempfile.TemporaryDirectory(dir=OUT) as tmp:
                started = time.monotonic()
                metrics = asyncio.run(e2e(model_dir, base_url, steps, Path(tmp)))
                e2e_s = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(30)
    result["sync_model"] = args.sync_model
    if args.sync_model == "tiny":  # the headline keys sync_s, ... are the tiny model's
        result.update({k.removeprefix("tiny_"): v for k, v in list(result.items()) if k.startswith("tiny_sync")})
    else:
        say(f"  2. weight sync, {args.sync_model}")
        sync_row(args.sync_model, cpu, tokenizer, reps, rows, result, prefix="", sync_threads=args.sync_threads)
    if e2e_arith:
        say(f"  3. end to end, arith task, {steps} steps")
        import arith_rl  # bench/ is the script's folder, so on sys.path

        arith_rl.trainer_section(steps, rows, result)
    if metrics:
        curve = [round(r["reward_mean_all"], 3) for r in metrics]
        k = min(3, len(metrics) // 2) or 1
        result.update(reward_first=sum(curve[:k]) / k, reward_last=sum(curve[-k:]) / k, e2e_steps=steps,
                      e2e_s=e2e_s, e2e_reward_curve=curve, e2e_task="digit-preference, direct server source",
                      e2e_keep_rate_last=metrics[-1]["keep_rate"])
        rows.append((f"e2e reward (mean of first/last {k} steps)",
                     f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}",
                     f"{steps} steps in {e2e_s:.0f} s; curve {curve}"))

    if cuda or args.accelerator_section_on_cpu:
        accelerator_sections(args, cuda, model_dir, tokenizer, reps, rows, result, batch)
    print_table(rows, result)


def accelerator_sections(args, cuda: bool, model_dir: Path, tokenizer, reps: int, rows: list, result: dict,
                         batch: PaddedBatch | None = None) -> None:
    """0 on the accelerator (or its dry run on the CPU), then its update and weight-sync rows."""
    if not (cuda or args.accelerator_section_on_cpu):
        raise SystemExit("--accelerator-only: no CUDA device here (--accelerator-section-on-cpu for a dry run)")
    device = torch.device("cuda" if cuda else "cpu")
    preset = "cpu-small" if args.accelerator_section_on_cpu else args.gpu_preset
    say(f"  accelerator sections on {device.type}: DAPO vs plain, update, weight sync")
    dapo_vs_plain(preset, device.type, 3, args.rounds, rows, result, prefix="gpu_")
    if batch is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        batch = synthetic_batch(model, len(tokenizer), 32, 64, 192, torch.device("cpu"))
    accelerator_section(device, model_dir, tokenizer, batch, reps, rows, result, small=args.accelerator_section_on_cpu)
    sync_row(preset, device, tokenizer, reps, rows, result, prefix="gpu_qwen3_")


def print_table(rows: list, result: dict) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'value':>16}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
