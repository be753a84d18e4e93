"""A batch posted again after a lost reply (the API restarting, a proxy timing out) runs
each job once: the job ids the client chose make the submission idempotent."""

from __future__ import annotations

import asyncio


async def test_a_retried_http_batch_queues_nothing_twice(api_server, auth, settings, worker_pool):
    import httpx

    worker_pool().start_all(concurrency=16)
    batch = {"jobs": [{"job_id": f"h-{i}", "submitter": "dup", "task": "echo", "instance": {"prompt": "x"}}
                      for i in range(20)]}
    async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
        for _ in range(3):  # the client did not see the first two replies
            assert (await http.post("/v1/jobs/batch", json=batch)).status_code == 200
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
    assert sorted(got) == sorted(f"h-{i}" for i in range(20))
