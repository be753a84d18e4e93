"""A submission retried after a lost reply (Redis or the API restarting, a proxy timing out) runs
each job once, through both doors: the job ids the client chose make submitting idempotent.
One worker pool serves both doors' jobs (each door's results come on its own submitter's stream)."""

from __future__ import annotations

import asyncio

from rollstream.client import AsyncClient


async def test_retried_submissions_through_either_door_queue_nothing_twice(api_server, auth, settings, worker_pool):
    import httpx

    worker_pool().start_all(concurrency=16)
    # The Python client: a batch, then part of it again with one new job.
    jobs = [{"job_id": f"retry-{i}", "task": "echo", "instance": {"prompt": f"p{i}"}} for i in range(50)]
    async with AsyncClient(settings=settings) as client:
        await client.submit_many(jobs)
        await client.submit_many(jobs[:30] + [{"job_id": "retry-new", "task": "echo", "instance": {"prompt": "n"}}])
        # HTTP: the same batch posted three times (the client did not see the first two replies).
        batch = {"jobs": [{"job_id": f"h-{i}", "submitter": "dup", "task": "echo", "instance": {"prompt": "x"}}
                          for i in range(20)]}
        async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
            for _ in range(3):
                assert (await http.post("/v1/jobs/batch", json=batch)).status_code == 200
            results = await client.collect(51, timeout_s=60)
            got: list[str] = []
            cursor = None
            for _ in range(40):
                params = {"wait_s": 1.0, **({"ack": cursor} if cursor else {})}
                page = (await http.get("/v1/results/dup", params=params)).json()
                got += [r["job_id"] for r in page["results"]]
                cursor = page["cursor"] or cursor
                if len(got) >= 20:
                    await asyncio.sleep(1.0)  # give any double the time to show up
                    page = (await http.get("/v1/results/dup", params={"wait_s": 0.5, "ack": cursor})).json()
                    got += [r["job_id"] for r in page["results"]]
                    break
        extra = [r async for r in client.results(timeout_s=1.5)]
        assert await client.r.xlen(client.keys.init_stream) <= 51 + 20
    ids = [r.job_id for r in results + extra]
    assert sorted(ids) == sorted([f"retry-{i}" for i in range(50)] + ["retry-new"])
    assert sorted(got) == sorted(f"h-{i}" for i in range(20))
