"""A job's timeout_s counts its time at work in stages, not in queues: under a backlog (a
trainer that over-provisions) a queued job is not expired before it runs. queue_timeout_s
is the separate, optional bound on queue time. Real worker processes on a real Redis."""

from __future__ import annotations

from rollstream.client import AsyncClient


async def test_a_job_queued_behind_a_backlog_longer_than_its_timeout_still_completes(settings, stage_workers):
    # One run slot, held 3 s by the job ahead: the second job waits ~3 s in the run queue,
    # three times its timeout_s, and then needs only a moment of work.
    async with AsyncClient(settings=settings) as client, stage_workers(settings, concurrency=1):
        ahead = await client.submit({"task": "echo", "instance": {"prompt": "a", "run_s": 3}})
        behind = await client.submit({"task": "echo", "instance": {"prompt": "b"}, "timeout_s": 1})
        expires = await client.submit({"task": "echo", "instance": {"prompt": "c"}, "queue_timeout_s": 0.5})
        results = {r.job_id: r for r in await client.collect(3, timeout_s=60)}
    assert results[ahead].status == "completed"
    assert results[behind].status == "completed" and results[behind].reward == 1.0
    assert results[behind].timings_s["run_wait_s"] > 1  # it did wait longer than its timeout_s
    # queue_timeout_s bounds the queues: that job fails unrun, with the reason, as the service's failure
    failed = results[expires]
    assert failed.status == "failed" and failed.failure == "infrastructure"
    assert "queue_timeout_s=0.5" in failed.error and "never ran" in failed.error
    assert "run_s" not in failed.timings_s


async def test_time_at_work_past_timeout_s_still_times_the_job_out(settings, stage_workers):
    async with AsyncClient(settings=settings) as client, stage_workers(settings):
        await client.submit({"task": "echo", "instance": {"prompt": "a", "init_s": 0.6, "run_s": 30}, "timeout_s": 1})
        [result] = await client.collect(1, timeout_s=30)
    # 0.6 s of init leaves run 0.4 s of the job's 1 s: it is interrupted in run
    assert result.status == "failed" and "timed out in run" in result.error
    assert result.failure == "infrastructure"
