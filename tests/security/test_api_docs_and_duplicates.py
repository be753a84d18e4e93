"""Hole 8 at the HTTP door: the spec and the docs need the token (unless api_public_docs
opens them) and the spec declares bearer auth on every guarded route; re-submitting a known
job id says so (``duplicates`` with its status) instead of silently queuing nothing; workers
that stopped heart-beating leave /v1/status after worker_ttl_s."""

from __future__ import annotations

import time

import httpx

from rollstream.api.app import asgi
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys

from .api_fixtures import TOKEN, api  # noqa: F401 (fixture)
from .pipeline_workers import stage_tasks


async def test_spec_and_docs_need_the_token_and_the_spec_declares_bearer_auth(api):
    async with httpx.AsyncClient(base_url=api.url, timeout=10) as http:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert (await http.get(path)).status_code in (401, 404), path
        assert (await http.get("/openapi.json", headers={"Authorization": "Bearer wrong"})).status_code == 401
        spec = (await http.get("/openapi.json", headers=api.auth)).json()
        assert (await http.get("/docs", headers=api.auth)).status_code == 200
    bearer = spec["components"]["securitySchemes"]["bearer"]
    assert bearer == {"type": "http", "scheme": "bearer", "description": bearer["description"]}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if path != "/health":
                assert op.get("security") == [{"bearer": []}], (method, path)


def test_api_public_docs_opens_the_spec_and_docs_only(settings, asgi_server):
    app = asgi(settings.model_copy(update={"api_public_docs": True}), token=TOKEN)
    with asgi_server(app) as base:
        assert httpx.get(base + "/openapi.json").status_code == 200
        assert httpx.get(base + "/docs").status_code == 200
        assert httpx.get(base + "/v1/status").status_code == 401


async def test_resubmitting_a_finished_job_id_says_duplicate_over_http(api):
    job = {"task": "echo", "instance": {"prompt": "x"}, "job_id": "once", "submitter": "dup"}
    async with httpx.AsyncClient(base_url=api.url, headers=api.auth, timeout=20) as http:
        first = (await http.post("/v1/jobs", json=job)).json()
        assert first["job_ids"] == ["once"] and first["duplicates"] == {}
        async with stage_tasks(api.settings):
            page = (await http.get("/v1/results/dup", params={"wait_s": 2})).json()
        assert [r["job_id"] for r in page["results"]] == ["once"]
        again = (await http.post("/v1/jobs", json=job)).json()
        assert again["job_ids"] == ["once"] and again["duplicates"] == {"once": "completed"}
        batch = (await http.post("/v1/jobs/batch", json={"jobs": [job, {**job, "job_id": "fresh"}]})).json()
        assert batch["duplicates"] == {"once": "completed"}


async def test_dead_workers_leave_status_after_worker_ttl_s(api):
    keys = Keys(api.settings.namespace)
    r = async_redis(api.settings.redis_url)
    try:
        now = time.time()
        await r.zadd(keys.workers, {"n1:run:1:gone": now - api.settings.worker_ttl_s - 5, "n1:run:2:here": now})
        async with httpx.AsyncClient(base_url=api.url, headers=api.auth, timeout=10) as http:
            status = (await http.get("/v1/status")).json()
        assert [w["worker"] for w in status["workers"]] == ["n1:run:2:here"]
        assert status["redis_problem"] is None
        assert await r.zscore(keys.workers, "n1:run:1:gone") is None
    finally:
        await r.aclose()
