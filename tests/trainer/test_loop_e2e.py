"""The training loop end to end on a CPU: the tiny model learns a simple preference through
the built-in server (rollouts sampled there, weights synced back after every update)."""

import json

import httpx
import pytest
from transformers import AutoTokenizer

from rollstream.trainer.config import OptimConfig, TrainConfig
from rollstream.trainer.direct_source import DirectServerSource
from rollstream.trainer.loop import Trainer
from rollstream.trainer.sampler import SamplerConfig
from rollstream.trainer.weight_sync import BuiltinServerBackend, WeightPublisher


def _digit_reward(tokenizer):
    digits = {i for i in range(len(tokenizer)) if any(c.isdigit() for c in tokenizer.decode([i]))}
    return lambda prompt, ids: sum(i in digits for i in ids) / max(len(ids), 1)


def _config(tiny_model_dir, out, steps):
    return TrainConfig(
        model_dir=tiny_model_dir, task="direct", prompts_file=out / "unused.jsonl", output_dir=out, steps=steps,
        seed=0, sampler=SamplerConfig(groups_per_batch=4, group_size=8),
        optim=OptimConfig(lr=3e-3, micro_batch_size=16), checkpoint_every_steps=3, progress=False,
    )


async def _train(config, base_url, tokenizer, seen_versions):
    reward = _digit_reward(tokenizer)

    class Recording(DirectServerSource):
        async def results(self):
            async for result in super().results():
                seen_versions.append((result.policy_version, self.policy_version))
                yield result

    source = Recording(base_url, reward, {"max_tokens": 8}, seed=0)  # same completions however the server batches
    prompts = [{"prompt_ids": tokenizer.encode(f"Say some numbers: {i}")} for i in range(32)]
    publisher = WeightPublisher(config.output_dir / "weights", [BuiltinServerBackend(base_url)])
    try:
        return await Trainer(config, source=source, publisher=publisher, prompts=prompts).run()
    finally:
        await source.aclose()


@pytest.mark.slow
async def test_reward_rises_and_trajectories_carry_the_policy_version_that_made_them(tiny_model_dir, model_server,
                                                                                     tmp_path):
    _, base_url = model_server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen: list[tuple[int, int]] = []
    summary = await _train(_config(tiny_model_dir, tmp_path, steps=12), base_url, tokenizer, seen)

    rows = [json.loads(line) for line in summary.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    first = sum(r["reward_mean_all"] for r in rows[:3]) / 3
    last = sum(r["reward_mean_all"] for r in rows[-3:]) / 3
    assert last > first + 0.1, [round(r["reward_mean_all"], 3) for r in rows]
    # cancel mode: every trajectory comes from the weights published before it was submitted
    assert all(r["staleness_max"] == 0 for r in rows)
    assert {traj for traj, _ in seen} >= set(range(0, 12))
    assert all(traj <= current for traj, current in seen)
    # the server serves the last published weights
    assert httpx.get(f"{base_url}/v1/policy_version").json()["policy_version"] == summary.policy_version == 12
    assert summary.reward_curve is not None and summary.reward_curve.stat().st_size > 0
    logged = {"loss", "clip_frac", "keep_rate", "tokens", "update_tokens_per_s", "sync_s", "staleness_mean"}
    assert logged <= rows[-1].keys()


@pytest.mark.slow
async def test_a_stopped_run_resumes_from_its_checkpoint(tiny_model_dir, model_server, tmp_path):
    _, base_url = model_server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = await _train(_config(tiny_model_dir, tmp_path, steps=3), base_url, tokenizer, [])
    assert first.checkpoint.name == "step-000003"
    resumed = await _train(_config(tiny_model_dir, tmp_path, steps=5), base_url, tokenizer, [])
    assert resumed.policy_version == 5 and resumed.checkpoint.name == "step-000005"
    rows = [json.loads(line) for line in resumed.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert httpx.get(f"{base_url}/v1/policy_version").json()["policy_version"] == 5
