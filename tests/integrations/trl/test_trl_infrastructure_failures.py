"""The TRL rollout function drops a rollout the service failed (reward None: TRL leaves it out
of its group's baseline) instead of scoring it 0, and counts it; other failures keep the
configured failed_reward. On a real Redis with no workers (nothing comes back in time)."""

from __future__ import annotations

from rollstream.integrations.trl import RolloutFunc, rollstream_reward
from rollstream.messages import Result
from rollstream.tasks import arith


def test_rollouts_the_service_failed_are_unscored_by_default_and_counted(settings):
    instances = arith.make_instances(2, seed=5)
    with RolloutFunc("arith", settings=settings, instances=instances, batch_timeout_s=1.0) as rollout:
        prompts = [rollout.prompt(inst) for inst in instances for _ in range(2)]
        out = rollout(prompts)  # no worker runs: every rollout is missing at the deadline
        report = rollout.reports[-1]
    assert report.failed == report.failed_infrastructure == 4
    assert out["rollstream_failure"] == ["infrastructure"] * 4
    assert rollstream_reward(prompts, [None] * 4, **out) == [None] * 4  # never 0.0


def test_an_invalid_job_keeps_the_failed_reward_and_an_infrastructure_failure_does_not(settings):
    instance = arith.make_instances(1, seed=6)[0]
    with RolloutFunc("arith", settings=settings, instances=[instance]) as rollout:
        prompts = [rollout.prompt(instance)] * 2
        results = {"j1": Result(job_id="j1", group_id="g", status="failed", failure="job", error="bad spec"),
                   "j2": Result(job_id="j2", group_id="g", status="failed", failure="infrastructure", error="gone")}
        out = rollout._to_trl(prompts, [[0, 1]], results, trainer=None)
    assert out["rollstream_reward"] == [0.0, None]


def test_a_broken_environments_rollout_is_unscored_like_an_infrastructure_failure(settings):
    instance = arith.make_instances(1, seed=7)[0]
    with RolloutFunc("arith", settings=settings, instances=[instance]) as rollout:
        prompts = [rollout.prompt(instance)] * 2
        results = {"j1": Result(job_id="j1", group_id="g", status="failed", failure="task",
                                error="harbor task x: environment/Dockerfile did not build"),
                   "j2": Result(job_id="j2", group_id="g", status="failed", failure="job", error="bad spec")}
        out = rollout._to_trl(prompts, [[0, 1]], results, trainer=None)
    assert out["rollstream_reward"] == [None, 0.0]  # the broken environment is never a 0 to learn from
    assert out["rollstream_error"][0] == "harbor task x: environment/Dockerfile did not build"
