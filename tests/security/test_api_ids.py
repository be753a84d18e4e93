"""Hole 1 at the HTTP door: job, group and submitter ids outside the one id grammar are
refused with a 422 on every route that takes one (submit, groups, job state, cancel, results),
and nothing is queued."""

from __future__ import annotations

from urllib.parse import quote

import httpx

from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys

from .api_fixtures import api  # noqa: F401 (fixture)
from .test_pipeline_ids import BAD_IDS

JOB = {"task": "echo", "instance": {"prompt": "x"}}


async def test_every_bad_id_is_refused_on_every_http_route(api, settings):
    async with httpx.AsyncClient(base_url=api.url, headers=api.auth, timeout=10) as http:
        for bad in BAD_IDS:
            for field in ("job_id", "group_id", "submitter"):
                resp = await http.post("/v1/jobs", json={**JOB, field: bad})
                assert resp.status_code == 422 and field in resp.text, (field, bad, resp.text)
                resp = await http.post("/v1/jobs/batch", json={"jobs": [JOB, {**JOB, field: bad}]})
                assert resp.status_code == 422, (field, bad, resp.text)
            resp = await http.post("/v1/groups", json={"job": {**JOB, "group_id": bad}, "n": 2})
            assert resp.status_code == 422, (bad, resp.text)
            resp = await http.post("/v1/cancel", json={"group_id": bad})
            assert resp.status_code == 422, (bad, resp.text)
            resp = await http.post("/v1/cancel", json={"job_id": bad})
            assert resp.status_code == 422, (bad, resp.text)
            resp = await http.post("/v1/cancel", json={"submitter": bad})
            assert resp.status_code == 422, (bad, resp.text)
            if bad and "/" not in bad and bad != "..":  # with those, routing answers (404) before any id check
                segment = quote(bad, safe="")
                assert (await http.get(f"/v1/results/{segment}")).status_code == 422, bad
                assert (await http.get(f"/v1/jobs/{segment}")).status_code == 422, bad
                assert (await http.delete(f"/v1/jobs/{segment}")).status_code == 422, bad
        resp = await http.post("/v1/jobs", json={**JOB, "job_id": "fine-1", "group_id": "g.2", "submitter": "s_3"})
        assert resp.status_code == 200, resp.text
    r = async_redis(settings.redis_url)
    try:
        assert await r.xlen(Keys(settings.namespace).init_stream) == 1
    finally:
        await r.aclose()
