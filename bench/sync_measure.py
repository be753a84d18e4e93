"""The weight-sync measurement of bench/trainer.py: syncs by `auto` and by `disk` against a
running built-in server, each checked by a probe that the server serves the new weights, and
the table rows and RESULT keys they give."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from rollstream.trainer.weight_sync import BuiltinServerBackend, WeightPublisher

PROBE_IDS = [5, 17, 42, 99, 7, 1000, 31]


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used: /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure_sync(model, tokenizer, base_url: str, root: Path, reps: int, server_pid: int) -> dict:
    """Syncs by `auto` (on one host: shared memory; CUDA IPC where both are on one GPU) and by
    `disk` (the path to a server on another host), alternating, each after every weight has
    changed (shifted by one place and negated: exact in any dtype, never back to an earlier
    version), so no sync can skip a tensor and a stale server fails the probe; medians."""
    largest = max(p.numel() for p in model.parameters())
    first = next(model.parameters())
    staging = torch.empty(largest, dtype=first.dtype, device=first.device)
    served = torch.empty(largest, dtype=torch.float32, device=first.device)
    floors = []

    def copy_floor() -> float:
        """What any sync of this model must do at least, timed on the same machine: each tensor's
        bytes copied once (the trainer's write) and cast once into float32 (the server's load)."""
        started = time.perf_counter()
        with torch.no_grad():
            for p in model.parameters():
                n = p.numel()
                staging[:n].copy_(p.view(-1))
                served[:n].copy_(staging[:n])
        sync_device(first.device)
        return time.perf_counter() - started

    probes: dict[str, bool] = {}
    probe_diffs: list[float] = []

    def served_matches(transfer: str) -> bool:
        """The probe bench/arith_rl.py makes: the server's logprob of its greedy token after a
        fixed prompt is the trainer's model's own (computed in float32, which the bf16 weights
        convert to exactly, as the CPU server holds them)."""
        import httpx

        body = {"prompt": PROBE_IDS, "max_tokens": 1, "temperature": 0.0, "logprobs": 0, "return_token_ids": True}
        choice = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        token, server_lp = choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]
        dtype, on_cpu = first.dtype, first.device.type == "cpu"
        with torch.no_grad():
            if on_cpu:  # the CPU server holds float32; an accelerator's the checkpoint's dtype
                model.float()
            logits = model(input_ids=torch.tensor([PROBE_IDS], device=first.device)).logits[0, -1].float()
            model.to(dtype)
        trainer_lp = torch.log_softmax(logits, -1)[token].item()
        probe_diffs.append(abs(server_lp - trainer_lp))
        # 1e-3 as bench/arith_rl.py: two float32 forwards of the same 28 layers differ by ~2e-4 here
        # (the server's KV-cache path), two successive versions by ~1e-2. In bf16 on an accelerator
        # the two paths round differently: 3e-2.
        return probe_diffs[-1] < (1e-3 if on_cpu else 3e-2)

    publishers = {transfer: WeightPublisher(root / transfer, [BuiltinServerBackend(base_url)], keep_versions=1,
                                            transfer=transfer) for transfer in ("auto", "disk")}
    reports: dict[str, list] = {transfer: [] for transfer in publishers}
    cpu: dict[str, list[float]] = {transfer: [] for transfer in publishers}
    version = 0
    try:
        for rep in range(reps + 1):  # the first round warms both up (allocation, first mapping)
            for transfer, publisher in publishers.items():
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(p.view(-1).roll(1).view_as(p)).neg_()
                version += 1
                before = time.process_time(), server_cpu_s(server_pid)
                report = await publisher.publish(model, tokenizer, version)
                if rep:
                    reports[transfer].append(report)
                    cpu[transfer].append(time.process_time() - before[0] + server_cpu_s(server_pid) - before[1])
                if rep == reps:  # after the timed syncs
                    probes[transfer] = served_matches(transfer)
            floor = copy_floor()
            if rep:
                floors.append(floor)
    finally:
        for publisher in publishers.values():
            publisher.close()
    out = {"transfer": reports["auto"][0].transfer, "floor_s": statistics.median(floors),
           "server_serves_new_weights": all(probes.values()) if probes else None,
           "probe_max_abs_diff": max(probe_diffs, default=None)}
    for transfer, found in reports.items():
        key = "" if transfer == "auto" else "disk_"
        out.update({f"{key}sync_cpu_s": statistics.median(cpu[transfer]),
                    f"{key}sync_s": statistics.median(r.total_s for r in found),
                    f"{key}save_s": statistics.median(r.save_s for r in found),
                    f"{key}load_s": statistics.median(r.load_s for r in found)})
    return out


def sync_rows(what: str, sync: dict, prefix: str, rows: list, result: dict, note: str = "") -> None:
    """RESULT keys {prefix}sync_s (the transfer `auto` chose) and {prefix}sync_disk_s, two table rows."""
    result.update({f"{prefix}sync_s": sync["sync_s"], f"{prefix}sync_save_s": sync["save_s"],
                   f"{prefix}sync_load_s": sync["load_s"], f"{prefix}sync_transfer": sync["transfer"],
                   f"{prefix}sync_disk_s": sync["disk_sync_s"], f"{prefix}sync_disk_save_s": sync["disk_save_s"],
                   f"{prefix}sync_disk_load_s": sync["disk_load_s"], f"{prefix}sync_copy_floor_s": sync["floor_s"],
                   f"{prefix}sync_cpu_s": sync["sync_cpu_s"], f"{prefix}sync_disk_cpu_s": sync["disk_sync_cpu_s"],
                   f"{prefix}sync_over_copy_floor": sync["sync_s"] / sync["floor_s"],
                   f"{prefix}sync_server_serves_new_weights": sync["server_serves_new_weights"],
                   f"{prefix}sync_probe_max_abs_diff": sync["probe_max_abs_diff"]})
    rows.append((f"copy floor, {what}", f"{sync['floor_s'] * 1000:.0f} ms",
                 "each tensor copied once + cast once to fp32 in this process: the least any sync does"))
    for label, key in ((sync["transfer"], ""), ("disk", "disk_")):
        rows.append((f"sync by {label}, {what}", f"{sync[key + 'sync_s'] * 1000:.0f} ms",
                     f"save {sync[key + 'save_s'] * 1000:.0f} ms + load {sync[key + 'load_s'] * 1000:.0f} ms; "
                     f"CPU time, trainer + server, {sync[key + 'sync_cpu_s'] * 1000:.0f} ms; {note}"))
