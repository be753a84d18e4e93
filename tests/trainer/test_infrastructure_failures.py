"""The trainer never scores a rollout the service failed: dynamic sampling drops it from its
group (the group trains on the rest) and counts it; the agent's own failures stay scored."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rollstream.messages import Result
from rollstream.trainer.sampler import DynamicSampler, SamplerConfig, SamplerStalled

from .sim_source import SimulatedSource


@dataclass
class _Outcome:
    reward: float | None
    failure: str | None = None


class FailingSource(SimulatedSource):
    """Each prompt lists its rollouts' outcomes, failure kinds included."""

    async def _run(self, group_id: str, i: int, outcome, version: int) -> None:
        status = "failed" if outcome.failure in ("infrastructure", "task") else "completed"
        reward = None if status == "failed" else outcome.reward
        await self.queue.put(Result(job_id=f"{group_id}-{i}", group_id=group_id, status=status, reward=reward,
                                    failure=outcome.failure, policy_version=version))


async def test_infrastructure_failures_are_dropped_per_sample_and_counted_never_scored_zero():
    prompt = {"rewards": [_Outcome(1.0), _Outcome(None, "infrastructure"), _Outcome(0.0, "agent"), _Outcome(1.0)]}
    source = FailingSource()
    sampler = DynamicSampler(source, [prompt], SamplerConfig(groups_per_batch=1, group_size=4))
    batch = await sampler.next_batch(policy_version=0)
    [group] = batch.groups
    assert len(group.results) == 4
    assert sorted(group.rewards) == [0.0, 1.0, 1.0]  # three scored rollouts; the failed one is not a 0
    assert batch.stats.rollouts_failed_infrastructure == 1 and batch.stats.rollouts_failed_agent == 1
    await sampler.cancel_all()


async def test_a_broken_environments_rollouts_are_dropped_and_counted_as_task_failures():
    prompt = {"rewards": [_Outcome(1.0), _Outcome(None, "task"), _Outcome(0.0), _Outcome(None, "task")]}
    source = FailingSource()
    sampler = DynamicSampler(source, [prompt], SamplerConfig(groups_per_batch=1, group_size=4))
    batch = await sampler.next_batch(policy_version=0)
    [group] = batch.groups
    assert sorted(group.rewards) == [0.0, 1.0]  # never a 0 for the environment's own failure
    assert batch.stats.rollouts_failed_task == 2 and batch.stats.rollouts_failed_infrastructure == 0
    await sampler.cancel_all()


async def test_when_every_rollout_fails_the_sampler_stops_and_names_the_failure():
    # Each failed group is replaced at once; with nothing ever completing that would go on for ever.
    prompt = {"rewards": [_Outcome(None, "infrastructure")] * 2}
    source = FailingSource()
    sampler = DynamicSampler(source, [prompt], SamplerConfig(groups_per_batch=1, group_size=2,
                                                             max_in_flight_groups=3))
    with pytest.raises(SamplerStalled, match="6 groups in a row had no completed rollout"):
        await sampler.next_batch(policy_version=0)
    await sampler.cancel_all()


async def test_a_completed_rollout_resets_the_count_of_failed_groups():
    failing = {"rewards": [_Outcome(None, "infrastructure")] * 2}
    informative = {"rewards": [_Outcome(1.0), _Outcome(0.0)]}
    source = FailingSource()
    # Two failed groups for each informative one in every epoch's order: at most four in a row.
    sampler = DynamicSampler(source, [failing, failing, informative], SamplerConfig(
        groups_per_batch=4, group_size=2, max_in_flight_groups=1, max_failed_groups_in_a_row=5))
    batch = await sampler.next_batch(policy_version=0)
    assert len(batch.groups) == 4 and batch.stats.dropped_failed >= 4
    await sampler.cancel_all()
