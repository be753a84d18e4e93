"""Hole 6 at the HTTP door: deep nesting, integers outside 64 bits and NaN/Infinity in a job
get a 422 that says where (never a 500); and a results stream with poison entries still
delivers every good result, by page and by NDJSON stream, the poison going to the dead letters."""

from __future__ import annotations

import json

import httpx

from rollstream.messages import MAX_NESTING
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.groups import ensure_group
from rollstream.pipeline.keys import RESULTS_GROUP, Keys

from .api_fixtures import api  # noqa: F401 (fixture)
from .test_pipeline_payload_bounds import poison_results

HEAD = '{"task": "echo", "instance": {"prompt": "x"}, '
BODIES = {  # raw JSON text, as any HTTP client may send it; what the 422 must say
    HEAD + '"metadata": {"a": %s}}' % ("[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)): "metadata.a[0]",
    HEAD + '"metadata": {"a": %s}}' % ("[" * 300 + "]" * 300): "nests deeper",
    HEAD + f'"metadata": {{"n": {2**64}}}}}': "metadata.n: 18446744073709551616",
    HEAD + f'"metadata": {{"n": {2**63}}}}}': "64-bit",
    HEAD + '"metadata": {"n": 1%s}}' % ("0" * 4000): "64-bit",
    HEAD + '"metadata": {"x": [NaN]}}': "metadata.x[0]: nan",
    HEAD + '"agent": {"chat_template_kwargs": {"x": -Infinity}}}': "agent.chat_template_kwargs.x: -inf",
    HEAD + '"timeout_s": Infinity}': "timeout_s",
    HEAD + '"sampling": {"temperature": 1, "my_knob": NaN}}': "sampling.my_knob",
}


async def test_payloads_over_the_bounds_get_a_422_that_says_where(api):
    async with httpx.AsyncClient(base_url=api.url, headers={**api.auth, "content-type": "application/json"},
                                 timeout=10) as http:
        for body, says in BODIES.items():
            for path, wrap in (("/v1/jobs", "{}"), ("/v1/jobs/batch", '{{"jobs": [{}]}}'),
                               ("/v1/groups", '{{"job": {}, "n": 2}}')):
                resp = await http.post(path, content=wrap.format(body))
                assert resp.status_code == 422 and says in resp.text, (path, says, resp.status_code, resp.text[:300])
        # JSON the parser itself refuses (too deep, too many digits): a 4xx, not a 500.
        for value in ("[" * 20_000 + "]" * 20_000, "1" + "0" * 5000):
            resp = await http.post("/v1/jobs", content=HEAD + '"metadata": ' + value + "}")
            assert 400 <= resp.status_code < 500, resp.text[:300]


async def test_poison_results_do_not_block_the_page_or_the_stream(api, settings):
    keys = Keys(settings.namespace)
    r = async_redis(settings.redis_url)
    try:
        for submitter in ("paged", "streamed"):
            await ensure_group(r, keys.results(submitter), RESULTS_GROUP)
        paged = await poison_results(r, keys, "paged", for_json=True)
        streamed = await poison_results(r, keys, "streamed", for_json=True)
        async with httpx.AsyncClient(base_url=api.url, headers=api.auth, timeout=20) as http:
            got, cursor = [], None
            for _ in range(10):
                resp = await http.get("/v1/results/paged", params={"max": 2, "wait_s": 0.2,
                                                                   **({"ack": cursor} if cursor else {})})
                assert resp.status_code == 200, resp.text[:300]
                page = resp.json()
                got += [item["job_id"] for item in page["results"]]
                cursor = page["cursor"] or cursor
                if page["cursor"] is None:
                    break
            assert got == paged
            resp = await http.get("/v1/results/streamed/stream", params={"idle_timeout_s": 1.0})
            assert resp.status_code == 200
            lines = [json.loads(line)["job_id"] for line in resp.text.splitlines() if line]
            assert lines == streamed
        assert await r.xlen(keys.dead) == 2 * 5
    finally:
        await r.aclose()
