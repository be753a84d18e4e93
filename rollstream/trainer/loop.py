"""The training loop (`rollstream train CONFIG.toml`, or `Trainer(config).run()`): dynamic
sampling through the rollout source, DAPO update, weight sync to every backend, a bump of
the policy version, metrics and checkpoints; resumes from the newest checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollstream.client import AsyncClient
from rollstream.config import load_settings
from rollstream.llm.balancer import list_backends
from rollstream.trainer.batch import build_batch
from rollstream.trainer.checkpoint import CheckpointMeta, latest_checkpoint, load_checkpoint, model_dir, save_checkpoint
from rollstream.trainer.config import TrainConfig
from rollstream.trainer.loss import group_advantages, overlong_penalty
from rollstream.trainer.metrics import MetricsLog, ProgressView, plot_reward_curve
from rollstream.trainer.sampler import DynamicSampler, RolloutSource, SampledBatch
from rollstream.trainer.source import ClientRolloutSource
from rollstream.trainer.update import PolicyUpdater
from rollstream.trainer.weight_sync import BuiltinServerBackend, WeightPublisher

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    steps_done: int
    policy_version: int
    reward_first: float | None
    reward_last: float | None
    metrics_path: Path
    reward_curve: Path | None
    checkpoint: Path | None


def read_prompts(path: Path | str) -> list[dict[str, Any]]:
    """A JSONL task file: one task instance (JSON object) per line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no prompts file at {path}; write one task instance (a JSON object) per line")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number} is not JSON: {exc}") from exc
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: each line must be a JSON object (a task instance)")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{path} holds no task instances")
    return prompts


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def stage_timings(results: list[Any]) -> dict[str, float]:
    """Mean seconds per batch rollout of each pipeline stage and agent phase (sandbox create
    = init_s, agent loop = run_s with llm_s/tools_s inside, scoring = eval_s; *_wait_s = queueing):
    where a step's rollout time goes."""
    sums: dict[str, list[float]] = {}
    for result in results:
        timings = dict(getattr(result, "timings_s", None) or {})
        trajectory = getattr(result, "trajectory", None)
        timings.update({k: v for k, v in (getattr(trajectory, "timings_s", None) or {}).items() if k != "total_s"})
        for key, value in timings.items():
            sums.setdefault(key, []).append(float(value))
    return {f"time_{key}": sum(values) / len(values) for key, values in sorted(sums.items())}  # none empty


class Trainer:
    """One training run. `source` and `publisher` default to the Redis client and the
    backends of the config (or those registered in Redis); tests and custom setups pass
    their own."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        source: RolloutSource | None = None,
        publisher: WeightPublisher | None = None,
        prompts: list[dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.source = source
        self.publisher = publisher
        self.prompts = prompts
        self._client: AsyncClient | None = None
        self.output_dir = Path(config.output_dir)
        self.checkpoint_root = self.output_dir / "checkpoints"
        self.metrics = MetricsLog(self.output_dir / "metrics.jsonl")

    # ---- setup -------------------------------------------------------------------------
    def _load_model(self, folder: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, self.config.dtype)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(self.device)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return model, tokenizer

    async def _default_source(self) -> RolloutSource:
        settings = load_settings(namespace=self.config.namespace,
                                 **({"redis_url": self.config.redis_url} if self.config.redis_url else {}))
        self._client = client = AsyncClient(self.config.redis_url, submitter=self.config.submitter, settings=settings)
        await client.__aenter__()
        return ClientRolloutSource(client, self.config.task, self.config.sampling, self.config.agent,
                                   self.config.job_timeout_s)

    async def _default_publisher(self) -> WeightPublisher:
        backends = [spec.build() for spec in self.config.backends]
        if not backends and self._client is not None:
            backends = [BuiltinServerBackend(b.url) for b in await list_backends(self._client.r, self.config.namespace)]
        if not backends:
            log.warning("no inference backend to publish weights to: rollouts will stay on the initial "
                        "policy; list them under [[backends]] or register them ('rollstream backends add URL')")
        # With Redis, each sync notes in the balancer which version every backend serves.
        return WeightPublisher(self.output_dir / "weights", backends, keep_versions=self.config.keep_weight_versions,
                               redis=self._client.r if self._client is not None else None,
                               namespace=self.config.namespace, transfer=self.config.weights_transfer)

    async def _publish(self, policy_version: int) -> float:
        assert self.publisher is not None  # set up by run(): the given one, else _default_publisher's
        report = await self.publisher.publish(self.model, self.tokenizer, policy_version)
        set_version = getattr(self.source, "set_policy_version", None)
        if set_version is not None:
            await set_version(policy_version)
        return report.total_s

    # ---- one step ----------------------------------------------------------------------
    def _training_batch(self, sampled: SampledBatch):
        trajectories, rewards, groups, results = [], [], [], []
        for index, group in enumerate(sampled.groups):
            for result in group.completed:
                if result.trajectory is None:
                    continue
                trajectories.append(result.trajectory)
                rewards.append(float(result.reward))
                groups.append(index)
                results.append(result)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        loss = self.config.loss
        if loss.max_response_tokens is not None:
            lengths = torch.tensor([len(t.response_ids) for t in trajectories])
            reward_t = reward_t + overlong_penalty(lengths, loss.max_response_tokens, loss.overlong_buffer_tokens,
                                                   loss.overlong_penalty_factor)
        advantages = group_advantages(reward_t, torch.tensor(groups), eps=loss.advantage_eps)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id or 0
        batch = build_batch(trajectories, advantages, pad_token_id=pad, max_seq_len=self.config.optim.max_seq_len)
        return batch, rewards, trajectories, results

    async def _step(self, step: int) -> dict[str, Any]:
        started = time.monotonic()
        sampled = await self.sampler.next_batch(self.policy_version)
        batch, rewards, trajectories, results = self._training_batch(sampled)
        # the version each trajectory was generated under (its oldest turn), before the bump
        versions = [t.policy_version for t in trajectories]
        stats = await asyncio.to_thread(self.updater.step, batch)
        self.policy_version += 1
        sync_s = None
        if (step + 1) % self.config.sync_every_steps == 0:
            sync_s = await self._publish(self.policy_version)
        s = sampled.stats
        return {
            "step": step + 1,
            "policy_version": self.policy_version,
            "reward_mean": _mean(rewards),
            "reward_mean_all": _mean(s.rewards_all),
            "rollouts": len(trajectories),
            "groups_kept": s.kept,
            "groups_dropped_equal": s.dropped_equal,
            "groups_dropped_failed": s.dropped_failed,
            "rollouts_failed_infrastructure": s.rollouts_failed_infrastructure,
            "rollouts_failed_agent": s.rollouts_failed_agent,
            "rollouts_failed_task": s.rollouts_failed_task,
            "groups_dropped_stale": s.dropped_stale,
            "groups_submitted": s.submitted,
            "groups_cancelled": s.cancelled,
            "groups_carried": s.carried,
            "keep_rate": s.keep_rate,
            "staleness_mean": s.staleness_mean,
            "staleness_max": s.staleness_max,
            "tokens": stats.tokens,
            "response_tokens": stats.response_tokens,
            "response_len_mean": _mean([float(len(t.response_ids)) for t in trajectories]),
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            **{k: v for k, v in stats.metrics.items() if k != "tokens"},
            "update_s": stats.seconds,
            "update_tokens_per_s": stats.tokens_per_s,
            "rollout_wait_s": s.wait_s,
            "sync_s": sync_s,
            "step_s": time.monotonic() - started,
            "rollout_tokens_per_s": stats.tokens / s.wait_s if s.wait_s > 0 else None,
            "rollout_version_min": min(versions) if versions else None,
            "rollout_version_max": max(versions) if versions else None,
            **stage_timings(results),
            "time": time.time(),
        }

    def _checkpoint(self, step: int) -> Path:
        return save_checkpoint(
            self.checkpoint_root,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.updater.optimizer,
            meta=CheckpointMeta(step=step, policy_version=self.policy_version, sampler=self.sampler.state_dict()),
            keep=self.config.keep_checkpoints,
        )

    # ---- the run -----------------------------------------------------------------------
    async def run(self) -> TrainSummary:
        config = self.config
        self.device = resolve_device(config.device)
        seed_everything(config.seed)
        checkpoint = latest_checkpoint(self.checkpoint_root) if config.resume else None
        self.model, self.tokenizer = self._load_model(model_dir(checkpoint) if checkpoint else config.model_dir)
        reference = None
        if config.loss.kl_coef > 0:
            reference, _ = self._load_model(config.model_dir)
            reference.requires_grad_(False)
        self.updater = PolicyUpdater(self.model, config.loss, config.optim, reference=reference)

        if self.source is None:
            self.source = await self._default_source()
        if self.publisher is None:
            self.publisher = await self._default_publisher()
        prompts = self.prompts if self.prompts is not None else read_prompts(config.prompts_file)
        self.sampler = DynamicSampler(self.source, prompts, config.sampler.model_copy(update={"seed": config.seed}))

        start_step, self.policy_version = 0, 0
        if checkpoint is not None:
            meta = load_checkpoint(checkpoint, optimizer=self.updater.optimizer)
            start_step, self.policy_version = meta.step, meta.policy_version
            self.sampler.load_state_dict(meta.sampler)
            log.info("resumed from %s at step %d (policy v%d)", checkpoint, start_step, self.policy_version)
        # backends may serve anything (the base model, another run): make them serve ours
        await self._publish(self.policy_version)

        view = ProgressView(config.steps, start_step, enabled=config.progress)
        last_checkpoint = checkpoint
        step = start_step
        try:
            for step in range(start_step, config.steps):
                row = await self._step(step)
                self.metrics.write(row)
                view.update(row)
                if (step + 1) % config.checkpoint_every_steps == 0 or step + 1 == config.steps:
                    last_checkpoint = self._checkpoint(step + 1)
            step = config.steps
        finally:
            view.close()
            await self.sampler.cancel_all()
            if self._client is not None:
                await self._client.close()

        rows = self.metrics.read()
        curve = plot_reward_curve(rows, self.output_dir / "reward_curve.png") if rows else None
        rewards = [r["reward_mean_all"] for r in rows if r.get("reward_mean_all") is not None]
        return TrainSummary(
            steps_done=step,
            policy_version=self.policy_version,
            reward_first=rewards[0] if rewards else None,
            reward_last=rewards[-1] if rewards else None,
            metrics_path=self.metrics.path,
            reward_curve=curve,
            checkpoint=last_checkpoint,
        )


def train(config: TrainConfig | Path | str, **kwargs: Any) -> TrainSummary:
    """Blocking entry point: `train("train.toml")`."""
    if not isinstance(config, TrainConfig):
        config = TrainConfig.from_toml(config)
    return asyncio.run(Trainer(config, **kwargs).run())
