"""The HTTP API: auth, size limits, validation, and jobs submitted and collected over HTTP."""

from __future__ import annotations

import asyncio

import httpx


async def test_requests_without_the_token_get_401(api_server):
    async with httpx.AsyncClient(base_url=api_server) as http:
        for method, path in (("GET", "/v1/status"), ("POST", "/v1/jobs"), ("GET", "/metrics"),
                             ("GET", "/v1/results/x"), ("GET", "/v1/backends")):
            assert (await http.request(method, path)).status_code == 401
            bad = await http.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert bad.status_code == 401 and "bearer token" in bad.json()["detail"]
        assert (await http.get("/health")).status_code == 200


async def test_a_backend_url_without_a_host_is_refused_and_one_with_a_slash_is_found(api_server, auth):
    async with httpx.AsyncClient(base_url=api_server, headers=auth) as http:
        assert (await http.post("/v1/backends", json={"url": "http:///"})).status_code == 422
        assert (await http.delete("/v1/backends", params={"url": "http:///"})).status_code == 422
        added = await http.post("/v1/backends", json={"url": "http://gpu7:8000/"})
        assert added.status_code == 200 and added.json()["url"] == "http://gpu7:8000"
        assert (await http.delete("/v1/backends", params={"url": "http://gpu7:8000"})).status_code == 200


async def test_an_oversized_body_gets_413(api_server, auth):
    async with httpx.AsyncClient(base_url=api_server, headers=auth) as http:
        big = {"task": "echo", "instance": {"prompt": "x" * 100_000}}
        assert (await http.post("/v1/jobs", json=big)).status_code == 413

        async def chunks():  # no Content-Length: the limit still holds
            for _ in range(100):
                yield b"x" * 1024

        assert (await http.post("/v1/jobs", content=chunks())).status_code == 413


async def test_validation_errors_say_what_is_wrong(api_server, auth):
    async with httpx.AsyncClient(base_url=api_server, headers=auth) as http:
        unknown = await http.post("/v1/jobs", json={"task": "nope", "instance": {}})
        assert unknown.status_code == 422 and "unknown task 'nope'" in unknown.json()["detail"]
        bad = await http.post("/v1/jobs", json={"task": "echo", "instance": {"prompt": 1}})
        assert bad.status_code == 422 and "prompt" in bad.json()["detail"]
        missing = await http.post("/v1/jobs", json={"instance": {}})
        assert missing.status_code == 422 and "task" in str(missing.json()["detail"])


async def test_500_jobs_over_http_yield_500_results(api_server, auth, worker_pool):
    worker_pool().start_all(concurrency=64)
    async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
        jobs = [{"task": "echo", "submitter": "web", "instance": {"prompt": f"p{i}"}} for i in range(500)]
        submitted = []
        for start in range(0, 500, 100):
            resp = await http.post("/v1/jobs/batch", json={"jobs": jobs[start:start + 100]})
            assert resp.status_code == 200, resp.text
            submitted += resp.json()["job_ids"]
        group = await http.post("/v1/groups", json={"job": {"task": "echo", "submitter": "web",
                                                            "instance": {"prompt": "g"}}, "n": 4})
        submitted += group.json()["job_ids"]
        got, cursor = [], None
        for _ in range(200):
            params = {"wait_s": 2, "max": 200, **({"ack": cursor} if cursor else {})}
            page = (await http.get("/v1/results/web", params=params)).json()
            got += page["results"]
            cursor = page["cursor"] or cursor
            if len(got) >= len(submitted):
                break
        await http.get("/v1/results/web", params={"ack": cursor, "wait_s": 0})
        again = (await http.get("/v1/results/web", params={"wait_s": 0})).json()
        state = (await http.get(f"/v1/jobs/{submitted[0]}")).json()
        for _ in range(100):  # workers add their latency observations every histograms.FLUSH_S
            metrics = (await http.get("/metrics")).text
            count = next((line for line in metrics.splitlines()
                          if line.startswith('rollstream_stage_duration_seconds_count{stage="run"}')), "count 0")
            if float(count.split()[-1]) >= len(submitted):
                break
            await asyncio.sleep(0.05)
    assert float(count.split()[-1]) == len(submitted)
    assert sorted(r["job_id"] for r in got) == sorted(submitted)
    assert all(r["status"] == "completed" for r in got)
    assert again["results"] == []  # acknowledged results are not delivered twice
    assert state["status"] == "completed"


async def test_unacknowledged_results_are_delivered_again(api_server, auth, worker_pool):
    worker_pool().start_all()
    async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
        await http.post("/v1/jobs", json={"task": "echo", "submitter": "forgetful", "instance": {"prompt": "a"}})
        first = (await http.get("/v1/results/forgetful", params={"wait_s": 20})).json()
        second = (await http.get("/v1/results/forgetful", params={"wait_s": 0})).json()
    assert len(first["results"]) == 1 and second["results"] == first["results"]


async def test_results_stream_cancel_status_and_metrics(api_server, auth, worker_pool):
    worker_pool().start_all()
    async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
        slow = (await http.post("/v1/groups", json={"job": {"task": "echo", "submitter": "s",
                                                            "instance": {"prompt": "a", "run_s": 30}}, "n": 3})).json()
        await http.post("/v1/cancel", json={"group_id": slow["group_id"]})
        lines = []
        async with http.stream("GET", "/v1/results/s/stream", params={"idle_timeout_s": 30},
                               timeout=60) as resp:  # workers may take a while to start on a busy machine
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    break
        status = (await http.get("/v1/status")).json()
        metrics = (await http.get("/metrics")).text
    assert len(lines) == 3 and all('"cancelled"' in line for line in lines)
    assert any(s["stage"] == "init" for s in status["streams"])
    assert "rollstream_stream_length" in metrics and "rollstream_jobs_total" in metrics
    assert 'rollstream_stage_duration_seconds_bucket{stage="init",le="+Inf"}' in metrics


async def test_generation_is_paused_and_resumed_through_the_api_and_the_cli(api_server, auth, settings, cli_env):
    import subprocess
    import sys

    from redis.asyncio import Redis

    from rollstream.llm.balancer import Balancer

    r = Redis.from_url(settings.redis_url)
    balancer = Balancer(r, namespace=settings.namespace)
    try:
        await balancer.register("http://gpu7:8000")
        async with httpx.AsyncClient(base_url=api_server, headers=auth) as http:
            paused = await http.post("/v1/backends/pause", json={"reason": "weight sync by hand"})
            assert paused.status_code == 200 and paused.json()["paused"]
            assert (await balancer.paused())["reason"] == "weight sync by hand"
            waiting = asyncio.create_task(balancer.acquire("job"))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            assert (await http.post("/v1/backends/resume")).json() == {"resumed": True}
            assert (await asyncio.wait_for(waiting, timeout=5)).backend == "http://gpu7:8000"
            await balancer.release(waiting.result())
        cli = [sys.executable, "-m", "rollstream", "backends"]
        done = await asyncio.to_thread(subprocess.run, [*cli, "pause", "--reason", "from the CLI"], env=cli_env,
                                       capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "generation paused" in done.stdout + done.stderr, done.stderr
        assert (await balancer.paused())["reason"] == "from the CLI"
        done = await asyncio.to_thread(subprocess.run, [*cli, "resume"], env=cli_env, capture_output=True,
                                       text=True, timeout=120)
        assert done.returncode == 0 and "generation resumed" in done.stdout + done.stderr
        assert await balancer.paused() is None
    finally:
        await r.aclose()
