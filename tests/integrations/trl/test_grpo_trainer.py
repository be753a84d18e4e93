"""TRL's real GRPOTrainer trained through rollstream: every completion comes from the
pipeline (real Redis, init/run/eval worker processes, bubblewrap sandboxes with bash, the
built-in server), rewards from the eval stage, weights back to the server after each step."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

trl = pytest.importorskip("trl", reason="the TRL adapter is an optional extra: pip install 'trl==1.16.0'")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rollstream.integrations.trl import RolloutFunc, rollstream_reward  # noqa: E402
from rollstream.integrations.trl_weight_sync import WeightSyncCallback  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.tasks import arith  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

STEPS, PROMPTS, G = 3, 2, 4


@pytest.fixture(scope="module")
def private_arith_server(arith_model_dir):
    """A built-in server of our own: this test changes its weights, the session one is shared."""
    from rollstream.llm.server import served_model

    with served_model(arith_model_dir, device="cpu") as url:
        yield url


def answer_closeness(prompts, completions, instance, **kwargs) -> list[float]:
    """A shaping reward beside the eval stage's 0/1: how close the submitted number is. The
    warmed-up tiny model rarely copies the tool's output right, and without reward variance
    every advantage (hence every gradient) would be zero."""
    rewards = []
    for completion, inst in zip(completions, instance):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        answers = re.findall(r'"answer": "(-?\d+)"', text)
        expected = arith.expected(json.loads(inst))
        rewards.append(-min(abs(int(answers[-1]) - expected), 100) / 100 if answers else -1.0)
    return rewards


class RecordingGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer that keeps what its loss was computed on: the inputs (masks, rollout
    logprobs), the logprobs TRL recomputed, and the gradient that reached each token."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_records: list[dict] = []
        self._record: dict | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._record = {"step": self.state.global_step,
                        **{k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}}
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._record["loss"] = loss.detach().item()
        self.loss_records.append(self._record)
        return loss

    def _get_per_token_logps_and_entropies(self, model, *args, compute_entropy=False, **kwargs):
        out = super()._get_per_token_logps_and_entropies(model, *args, compute_entropy=compute_entropy, **kwargs)
        record = self._record
        if compute_entropy and record is not None and "per_token_logps" not in record:  # the loss's own call
            logps = out[0]
            record["per_token_logps"] = logps.detach().clone()
            if logps.requires_grad:
                logps.register_hook(lambda grad: record.__setitem__("logps_grad", grad.detach().clone()))
        return out


def test_grpo_trainer_trains_on_rollstream_rollouts_with_tool_tokens_masked_and_fresh_weights(
        settings, worker_pool, arith_model_dir, private_arith_server, sandbox_root, tmp_path):
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    pool.start_all(concurrency=8)

    instances = arith.make_instances(PROMPTS * STEPS, seed=11)
    rollout = RolloutFunc("arith", settings=settings, instances=instances,
                          sampling={"temperature": 1.0, "max_tokens": 32},
                          agent={"max_turns": 3, "max_tokens_per_turn": 32, "max_context_tokens": 1024},
                          batch_timeout_s=240)
    rollout.connection.run(add_backend(rollout.connection.client.r, private_arith_server, settings.namespace))
    outputs: list[dict] = []

    def recording_rollout(prompts, trainer):
        out = rollout(prompts, trainer)
        outputs.append(out)
        return out

    model = AutoModelForCausalLM.from_pretrained(arith_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(arith_model_dir)
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), max_steps=STEPS, per_device_train_batch_size=PROMPTS * G,
        num_generations=G, learning_rate=2e-4, temperature=1.0, beta=0.0, bf16=False, use_cpu=True,
        gradient_checkpointing=False, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dataloader_num_workers=0, shuffle_dataset=False)
    sync = WeightSyncCallback(tmp_path / "weights", rollout_func=rollout)
    trainer = RecordingGRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[rollstream_reward, answer_closeness], args=config,
        train_dataset=Dataset.from_list(rollout.dataset_rows(instances)), rollout_func=recording_rollout,
        callbacks=[sync])
    try:
        trainer.train()
    finally:
        rollout.close()

    # At least three optimizer steps, each on a finite loss over rollstream's completions.
    assert trainer.state.global_step == STEPS
    records = trainer.loss_records
    assert len(records) == STEPS and all(math.isfinite(r["loss"]) for r in records)
    assert all(len(out["completion_ids"]) == PROMPTS * G for out in outputs)
    assert all(s == "completed" for out in outputs for s in out["rollstream_status"]), \
        [e for out in outputs for e in out["rollstream_error"] if e]

    # Rewards TRL trained on are the eval stage's.
    logged = [row["rewards/rollstream_reward/mean"] for row in trainer.state.log_history
              if "rewards/rollstream_reward/mean" in row]
    assert logged == pytest.approx([sum(o["rollstream_reward"]) / len(o["rollstream_reward"]) for o in outputs])

    # Tool observations: TRL's loss mask is the trajectories' loss mask, and no gradient
    # reaches an observation token, while model tokens do get one.
    observation_tokens = model_tokens_with_grad = 0
    for record, out in zip(records, outputs):
        completion_mask, tool_mask = record["completion_mask"], record["tool_mask"]
        grad = record["logps_grad"]
        for row in range(completion_mask.shape[0]):
            length = int(completion_mask[row].sum())
            ids = record["completion_ids"][row, :length].tolist()
            source = out["completion_ids"].index(ids)  # TRL shuffles rows after generation
            env_mask = out["env_mask"][source]
            assert tool_mask[row, :length].tolist() == env_mask
            observation = torch.tensor(env_mask) == 0
            observation_tokens += int(observation.sum())
            assert torch.all(grad[row, :length][observation] == 0)
            model_tokens_with_grad += int((grad[row, :length][~observation] != 0).sum())
    assert observation_tokens > 0, "no tool observation in any completion: the arith model should call bash"
    assert model_tokens_with_grad > 0

    # After each step the weights reached the server: rollouts of step k ran on policy v{k}.
    assert [sorted(set(out["rollstream_policy_version"])) for out in outputs] == [[k] for k in range(STEPS)]
    assert [r.policy_version for r in sync.reports] == list(range(STEPS + 1))

    # Step 0: TRL's recomputed logprobs of the completions equal the rollout logprobs (fp32, CPU).
    first = records[0]
    assert first["step"] == 0
    loss_mask = (first["completion_mask"] * first["tool_mask"]).bool()
    diff = (first["per_token_logps"] - first["sampling_per_token_logps"]).abs()[loss_mask]
    # 1e-3: a padded float32 batch and the server's incremental decode differ by up to ~4e-4 on an
    # unlikely token; a wrong token id or a shifted mask differs by O(1).
    assert diff.numel() > 0 and diff.max().item() < 1e-3, diff.max().item()
