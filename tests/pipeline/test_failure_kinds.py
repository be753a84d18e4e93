"""Every result that falls short says whose fault it is: the service's ("infrastructure",
retried with a fresh start up to max_deliveries, then delivered for the trainer to drop) or
the agent's own. Real worker processes on a real Redis."""

from __future__ import annotations

from rollstream.client import AsyncClient


async def test_a_job_the_service_keeps_failing_is_an_infrastructure_failure_after_its_retries(settings, stage_workers):
    async with AsyncClient(settings=settings) as client, stage_workers(settings):
        broken = await client.submit({"task": "echo", "instance": {"prompt": "a", "fail_in": "run"}})
        flaky = await client.submit({"task": "echo", "instance": {"prompt": "b", "fail_in": "init", "fail_times": 1}})
        clean = await client.submit({"task": "echo", "instance": {"prompt": "c"}})
        results = {r.job_id: r for r in await client.collect(3, timeout_s=30)}
        state = await client.status(broken)
    assert results[broken].status == "failed" and results[broken].failure == "infrastructure"
    assert results[broken].infrastructure_failure and results[broken].attempts == settings.max_deliveries
    assert state.failure == "infrastructure"
    # retried from init and then fine: a clean completion, no failure kind
    assert results[flaky].status == "completed" and results[flaky].attempts == 2 and results[flaky].failure is None
    assert results[clean].failure is None and results[clean].reward == 1.0


async def test_a_cancelled_job_says_so_and_is_no_infrastructure_failure(settings, stage_workers):
    async with AsyncClient(settings=settings) as client, stage_workers(settings):
        job_id = await client.submit({"task": "echo", "instance": {"prompt": "a", "run_s": 30}})
        await client.cancel(job_id=job_id)
        [result] = await client.collect(1, timeout_s=30)
    assert result.status == "cancelled" and result.failure == "cancelled" and not result.infrastructure_failure
