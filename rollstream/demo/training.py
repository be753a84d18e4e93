"""The demo's learning run: DAPO steps on arith through the running pools, with
bench/arith_rl.py's settings, each update published to the built-in server."""

from __future__ import annotations

import json
from pathlib import Path

from rollstream.demo.arith_model import ARITH_RL_RECIPE
from rollstream.tasks import arith
from rollstream.trainer.config import TrainConfig

# bench/arith_rl.py's settings, which learn on 2 cores (0.23 -> 0.88 in 15 steps): the
# ARITH_RL_RECIPE model, one-digit sums (what it was warmed up on), 4 groups of 8 per step.
ARITH_HIGH = ARITH_RL_RECIPE["high"]
TRAIN_SAMPLING = {"temperature": 1.0, "max_tokens": 40}
TRAIN_AGENT = {"max_turns": 2, "max_tokens_per_turn": 40, "max_context_tokens": 1024, "max_wall_time_s": 120}


def train_briefly(url: str, namespace: str, model_dir: Path, root: Path, steps: int, seed: int):
    """DAPO steps on arith: groups through the running pools, each update published to the
    built-in server (the backends registered in Redis) before the next step's rollouts."""
    # torch (the model extra) only when training starts: `rollstream --help` imports this module
    import torch

    from rollstream.trainer.loop import train

    # one intra-op thread: the server and the pools share the cores (bench/arith_rl.py)
    torch.set_num_threads(1)
    prompts = root / "train-prompts.jsonl"
    prompts.write_text("".join(json.dumps(inst) + "\n"
                               for inst in arith.make_instances(500, seed=seed + 123, high=ARITH_HIGH)))
    config = TrainConfig(
        model_dir=model_dir, task="arith", prompts_file=prompts, output_dir=root / "train", steps=steps, seed=seed,
        device="cpu", redis_url=url, namespace=namespace, submitter="demo-trainer", resume=False,
        sampling=TRAIN_SAMPLING, agent=TRAIN_AGENT,
        # A demo whose every rollout fails (no sandbox can start) stops after 8 such groups.
        sampler={"groups_per_batch": 4, "group_size": 8, "result_timeout_s": 240, "max_failed_groups_in_a_row": 8},
        optim={"lr": 2e-4, "micro_batch_size": 16}, checkpoint_every_steps=steps, progress=True)
    return train(config)
