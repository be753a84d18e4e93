"""The verl adapter's translations (no verl needed): dataset rows and sampling params to a
rollstream Job, a Result to AgentLoopOutput fields with verl's response-length cut."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rollstream.errors import InvalidJob
from rollstream.integrations.verl_mapping import (
    build_job,
    dataset_row,
    observation_blocks,
    row_spec,
    sample_from_result,
    sampling_from_verl,
)
from rollstream.messages import Result
from rollstream.trajectory import Trajectory

# Two model turns with one tool observation between them: 1 1 1 | 0 0 | 1 1
TRAJ = Trajectory(prompt_ids=[1, 2, 3], response_ids=[10, 11, 12, 20, 21, 13, 14],
                  loss_mask=[1, 1, 1, 0, 0, 1, 1], logprobs=[-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5],
                  num_turns=2, timings_s={"llm_s": 1.5, "tools_s": 0.25})


def _result(**kw) -> Result:
    return Result(job_id="j1", status="completed", reward=1.0, trajectory=TRAJ, policy_version=7,
                  timings_s={"eval_s": 0.1}, **kw)


def test_response_is_cut_at_verl_length_with_mask_and_logprobs_at_the_same_index():
    s = sample_from_result(_result(), response_length=4)
    assert s.response_ids == [10, 11, 12, 20]
    assert s.response_mask == [1, 1, 1, 0]
    assert s.response_logprobs == [-0.1, -0.2, -0.3, 0.0]
    assert s.prompt_ids == [1, 2, 3] and s.reward_score == 1.0
    assert s.extra_fields["rollstream_truncated"] is True


def test_uncut_sample_keeps_every_field_and_counts_verl_turns():
    s = sample_from_result(_result(), response_length=100)
    assert (s.response_ids, s.response_mask, s.response_logprobs) == (TRAJ.response_ids, TRAJ.loss_mask, TRAJ.logprobs)
    assert s.num_turns == 1 + 2 + 1  # prompt, two assistant turns, one tool block
    assert s.metrics == {"generate_sequences": 1.5, "tool_calls": 0.25, "compute_score": 0.1, "num_preempted": -1}
    assert s.extra_fields["rollstream_policy_version"] == 7
    assert s.extra_fields["rollstream_truncated"] is False
    assert observation_blocks([0, 0, 1, 0, 1, 1, 0]) == 3


def test_row_spec_reads_json_or_dict_and_says_how_to_build_rows():
    row = dataset_row("arith", {"a": 1, "op": "+", "b": 2}, index=3)
    assert json.loads(row["extra_info"]["rollstream"])["instance"] == {"a": 1, "op": "+", "b": 2}
    assert row["prompt"][-1]["content"] == "What is 1 + 2?"
    assert row_spec({"extra_info": {"rollstream": {"task": "arith", "instance": {}}}}).task == "arith"
    with pytest.raises(InvalidJob, match="dataset_row"):
        row_spec({"extra_info": {"index": 0}})


def test_job_takes_group_from_uid_and_agent_limits_from_verl_with_row_overrides_last():
    row = dataset_row("arith", {"a": 1, "op": "+", "b": 2}, index=3, agent={"max_turns": 2})
    row["uid"], row["index"] = np.str_("abc"), np.int64(3)
    job = build_job(row, {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": False},
                    default_task=None, agent_defaults={"max_context_tokens": 640, "max_turns": 8},
                    agent_overrides={"max_turns": 4, "tool_timeout_s": 5}, sandbox=None, timeout_s=60)
    assert job.task == "arith" and job.group_id == "verl-abc" and job.timeout_s == 60
    assert job.agent == {"max_context_tokens": 640, "max_turns": 2, "tool_timeout_s": 5}
    assert job.sampling.temperature == 0 and "logprobs" not in job.sampling.extra_fields()
    assert job.metadata == {"verl_index": 3, "verl_uid": "abc"}


def test_row_without_task_needs_a_default_task():
    row = {"extra_info": {"rollstream": {"instance": {"a": 1, "op": "+", "b": 2}}}}
    with pytest.raises(InvalidJob, match="ROLLSTREAM_VERL_TASK"):
        build_job(row, {}, default_task=None, agent_defaults={}, agent_overrides={}, sandbox=None, timeout_s=1)
    assert build_job(row, {}, default_task="arith", agent_defaults={}, agent_overrides={}, sandbox=None,
                     timeout_s=1).task == "arith"


def test_verl_top_k_zero_means_disabled():
    assert sampling_from_verl({"top_k": 0}).top_k == -1
