"""DAPO on the arith tool-use task through the whole system, on a CPU: the tiny model
(warmed up on the task's format, ARITH_RL_RECIPE), the built-in server, the three worker
pools with bubblewrap sandboxes and a real bash, Redis streams, weight sync after every step.

    python bench/arith_rl.py [--steps 12] [--group-size 8] [--groups 4]

Checks on the way, every step: the trajectories carry the policy version that produced them
(the version before the step's update, staleness 0 in 'cancel' mode), and after each sync the
server reports the new version and its logprobs match the trainer's model (so it serves the
new weights). Prints the reward per step with where the step's time went and, last,
`RESULT {json}` with reward_first, reward_last (means of the first and last three steps),
tokens_per_s (update), sync_s, steps, seconds and the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.tools import submit_tool_schema
from rollstream.demo.arith_model import ARITH_RL_RECIPE, cached_arith_model
from rollstream.llm.balancer import add_backend
from rollstream.llm.server.app import start_server_process
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.tasks import arith
from rollstream.trainer.config import TrainConfig
from rollstream.trainer.loop import Trainer
from rollstream.trainer.weight_sync import BuiltinServerBackend, SyncReport, WeightPublisher
from rollstream.workers.pool import WorkerPool


@dataclass
class ServedCheck:
    policy_version: int
    server_version: int
    server_logprob: float
    trainer_logprob: float

    @property
    def matches(self) -> bool:
        return self.server_version == self.policy_version and abs(self.server_logprob - self.trainer_logprob) < 1e-3


class CheckedPublisher(WeightPublisher):
    """A WeightPublisher that, after each sync, asks the server what it serves: its policy
    version, and the logprob of a fixed probe completion, compared with the trainer's model."""

    def __init__(self, root: Path, url: str, probe_ids: list[int]) -> None:
        super().__init__(root, [BuiltinServerBackend(url)])
        self.url, self.probe_ids = url, probe_ids
        self.checks: list[ServedCheck] = []

    async def publish(self, model, tokenizer, policy_version: int) -> SyncReport:
        report = await super().publish(model, tokenizer, policy_version)
        async with httpx.AsyncClient(timeout=60) as http:
            served = (await http.get(f"{self.url}/v1/policy_version")).json()["policy_version"]
            body = {"prompt": self.probe_ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 0,
                    "return_token_ids": True}
            choice = (await http.post(f"{self.url}/v1/completions", json=body)).json()["choices"][0]
        token, server_lp = choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]
        device = next(model.parameters()).device
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([self.probe_ids], device=device)).logits[0, -1].float()
        trainer_lp = torch.log_softmax(logits, -1)[token].item()
        self.checks.append(ServedCheck(policy_version, served, server_lp, trainer_lp))
        return report


def train_toml(work: Path, model_dir: Path, redis_url: str, ns: str, server_url: str, args) -> Path:
    path = work / "train.toml"
    path.write_text(f"""
[trainer]
model_dir = "{model_dir}"
task = "arith"
prompts_file = "prompts.jsonl"
output_dir = "run"
steps = {args.steps}
device = "cpu"
redis_url = "{redis_url}"
namespace = "{ns}"
progress = false
resume = false
checkpoint_every_steps = 1000
sampling = {{ temperature = 1.0, max_tokens = {args.max_tokens_per_turn} }}
agent = {{ max_turns = {args.max_turns}, max_tokens_per_turn = {args.max_tokens_per_turn}, max_context_tokens = 1024 }}

[trainer.sampler]
groups_per_batch = {args.groups}
group_size = {args.group_size}

[trainer.optim]
lr = {args.lr}
micro_batch_size = 16

[[trainer.backends]]
type = "builtin"
url = "{server_url}"
""")
    return path


def run_arith_rl(args) -> dict:
    """The end-to-end run; returns the metric rows, the served-weights checks and a summary."""
    # The server, three worker pools and this process share 2 cores: one intra-op thread
    # each, since OpenMP threads spin-waiting on an oversubscribed CPU slowed steps up to 5x.
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    base = args.model_dir or cached_arith_model(ARITH_RL_RECIPE)
    build_s = time.monotonic() - started
    work = Path(tempfile.mkdtemp(prefix="rs-arith-rl-"))
    model_dir = work / "model"
    shutil.copytree(base, model_dir)
    (work / "prompts.jsonl").write_text(
        "".join(json.dumps(i) + "\n" for i in arith.make_instances(500, seed=123, high=ARITH_RL_RECIPE["high"])))
    ns = f"rl{uuid.uuid4().hex[:6]}"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatRenderer(tokenizer, [arith.BASH_SCHEMA, submit_tool_schema("submit")])
    probe_ids = chat.prompt_ids(arith.prompt({"a": 12, "op": "+", "b": 34}))
    t0 = time.monotonic()
    with EmbeddedRedis(work / "redis") as redis_server:
        server, url = start_server_process(model_dir, device="cpu")

        async def register():
            r = async_redis(redis_server.url)
            await add_backend(r, url, ns)
            await r.aclose()

        pool = None
        try:
            asyncio.run(register())
            pool = WorkerPool(redis_url=redis_server.url, namespace=ns, data_dir=work, log_dir=work / "logs",
                              env={"ROLLSTREAM_MODEL_DIR": str(model_dir), "OMP_NUM_THREADS": "1"})
            pool.start_all(concurrency=args.concurrency)
            config = TrainConfig.from_toml(train_toml(work, model_dir, redis_server.url, ns, url, args))
            publisher = CheckedPublisher(config.output_dir / "weights", url, probe_ids)
            summary = asyncio.run(Trainer(config, publisher=publisher).run())
        finally:
            if pool is not None:
                pool.stop()
            server.terminate()
            server.wait(30)
    seconds = time.monotonic() - t0
    rows = [json.loads(line) for line in summary.metrics_path.read_text().splitlines()]
    return {"rows": rows, "checks": publisher.checks, "seconds": seconds, "build_s": build_s,
            "metrics_path": summary.metrics_path, "reward_curve_png": summary.reward_curve}


def summarize(run: dict, k: int = 3) -> dict:
    """RESULT keys from a run: rewards, update tokens/s and sync time (medians), checks."""
    rows, checks = run["rows"], run["checks"]
    k = min(k, len(rows))
    # step n trains on trajectories of version n-1 (cancel mode keeps nothing older)
    versions_ok = all(r["rollout_version_min"] == r["rollout_version_max"] == r["step"] - 1 for r in rows)
    served_ok = len(checks) == len(rows) + 1 and all(c.matches for c in checks)
    return {
        "reward_first": round(statistics.fmean(r["reward_mean_all"] for r in rows[:k]), 4),
        "reward_last": round(statistics.fmean(r["reward_mean_all"] for r in rows[-k:]), 4),
        "tokens_per_s": round(statistics.median(r["update_tokens_per_s"] for r in rows), 1),
        "sync_s": round(statistics.median(r["sync_s"] for r in rows), 4),
        "steps": len(rows),
        "seconds": round(run["seconds"], 1),
        "step_s_median": round(statistics.median(r["step_s"] for r in rows), 1),
        "trajectory_versions_ok": versions_ok,
        "server_serves_new_weights": served_ok,
        "reward_curve": [round(r["reward_mean_all"], 3) for r in rows],
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def print_table(run: dict) -> None:
    checks = {c.policy_version: c for c in run["checks"]}
    print(f"{'step':>4} {'reward':>7} {'kept':>5} {'keep':>5} {'traj v':>6} {'served':>6} {'|dlp|':>7} "
          f"{'step s':>6} {'rollout':>7} {'update':>6} {'sync':>5} {'init':>5} {'llm':>5} {'tools':>5} {'eval':>5}")
    for r in run["rows"]:
        c = checks.get(r["policy_version"])
        versions = (f"{r['rollout_version_min']}" if r["rollout_version_min"] == r["rollout_version_max"]
                    else f"{r['rollout_version_min']}-{r['rollout_version_max']}")
        groups = r["groups_kept"] + r["groups_dropped_equal"]
        print(f"{r['step']:>4} {r['reward_mean_all']:>7.3f} {r['groups_kept']:>2}/{groups:<2} "
              f"{r['keep_rate']:>5.2f} {versions:>6} {c.server_version if c else '-':>6} "
              f"{abs(c.server_logprob - c.trainer_logprob) if c else float('nan'):>7.1e} "
              f"{r['step_s']:>6.1f} {r['rollout_wait_s']:>7.1f} {r['update_s']:>6.1f} {r['sync_s'] or 0:>5.2f} "
              f"{r.get('time_init_s', 0):>5.2f} {r.get('time_llm_s', 0):>5.2f} {r.get('time_tools_s', 0):>5.2f} "
              f"{r.get('time_eval_s', 0):>5.2f}")
    print("reward: mean over every rollout resolved in the step (kept or dropped); kept: groups kept/judged; "
          "traj v: policy versions of the batch's trajectories; served: the server's version after the sync; "
          "|dlp|: |server - trainer| logprob of a probe token; init/llm/tools/eval: mean s per rollout")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="groups (prompts) with differing rewards per batch")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--max-tokens-per-turn", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=32, help="jobs in flight per worker process")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="start from this model folder instead of the one ARITH_RL_RECIPE builds (and caches)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the trainer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    load_before = os.getloadavg()
    run = run_arith_rl(args)
    print_table(run)
    out = summarize(run)
    out["load_avg_before"] = [round(x, 2) for x in load_before]
    out["model_build_s"] = round(run["build_s"], 1)
    print(f"metrics: {run['metrics_path']}")
    print(f"baseline (the warmed-up policy, step 1): reward {out['reward_first']:.3f}; "
          f"after {out['steps']} steps: {out['reward_last']:.3f} in {out['seconds']:.0f} s")
    print("RESULT " + json.dumps(out))


def trainer_section(steps: int, rows: list, result: dict) -> None:
    """bench/trainer.py's end-to-end section: this run with its defaults and `steps`, its table, and
    its figures as RESULT keys and a row of the trainer's table."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run = run_arith_rl(parser.parse_args(["--steps", str(steps)]))
    print_table(run)
    summary = summarize(run)
    result.update(reward_first=summary["reward_first"], reward_last=summary["reward_last"], e2e_steps=summary["steps"],
                  e2e_s=summary["seconds"], e2e_reward_curve=summary["reward_curve"],
                  e2e_task="arith tool use through the pipeline (bench/py)",
                  e2e_update_tokens_per_s=summary["tokens_per_s"], e2e_sync_s=summary["sync_s"],
                  e2e_trajectory_versions_ok=summary["trajectory_versions_ok"],
                  e2e_server_serves_new_weights=summary["server_serves_new_weights"],
                  e2e_load_avg_1m=summary["load_avg_1m"])
    rows.append(("e2e arith reward (mean of first/last 3 steps)",
                 f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}",
                 f"{summary['steps']} steps in {summary['seconds']:.0f} s; curve {summary['reward_curve']}; "
                 f"versions ok {summary['trajectory_versions_ok']}, served ok {summary['server_serves_new_weights']}"))

if __name__ == "__main__":
    main()
