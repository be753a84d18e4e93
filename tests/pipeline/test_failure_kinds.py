"""Every result that falls short says whose fault it is: the service's ("infrastructure",
retried with a fresh start up to max_deliveries, then delivered for the trainer to drop) or
the agent's own; a cancelled job says so. Real worker processes on a real Redis."""

from __future__ import annotations

from rollstream.client import AsyncClient


async def test_each_result_says_whose_fault_its_shortfall_is(settings, stage_workers):
    async with AsyncClient(settings=settings) as client, stage_workers(settings):
        broken = await client.submit({"task": "echo", "instance": {"prompt": "a", "fail_in": "run"}})
        flaky = await client.submit({"task": "echo", "instance": {"prompt": "b", "fail_in": "init", "fail_times": 1}})
        clean = await client.submit({"task": "echo", "instance": {"prompt": "c"}})
        stopped = await client.submit({"task": "echo", "instance": {"prompt": "d", "run_s": 30}})
        await client.cancel(job_id=stopped)
        results = {r.job_id: r for r in await client.collect(4, timeout_s=30)}
        state = await client.status(broken)
    assert results[broken].status == "failed" and results[broken].failure == "infrastructure"
    assert results[broken].infrastructure_failure and results[broken].attempts == settings.max_deliveries
    assert state.failure == "infrastructure"
    # retried from init and then fine: a clean completion, no failure kind
    assert results[flaky].status == "completed" and results[flaky].attempts == 2 and results[flaky].failure is None
    assert results[clean].failure is None and results[clean].reward == 1.0
    assert results[stopped].status == "cancelled" and results[stopped].failure == "cancelled"
    assert not results[stopped].infrastructure_failure
