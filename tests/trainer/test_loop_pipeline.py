"""The Trainer on its production path: TrainConfig from TOML, jobs through rollstream's
client and Redis pipeline (in-process init/run/eval workers), a single-turn task that
samples from the built-in server, weights synced back, policy version in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx

from rollstream.client import AsyncClient
from rollstream.messages import Envelope
from rollstream.tasks.base import Task, TaskContext
from rollstream.tasks.registry import register_task
from rollstream.trainer.config import TrainConfig
from rollstream.trainer.loop import Trainer
from rollstream.trajectory import Trajectory
from rollstream.workers.process import serve_stage


@register_task
class SingleTurnTokensTask(Task):
    """One completion of `prompt_ids` from the server at `base_url`; reward: share of
    response tokens in `liked` (a learnable preference)."""

    name = "trainer-single-turn"

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        return None

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        inst, sampling = env.job.instance, env.job.sampling
        body = {"prompt": inst["prompt_ids"], "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "logprobs": 0, "return_token_ids": True}
        async with httpx.AsyncClient(timeout=60) as http:
            out = (await http.post(f"{inst['base_url']}/v1/completions", json=body)).json()
        choice = out["choices"][0]
        ids = choice["token_ids"]
        return Trajectory(prompt_ids=inst["prompt_ids"], response_ids=ids, loss_mask=[1] * len(ids),
                          logprobs=choice["logprobs"]["token_logprobs"], policy_version=out["policy_version"])

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        liked = set(env.job.instance["liked"])
        ids = env.trajectory.response_ids
        return sum(i in liked for i in ids) / max(len(ids), 1)


@contextlib.asynccontextmanager
async def _workers(settings):
    tasks = [asyncio.create_task(serve_stage(stage, settings, 64)) for stage in ("init", "run", "eval")]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_trainer_from_toml_trains_through_the_pipeline_and_publishes_versions(
    settings, tiny_model_dir, model_server, tmp_path
):
    _, base_url = model_server
    liked = list(range(0, 1536, 4))  # a quarter of the vocabulary: rewards start near 0.25
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt_ids": [5, 9 + i, 17], "liked": liked, "base_url": base_url}) + "\n" for i in range(16)))
    toml = tmp_path / "train.toml"
    toml.write_text(f"""
[trainer]
model_dir = "{tiny_model_dir}"
task = "{SingleTurnTokensTask.name}"
prompts_file = "prompts.jsonl"
output_dir = "run"
steps = 3
redis_url = "{settings.redis_url}"
namespace = "{settings.namespace}"
progress = false
checkpoint_every_steps = 2
sampling = {{ temperature = 1.0, max_tokens = 6 }}

[trainer.sampler]
groups_per_batch = 2
group_size = 4
overflow_mode = "carry"

[trainer.optim]
lr = 1e-3

[[trainer.backends]]
type = "builtin"
url = "{base_url}"
""")
    config = TrainConfig.from_toml(toml)
    assert config.output_dir == tmp_path / "run" and config.sampler.overflow_mode == "carry"

    async with _workers(settings):
        summary = await Trainer(config).run()

    assert summary.steps_done == 3 and summary.policy_version == 3
    assert httpx.get(f"{base_url}/v1/policy_version").json()["policy_version"] == 3
    async with AsyncClient(settings=settings) as client:
        assert await client.policy_version() == 3
    rows = [json.loads(line) for line in summary.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollouts"] >= 2 * 2 and r["staleness_max"] <= 1 for r in rows)
    assert summary.checkpoint.name == "step-000003"
    assert (tmp_path / "run" / "reward_curve.png").exists()
