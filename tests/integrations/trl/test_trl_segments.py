"""TRL's real GRPOTrainer trains every segment of multi-chain jobs: a harness that compacts its
history makes two exact segments per job through the whole pipeline (real workers, sandboxes,
the built-in server); RollstreamGRPOTrainer trains the earlier one as a row of its own with its
job's advantage (GRPO's group statistics count jobs, never segments), its loss mask exact and
TRL's recomputed logprobs equal to the rollout's."""

from __future__ import annotations

import os

import pytest

trl = pytest.importorskip("trl", reason="the TRL adapter is an optional extra: pip install 'trl==1.16.0'")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from test_grpo_trainer import RecordingGRPOTrainer  # noqa: E402  (same folder)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rollstream.integrations.trl import SEGMENTS_KEY, RolloutFunc, rollstream_reward  # noqa: E402
from rollstream.integrations.trl_segments import RollstreamGRPOTrainer  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.tasks import arith  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PROMPTS, G = 2, 2


class RecordingSegmentTrainer(RecordingGRPOTrainer, RollstreamGRPOTrainer):
    """RollstreamGRPOTrainer that keeps what its loss was computed on."""


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """Spreads rewards inside each group (the tiny model rarely earns arith's 1), so advantages
    are not all 0 and a gradient reaches the tokens."""
    return [len(c[-1]["content"] if isinstance(c, list) else c) / 100 for c in completions]


def _rows(record: dict) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of each row of a loss record, padding stripped."""
    rows = []
    for i in range(record["prompt_ids"].shape[0]):
        prompt = record["prompt_ids"][i][record["prompt_mask"][i].bool()].tolist()
        completion = record["completion_ids"][i][record["completion_mask"][i].bool()].tolist()
        rows.append((prompt, completion))
    return rows


def test_every_segment_of_a_compacting_harness_job_is_a_trained_row_with_its_jobs_advantage(
        settings, compacting_pool, compacting_agent, arith_model_dir, arith_server, tmp_path):
    compacting_pool.start_all(concurrency=4)
    instances = arith.make_instances(PROMPTS, seed=21)
    rollout = RolloutFunc("arith", settings=settings, instances=instances,
                          sampling={"temperature": 1.0, "max_tokens": 32}, agent=compacting_agent,
                          batch_timeout_s=240)
    rollout.connection.run(add_backend(rollout.connection.client.r, arith_server, settings.namespace))
    outputs: list[dict] = []

    def recording_rollout(prompts, trainer):
        outputs.append(rollout(prompts, trainer))
        return outputs[-1]

    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), max_steps=1, per_device_train_batch_size=PROMPTS * G, num_generations=G,
        learning_rate=1e-4, temperature=1.0, beta=0.0, bf16=False, use_cpu=True, gradient_checkpointing=False,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0, shuffle_dataset=False)
    trainer = RecordingSegmentTrainer(
        model=AutoModelForCausalLM.from_pretrained(arith_model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(arith_model_dir),
        reward_funcs=[rollstream_reward, length_reward], args=config,
        train_dataset=Dataset.from_list(rollout.dataset_rows(instances)), rollout_func=recording_rollout)
    try:
        trainer.train()
    finally:
        rollout.close()

    [out], [record] = outputs, trainer.loss_records
    assert out["rollstream_status"] == ["completed"] * (PROMPTS * G), out["rollstream_error"]
    # Every job really made two segments: the row is the last, the first rides along.
    assert [len(s) for s in out[SEGMENTS_KEY]] == [1] * (PROMPTS * G)
    assert rollout.reports[-1].earlier_segments == PROMPTS * G

    rows = _rows(record)
    assert len(rows) == 2 * PROMPTS * G  # one row per segment, nothing else
    job_rows = [rows.index((p, c)) for p, c in zip(out["prompt_ids"], out["completion_ids"])]
    segment_rows = [rows.index((s["prompt_ids"], s["completion_ids"])) for [s] in out[SEGMENTS_KEY]]
    assert sorted(job_rows + segment_rows) == list(range(len(rows)))

    advantages = record["advantages"]
    for job, (job_row, segment_row) in enumerate(zip(job_rows, segment_rows)):
        # the segment trains with its job's advantage
        assert advantages[segment_row].item() == advantages[job_row].item()
        # exact loss mask and rollout logprobs of the earlier segment
        [segment] = out[SEGMENTS_KEY][job]
        n = len(segment["completion_ids"])
        assert record["tool_mask"][segment_row, :n].tolist() == segment["env_mask"]
        assert record["sampling_per_token_logps"][segment_row, :n].tolist() == pytest.approx(
            segment["logprobs"], abs=1e-6)
    # GRPO normalised over the G jobs of each prompt: the jobs' advantages centre on 0 per group
    # (segments counted as members would shift the group mean).
    for group in range(PROMPTS):
        members = job_rows[group * G:(group + 1) * G]
        assert sum(advantages[r].item() for r in members) == pytest.approx(0.0, abs=1e-4)
    assert any(advantages[r].item() != 0 for r in segment_rows)

    # TRL's recomputed logprobs of the earlier segments are the rollout's (exact ids), and the
    # gradient reaches their model tokens and never their masked ones.
    loss_mask = (record["completion_mask"] * record["tool_mask"]).bool()
    for row in segment_rows:
        mask = loss_mask[row]
        diff = (record["per_token_logps"][row] - record["sampling_per_token_logps"][row]).abs()[mask]
        # 1e-3: a padded float32 batch and the server's incremental decode differ by up to ~4e-4 on an
        # unlikely token (seen in CI); a wrong token id or a shifted mask differs by O(1).
        assert diff.numel() > 0 and diff.max().item() < 1e-3, diff.max().item()
        grad = record["logps_grad"][row]
        assert torch.all(grad[~mask] == 0)
        if advantages[row].item() != 0:
            assert torch.any(grad[mask] != 0)
    assert record["num_items_in_batch"].item() == loss_mask.sum().item()
