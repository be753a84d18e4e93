"""DAPO on the arith tool-use task through the whole system, on a CPU: the tiny model
(warmed up on the task's format), the built-in server, the three worker pools with
bubblewrap sandboxes and a real bash, Redis streams, weight sync after every step.

    python bench/arith_rl.py [--steps 20] [--group-size 8] [--groups 4]

Prints the reward per step and, last, `RESULT {json}` with reward_first, reward_last
(means of the first and last three steps), steps, seconds, and the policy versions seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.llm.format_pretrain import build_arith_model
from rollstream.llm.server.app import start_server_process
from rollstream.pipeline.balancer import add_backend
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.tasks import arith
from rollstream.trainer.config import TrainConfig
from rollstream.trainer.loop import Trainer
from rollstream.workers.pool import WorkerPool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--model-cache", type=Path, default=Path.home() / ".cache" / "rollstream" / "models" / "arith")
    args = ap.parse_args()

    base = build_arith_model(args.model_cache)
    work = Path(tempfile.mkdtemp(prefix="rs-arith-rl-"))
    model_dir = work / "model"
    shutil.copytree(base, model_dir)
    (work / "prompts.jsonl").write_text("".join(json.dumps(i) + "\n" for i in arith.make_instances(500, seed=123)))
    ns = f"rl{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    with EmbeddedRedis(work / "redis") as redis_server:
        server, url = start_server_process(model_dir, device="auto")

        async def register():
            r = async_redis(redis_server.url)
            await add_backend(r, url, ns)
            await r.aclose()

        asyncio.run(register())
        pool = WorkerPool(redis_url=redis_server.url, namespace=ns, data_dir=work, log_dir=work / "logs",
                          env={"ROLLSTREAM_MODEL_DIR": str(model_dir)})
        pool.start_all(concurrency=32)
        (work / "train.toml").write_text(f"""
[trainer]
model_dir = "{model_dir}"
task = "arith"
prompts_file = "prompts.jsonl"
output_dir = "run"
steps = {args.steps}
redis_url = "{redis_server.url}"
namespace = "{ns}"
progress = false
checkpoint_every_steps = 1000
sampling = {{ temperature = 1.0, max_tokens = 48 }}
agent = {{ max_turns = 3, max_tokens_per_turn = 48, max_context_tokens = 1024 }}

[trainer.sampler]
groups_per_batch = {args.groups}
group_size = {args.group_size}

[trainer.optim]
lr = {args.lr}
micro_batch_size = 16

[[trainer.backends]]
type = "builtin"
url = "{url}"
""")
        try:
            summary = asyncio.run(Trainer(TrainConfig.from_toml(work / "train.toml")).run())
        finally:
            pool.stop()
            server.terminate()
            server.wait(30)
    rows = [json.loads(line) for line in summary.metrics_path.read_text().splitlines()]
    print(f"{'step':>4} {'reward (all rollouts)':>22} {'keep rate':>10} {'version':>8}")
    for row in rows:
        print(f"{row['step']:>4} {row['reward_mean_all']:>22.3f} {row.get('keep_rate', 0):>10.2f} "
              f"{row.get('policy_version', '-'):>8}")
    k = min(3, len(rows))
    out = {"reward_first": round(statistics.fmean(r["reward_mean_all"] for r in rows[:k]), 4),
           "reward_last": round(statistics.fmean(r["reward_mean_all"] for r in rows[-k:]), 4),
           "steps": len(rows), "seconds": round(time.monotonic() - t0, 1),
           "reward_curve": [round(r["reward_mean_all"], 3) for r in rows]}
    print(f"metrics: {summary.metrics_path}")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
