"""Trajectories to padded, token-aligned tensors."""

import pytest
import torch

from rollstream.trainer.batch import build_batch
from rollstream.trajectory import Trajectory


def _traj(prompt, response, mask, logprobs):
    return Trajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=logprobs)


def test_batch_aligns_masks_and_logprobs_with_tokens_and_pads_right():
    a = _traj([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, 0.0, -0.3])  # 4 is a tool observation
    b = _traj([6], [7], [1], [-0.7])
    batch = build_batch([a, b], [0.5, -0.5], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert torch.allclose(batch.behaviour_logprobs, torch.tensor([[0, 0, -0.1, 0, -0.3], [0, -0.7, 0, 0, 0]]))
    assert batch.advantages.tolist() == [0.5, -0.5]
    assert batch.num_response_tokens == 3 and batch.num_tokens == 7


def test_too_long_sequences_lose_the_end_of_their_response():
    a = _traj([1, 2], [3, 4, 5, 6], [1, 1, 1, 1], [-1.0, -2.0, -3.0, -4.0])
    batch = build_batch([a], [1.0], pad_token_id=0, max_seq_len=4)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4]]
    assert batch.behaviour_logprobs.tolist() == [[0.0, 0.0, -1.0, -2.0]]
    with pytest.raises(ValueError, match="max_seq_len"):
        build_batch([a], [1.0], pad_token_id=0, max_seq_len=2)


def test_micro_batches_cover_every_row_once_with_little_padding():
    trajs = [_traj([1], [2] * n, [1] * n, [-1.0] * n) for n in (1, 9, 2, 8, 3)]
    batch = build_batch(trajs, [float(i) for i in range(5)], pad_token_id=0)
    micros = batch.micro_batches(2)
    assert sorted(a for m in micros for a in m.advantages.tolist()) == [0, 1, 2, 3, 4]
    assert sum(m.num_response_tokens for m in micros) == batch.num_response_tokens
    assert micros[0].input_ids.shape[1] == 10 and micros[-1].input_ids.shape[1] == 2
