"""The trainer never scores a rollout the service failed: dynamic sampling drops it from its
group (the group trains on the rest) and counts it; the agent's own failures stay scored."""

from __future__ import annotations

from dataclasses import dataclass

from rollstream.messages import Result
from rollstream.trainer.sampler import DynamicSampler, SamplerConfig

from .sim_source import SimulatedSource


@dataclass
class _Outcome:
    reward: float | None
    failure: str | None = None


class FailingSource(SimulatedSource):
    """Each prompt lists its rollouts' outcomes, failure kinds included."""

    async def _run(self, group_id: str, i: int, outcome, version: int) -> None:
        status = "failed" if outcome.failure == "infrastructure" else "completed"
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
