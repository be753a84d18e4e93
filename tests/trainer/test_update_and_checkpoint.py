"""The update step on the tiny model, and resume from a checkpoint."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.trainer.batch import build_batch
from rollstream.trainer.checkpoint import (
    CheckpointMeta,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_dir,
    save_checkpoint,
)
from rollstream.trainer.config import LossConfig, OptimConfig
from rollstream.trainer.update import PolicyUpdater, token_logprobs
from rollstream.trajectory import Trajectory


def _batch(seed: int, model=None):
    """A random batch whose behaviour logprobs come from `model` when given (on-policy)."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for _ in range(4):
        prompt = torch.randint(3, 1000, (3,), generator=gen).tolist()
        n = int(torch.randint(2, 6, (1,), generator=gen))
        response = torch.randint(3, 1000, (n,), generator=gen).tolist()
        mask = [1] * n
        mask[0] = 0
        trajs.append(Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=[0.0] * n))
    batch = build_batch(trajs, [1.0, -1.0, 0.5, -0.5], pad_token_id=0)
    if model is not None:
        with torch.no_grad():
            logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask)
            batch.behaviour_logprobs = logprobs * batch.response_mask
    return batch


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


OPTIM = OptimConfig(lr=1e-3, micro_batch_size=2)


def test_update_raises_the_likelihood_of_positive_advantage_tokens(tiny_model_dir):
    torch.manual_seed(0)
    model = _load(tiny_model_dir)
    batch = _batch(0, model)
    updater = PolicyUpdater(model, LossConfig(), OPTIM)
    before = token_logprobs(model.eval(), batch.input_ids, batch.attention_mask).detach()
    stats = updater.step(batch)
    after = token_logprobs(model.eval(), batch.input_ids, batch.attention_mask).detach()
    delta = ((after - before) * batch.response_mask).sum(dim=1)
    assert delta[0] > 0 and delta[1] < 0  # advantages +1 and -1
    assert stats.response_tokens == batch.num_response_tokens
    assert stats.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy first step
    assert stats.tokens_per_s > 0


def test_micro_batching_gives_the_same_update_as_one_big_batch(tiny_model_dir):
    results = []
    for micro in (1, 4):
        torch.manual_seed(0)
        model = _load(tiny_model_dir)
        updater = PolicyUpdater(model, LossConfig(), OptimConfig(lr=1e-3, micro_batch_size=micro))
        # plain SGD: parameter deltas are the gradient itself (Adam's first step is sign(g),
        # which turns float noise on near-zero gradients into full-size differences)
        updater.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        updater.step(_batch(1, model))
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_resume_from_checkpoint_gives_the_same_next_step_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    def next_step_inputs(model, step):
        # the "next batch" depends on every RNG, as sampling order and dropout would
        return _batch(100 + step + random.randrange(1000) + int(torch.randint(0, 1000, (1,))), model)

    torch.manual_seed(0)
    random.seed(0)
    model = _load(tiny_model_dir)
    updater = PolicyUpdater(model, LossConfig(), OPTIM)
    for step in range(2):
        updater.step(next_step_inputs(model, step))
    save_checkpoint(tmp_path / "ckpt", model=model, tokenizer=None, optimizer=updater.optimizer,
                    meta=CheckpointMeta(step=2, policy_version=2, sampler={"epoch": 1}))
    uninterrupted = updater.step(next_step_inputs(model, 2))
    expected = torch.cat([p.detach().flatten() for p in model.parameters()])

    # a new process: everything rebuilt from the checkpoint folder
    torch.manual_seed(12345)
    random.seed(12345)
    checkpoint = latest_checkpoint(tmp_path / "ckpt")
    resumed_model = _load(model_dir(checkpoint))
    resumed = PolicyUpdater(resumed_model, LossConfig(), OPTIM)
    meta = load_checkpoint(checkpoint, optimizer=resumed.optimizer)
    assert (meta.step, meta.policy_version, meta.sampler) == (2, 2, {"epoch": 1})
    again = resumed.step(next_step_inputs(resumed_model, 2))
    assert again.loss == pytest.approx(uninterrupted.loss, abs=1e-7)
    assert torch.equal(torch.cat([p.detach().flatten() for p in resumed_model.parameters()]), expected)


def test_old_checkpoints_are_pruned_and_half_written_ones_ignored(tiny_model_dir, tmp_path):
    model = _load(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model=model, tokenizer=None, optimizer=optimizer,
                        meta=CheckpointMeta(step=step, policy_version=step), keep=2)
    (tmp_path / "step-000009").mkdir()  # interrupted write: no trainer_state.json
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
