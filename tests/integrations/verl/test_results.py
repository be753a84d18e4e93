"""The verl adapter's per-job result waiting on a real Redis: one shared router per event
loop, results handed to the coroutine that waits for that job, timeouts cancel the job."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from rollstream.integrations.verl import VerlLoopConfig
from rollstream.integrations.verl_results import RolloutWaitTimeout, close_routers, default_submitter, shared_router
from rollstream.messages import Job, Result, valid_id
from rollstream.pipeline import cancel as cancel_flags
from rollstream.pipeline.codec import pack
from rollstream.pipeline.keys import Keys


async def _deliver(router, job_id: str, reward: float) -> None:
    """Put a result on the router's stream the way the eval stage does."""
    result = Result(job_id=job_id, submitter=router.submitter, status="completed", reward=reward)
    await router.client.r.xadd(router.client.keys.results(router.submitter), {"data": pack(result)})


def test_submitter_names_are_valid_ids_whatever_the_prefix_and_host(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "x" * 200 + ".cluster.example")
    assert valid_id(default_submitter("p" * 64))
    for bad in ("-rf", ".hidden", "a/b", "p" * 65):
        with pytest.raises(ValidationError):
            VerlLoopConfig(submitter_prefix=bad)


async def test_each_waiter_gets_its_own_result_whatever_the_order(settings):
    router = await shared_router(settings)
    assert await shared_router(settings) is router  # every sample of this loop shares it
    jobs = [Job(task="echo", instance={"prompt": str(i)}) for i in range(3)]
    try:
        waits = [asyncio.create_task(router.run_job(job, timeout_s=30)) for job in jobs]
        await asyncio.sleep(0.2)  # all three queued
        for i in (2, 0, 1):
            await _deliver(router, jobs[i].job_id, float(i))
        results = await asyncio.gather(*waits)
    finally:
        await close_routers()
    assert [r.job_id for r in results] == [j.job_id for j in jobs]
    assert [r.reward for r in results] == [0.0, 1.0, 2.0]


async def test_wait_timeout_cancels_the_job_and_says_what_to_check(settings):
    router = await shared_router(settings)
    job = Job(task="echo", instance={"prompt": "never"})
    try:
        with pytest.raises(RolloutWaitTimeout, match="rollstream status"):
            await router.run_job(job, timeout_s=0.3)
        queued = job.model_copy(update={"submitter": router.submitter})
        flags = await router.client.r.mget(cancel_flags.flag_keys(Keys(settings.namespace), queued))
    finally:
        await close_routers()
    assert cancel_flags.is_cancelled(job, flags)
