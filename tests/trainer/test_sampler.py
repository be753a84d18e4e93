"""Dynamic sampling over a simulated rollout source."""

import asyncio

import pytest

from rollstream.trainer.sampler import DynamicSampler, SamplerConfig, SamplerStalled

from .sim_source import SimulatedSource

INFORMATIVE = {"rewards": [1.0, 0.0]}
ALL_RIGHT = {"rewards": [1.0]}
ALL_WRONG = {"rewards": [0.0]}


def _prompts():
    # two of three prompts give equal rewards in every group
    return [INFORMATIVE, ALL_RIGHT, ALL_WRONG] * 10


async def test_groups_with_equal_rewards_never_reach_a_batch_and_the_batch_still_fills():
    source = SimulatedSource(seed=1)
    sampler = DynamicSampler(source, _prompts(), SamplerConfig(groups_per_batch=4, group_size=4))
    for step in range(3):
        source.policy_version = step
        batch = await sampler.next_batch(policy_version=step)
        assert len(batch.groups) == 4
        for group in batch.groups:
            assert len(group.results) == 4
            assert len(set(group.rewards)) > 1
            assert source.submitted[group.group_id] is INFORMATIVE
        assert batch.stats.dropped_equal > 0
    await sampler.cancel_all()


async def test_keep_rate_estimate_follows_observed_drops():
    # No delays: rollouts finish in the order they were sent, whatever the machine's load, so the
    # groups the estimate observes are the same on every run (with random timer delays, a busy
    # machine let late timers fire together and the batch filled before any drop was seen).
    source = SimulatedSource(seed=2, max_delay_s=0.0)
    sampler = DynamicSampler(source, _prompts(), SamplerConfig(groups_per_batch=4, group_size=2))
    for step in range(4):
        source.policy_version = step
        batch = await sampler.next_batch(step)
    # a third of prompts are informative
    assert 0.1 < batch.stats.keep_rate < 0.7, batch.stats.keep_rate
    # and the sampler keeps more groups in flight than it needs, so the batch fills without waiting
    assert sampler._target_in_flight(4) > 4
    await sampler.cancel_all()


async def test_full_batch_cancels_redundant_groups_in_cancel_mode():
    source = SimulatedSource(seed=3, max_delay_s=0.02)
    config = SamplerConfig(groups_per_batch=2, group_size=4, overflow_mode="cancel", max_in_flight_groups=12)
    sampler = DynamicSampler(source, [INFORMATIVE] * 20, config)
    sampler.state.keep_rate = 0.2  # pessimistic: 10 groups go out for a batch of 2
    batch = await sampler.next_batch(0)
    assert batch.stats.cancelled > 0
    assert sampler.in_flight_group_ids == []
    await asyncio.sleep(0)
    kept = {g.group_id for g in batch.groups}
    assert source.running_groups() == set()
    assert source.cancelled == set(source.submitted) - kept
    # cancelled prompts come back first in the next step
    assert len(sampler.state.requeued) == batch.stats.cancelled


async def test_carry_mode_keeps_fresh_groups_for_the_next_step():
    source = SimulatedSource(seed=4, max_delay_s=0.02)
    config = SamplerConfig(groups_per_batch=2, group_size=4, overflow_mode="carry", max_staleness=1)
    sampler = DynamicSampler(source, [INFORMATIVE] * 20, config)
    sampler.state.keep_rate = 0.3
    first = await sampler.next_batch(0)
    carried = set(sampler.in_flight_group_ids)
    assert first.stats.carried == len(carried) > 0 and first.stats.cancelled == 0
    source.policy_version = 1
    second = await sampler.next_batch(1)
    # carried groups fill the next batch (submitted at version 0: staleness 1, within bound)
    assert {g.group_id for g in second.groups} & carried
    assert second.stats.staleness_max <= 1
    await sampler.cancel_all()


async def test_carried_groups_beyond_the_staleness_bound_are_cancelled():
    source = SimulatedSource(seed=5, max_delay_s=0.02)
    config = SamplerConfig(groups_per_batch=2, group_size=4, overflow_mode="carry", max_staleness=1)
    sampler = DynamicSampler(source, [INFORMATIVE] * 20, config)
    sampler.state.keep_rate = 0.3
    await sampler.next_batch(0)
    carried = set(sampler.in_flight_group_ids)
    source.policy_version = 5
    batch = await sampler.next_batch(5)  # the trainer moved on 5 versions meanwhile
    assert carried <= source.cancelled
    assert not ({g.group_id for g in batch.groups} & carried)
    await sampler.cancel_all()


async def test_groups_with_too_few_completed_rollouts_are_dropped():
    source = SimulatedSource(seed=6)
    prompts = [{"rewards": [1.0, None, None, None]}, INFORMATIVE]
    sampler = DynamicSampler(source, prompts, SamplerConfig(groups_per_batch=3, group_size=4))
    batch = await sampler.next_batch(0)
    assert all(source.submitted[g.group_id] is INFORMATIVE for g in batch.groups)
    assert batch.stats.dropped_failed > 0
    await sampler.cancel_all()


async def test_state_round_trip_resumes_the_prompt_order_and_reruns_in_flight_prompts():
    source = SimulatedSource(seed=7, max_delay_s=0.02)
    prompts = [{"rewards": [1.0, 0.0], "id": i} for i in range(12)]
    config = SamplerConfig(groups_per_batch=2, group_size=2, overflow_mode="carry", seed=3)
    sampler = DynamicSampler(source, prompts, config)
    await sampler.next_batch(0)
    source.policy_version = 1
    state = sampler.state_dict()
    in_flight = {g["prompt_index"] for g in state["in_flight"]}

    source2 = SimulatedSource(seed=8)
    resumed = DynamicSampler(source2, prompts, config)
    resumed.load_state_dict(state)
    batch = await resumed.next_batch(1)
    assert {g["group_id"] for g in state["in_flight"]} <= source2.cancelled
    first_prompts = [source2.submitted[g]["id"] for g in list(source2.submitted)[: len(in_flight)]]
    assert set(first_prompts) == in_flight
    assert resumed.state.epoch == state["epoch"] or resumed.state.position != state["position"]
    assert len(batch.groups) == 2
    await resumed.cancel_all()
    await sampler.cancel_all()


async def test_results_from_a_backend_that_never_syncs_raise_instead_of_spinning():
    source = SimulatedSource(seed=9)  # always reports policy version 0
    sampler = DynamicSampler(source, [INFORMATIVE],
                             SamplerConfig(groups_per_batch=1, group_size=2, max_in_flight_groups=2))
    with pytest.raises(SamplerStalled, match="weight sync"):
        await sampler.next_batch(policy_version=5)
    await sampler.cancel_all()


async def test_a_silent_source_raises_an_error_that_says_what_to_check():
    class Silent(SimulatedSource):
        async def submit_group(self, prompt, n):
            self.submitted[f"silent{len(self.submitted)}"] = prompt
            return f"silent{len(self.submitted)}"

    sampler = DynamicSampler(Silent(), [INFORMATIVE],
                             SamplerConfig(groups_per_batch=1, group_size=2, result_timeout_s=0.05))
    with pytest.raises(SamplerStalled, match="rollstream status"):
        await sampler.next_batch(0)


async def test_a_redelivered_result_counts_once():
    class Redelivering(SimulatedSource):
        async def _run(self, group_id, i, reward, version):
            await super()._run(group_id, i, reward, version)
            await super()._run(group_id, i, reward, version)  # at-least-once delivery

    source = Redelivering(seed=10)
    sampler = DynamicSampler(source, [INFORMATIVE], SamplerConfig(groups_per_batch=2, group_size=4))
    batch = await sampler.next_batch(0)
    for group in batch.groups:
        assert len({r.job_id for r in group.results}) == len(group.results) == 4
    await sampler.cancel_all()
