"""A harness that rewrote its history leaves a trajectory of several exact segments: the
update trains on every one of them, each with the trajectory's advantage, ids unchanged."""

from __future__ import annotations

import pytest

from rollstream.trainer.batch import build_batch
from rollstream.trajectory import Segment, Trajectory


def test_each_segment_of_a_trajectory_is_a_row_with_the_trajectorys_advantage():
    first = Segment(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 0, 1], logprobs=[-0.1, 0.0, -0.3])
    second = Segment(prompt_ids=[7], response_ids=[8], loss_mask=[1], logprobs=[-0.2])
    split = Trajectory(prompt_ids=second.prompt_ids, response_ids=second.response_ids, loss_mask=second.loss_mask,
                       logprobs=second.logprobs, segments=[first, second])
    plain = Trajectory(prompt_ids=[1], response_ids=[9], loss_mask=[1], logprobs=[-0.5])
    batch = build_batch([split, plain], [0.5, -1.0], pad_token_id=0)
    assert batch.advantages.tolist() == [0.5, 0.5, -1.0]
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0], [1, 9, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert batch.behaviour_logprobs[0].tolist() == pytest.approx([0.0, 0.0, -0.1, 0.0, -0.3])
