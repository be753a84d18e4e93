"""The TRL rollout function on its own (no TRL needed): how TRL's repeated prompts become
rollstream groups, how prompts map to task instances, and what a rollout that never comes
back turns into — on a real Redis, with no workers to run the jobs."""

from __future__ import annotations

import pytest

from rollstream.integrations.trl import RolloutFunc, group_rows, rollstream_reward
from rollstream.tasks import arith


def test_repeated_prompts_form_groups_of_num_generations():
    a, b = arith.prompt({"a": 1, "op": "+", "b": 2}), arith.prompt({"a": 3, "op": "+", "b": 4})
    # TRL's sampler puts each row num_generations times in a row; the same row may come twice
    assert group_rows([a, a, b, b, a, a, a, a], group_size=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_rows([a, a, b], group_size=None) == [[0, 1], [2]]


def test_prompts_map_back_to_their_instances_and_unknown_prompts_say_what_to_do(settings):
    instances = arith.make_instances(3, seed=1)
    with RolloutFunc("arith", settings=settings, instances=instances) as rollout:
        rows = rollout.dataset_rows()
        assert [rollout.instance(row["prompt"]) for row in rows] == instances
        # a datasets round trip may add None-valued keys to messages: still the same prompt
        padded = [{**m, "tool_calls": None} for m in rows[0]["prompt"]]
        assert rollout.instance(padded) == instances[0]
        with pytest.raises(KeyError, match="dataset_rows"):
            rollout.instance([{"role": "user", "content": "What is 1000 + 1?"}])


def test_rollouts_missing_at_the_deadline_enter_the_batch_masked_with_the_failed_reward(settings):
    instances = arith.make_instances(2, seed=3)
    with RolloutFunc("arith", settings=settings, instances=instances, batch_timeout_s=1.0,
                     failed_reward=None) as rollout:
        prompts = [rollout.prompt(inst) for inst in instances for _ in range(2)]
        out = rollout(prompts)  # no worker is running: nothing comes back in time
        report = rollout.reports[-1]

    assert len(out["completion_ids"]) == 4 and report.groups == 2 and report.failed == 4
    assert all(len(ids) == 1 for ids in out["completion_ids"])
    assert out["env_mask"] == [[0]] * 4 and out["logprobs"] == [[0.0]] * 4
    assert all(ids for ids in out["prompt_ids"])
    assert all("batch_timeout_s" in err for err in out["rollstream_error"])
    assert len(set(out["rollstream_job_id"])) == 4
    assert rollstream_reward(prompts, [None] * 4, **out) == [None] * 4
