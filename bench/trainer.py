"""Benchmark of the trainer (issue #4).

1. Update step throughput: tokens/s of one DAPO update (forward, clipped loss, backward,
   AdamW) on a synthetic on-policy batch, against the baseline of a plain SFT step
   (cross-entropy on the same response tokens, same micro-batching, same optimizer).
2. Weight sync: time from a full batch to weights served again = update + save
   (safetensors) + the built-in server loading them (POST /v1/load_weights).
3. End to end on this machine (bench/arith_rl.py): DAPO on the arith tool-use task through
   the whole pipeline (worker pools, bwrap sandboxes, built-in server, weight sync after each
   step), reward per step; `--e2e digits` runs the older toy instead (share of digit tokens
   in an 8-token completion, sampled straight from the server, no pipeline).
On a CUDA machine 1 and 2 are repeated on the GPU, also with a ~150M-parameter Qwen2.

    python bench/trainer.py [--e2e-steps 12] [--e2e arith|digits] [--quick]
Last line: RESULT {json} with tokens_per_s, sync_s, reward_first, reward_last, ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rollstream.llm.server import start_server_process
from rollstream.llm.tiny_model import build_tiny_model
from rollstream.trainer.batch import PaddedBatch, build_batch
from rollstream.trainer.config import LossConfig, OptimConfig, TrainConfig
from rollstream.trainer.direct_source import DirectServerSource
from rollstream.trainer.loop import Trainer
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


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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
    del baseline_model, optimizer
    tokens = batch.num_tokens
    return {
        "tokens": tokens,
        "update_s": statistics.median(dapo),
        "tokens_per_s": tokens / statistics.median(dapo),
        "baseline_sft_tokens_per_s": tokens / statistics.median(sft),
    }


async def measure_sync(model, tokenizer, base_url: str, root: Path, reps: int) -> dict:
    publisher = WeightPublisher(root, [BuiltinServerBackend(base_url)], keep_versions=1)
    await publisher.publish(model, tokenizer, 0)
    reports = [await publisher.publish(model, tokenizer, v) for v in range(1, reps + 1)]
    return {
        "sync_s": statistics.median(r.total_s for r in reports),
        "save_s": statistics.median(r.save_s for r in reports),
        "load_s": statistics.median(r.load_s for r in reports),
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


def arith_e2e(steps: int, rows: list, result: dict) -> None:
    """The arith tool-use task through the whole pipeline (bench/arith_rl.py, its defaults)."""
    import arith_rl  # bench/ is the script's folder, so on sys.path

    parser = argparse.ArgumentParser()
    arith_rl.add_arguments(parser)
    run = arith_rl.run_arith_rl(parser.parse_args(["--steps", str(steps)]))
    arith_rl.print_table(run)
    summary = arith_rl.summarize(run)
    result.update(reward_first=summary["reward_first"], reward_last=summary["reward_last"], e2e_steps=summary["steps"],
                  e2e_s=summary["seconds"], e2e_reward_curve=summary["reward_curve"],
                  e2e_task="arith tool use through the pipeline (bench/arith_rl.py)",
                  e2e_update_tokens_per_s=summary["tokens_per_s"], e2e_sync_s=summary["sync_s"],
                  e2e_trajectory_versions_ok=summary["trajectory_versions_ok"],
                  e2e_server_serves_new_weights=summary["server_serves_new_weights"],
                  e2e_load_avg_1m=summary["load_avg_1m"])
    rows.append(("e2e arith reward (mean of first/last 3 steps)",
                 f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}",
                 f"{summary['steps']} steps in {summary['seconds']:.0f} s; curve {summary['reward_curve']}; "
                 f"versions ok {summary['trajectory_versions_ok']}, served ok {summary['server_serves_new_weights']}"))


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
    result.update(gpu_tokens_per_s=tiny["tokens_per_s"], gpu_baseline_sft_tokens_per_s=tiny["baseline_sft_tokens_per_s"])
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
            gsync = asyncio.run(measure_sync(big, None, base_url, Path(tmp) / "weights", reps))
        finally:
            proc.terminate()
            proc.wait(30)
    result.update(gpu_big_sync_s=gsync["sync_s"], gpu_big_batch_to_served_s=big_upd["update_s"] + gsync["sync_s"])
    rows.append((f"sync, Qwen2 {params / 1e6:.0f}M, {device.type} server", f"{gsync['sync_s'] * 1000:.0f} ms",
                 f"save {gsync['save_s'] * 1000:.0f} ms + load {gsync['load_s'] * 1000:.0f} ms"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e-steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 6 e2e steps")
    parser.add_argument("--accelerator-section-on-cpu", action="store_true",
                        help="run the CUDA section on the CPU with a toy model (checks the code path)")
    parser.add_argument("--skip-e2e", action="store_true", help="no end-to-end training run")
    parser.add_argument("--e2e", choices=("arith", "digits"), default="arith",
                        help="arith: the tool-use task through the pipeline (bench/arith_rl.py); digits: direct source")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
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
            sync = asyncio.run(measure_sync(model, tokenizer, base_url, Path(tmp), reps))
        result.update(sync_s=sync["sync_s"], sync_save_s=sync["save_s"], sync_load_s=sync["load_s"],
                      batch_to_served_s=upd["update_s"] + sync["sync_s"])
        rows.append(("sync, tiny model, cpu", f"{sync['sync_s'] * 1000:.0f} ms",
                     f"save {sync['save_s'] * 1000:.0f} ms + load {sync['load_s'] * 1000:.0f} ms; "
                     f"full batch -> served {result['batch_to_served_s']:.2f} s"))
        metrics: list[dict] = []
        if not args.skip_e2e and args.e2e == "digits":
            with tempfile.TemporaryDirectory(dir=OUT) as tmp:
                started = time.monotonic()
                metrics = asyncio.run(e2e(model_dir, base_url, steps, Path(tmp)))
                e2e_s = time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(30)
    if not args.skip_e2e and args.e2e == "arith":
        arith_e2e(steps, rows, result)
    if metrics:
        curve = [round(r["reward_mean_all"], 3) for r in metrics]
        k = min(3, len(metrics) // 2) or 1
        result.update(reward_first=sum(curve[:k]) / k, reward_last=sum(curve[-k:]) / k, e2e_steps=steps,
                      e2e_s=e2e_s, e2e_reward_curve=curve, e2e_task="digit-preference, direct server source",
                      e2e_keep_rate_last=metrics[-1]["keep_rate"])
        rows.append((f"e2e reward (mean of first/last {k} steps)",
                     f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}",
                     f"{steps} steps in {e2e_s:.0f} s; curve {curve}"))

    if torch.cuda.is_available() or args.accelerator_section_on_cpu:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        accelerator_section(device, model_dir, tokenizer, batch, reps, rows, result,
                            small=args.accelerator_section_on_cpu)

    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':<{width}}  {'value':>16}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
