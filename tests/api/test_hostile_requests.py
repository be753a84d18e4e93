"""Hostile requests to the HTTP API while jobs run: bytes that are not UTF-8, NUL bytes and
lone surrogates in prompts, broken JSON, deeply nested instances, negative timeouts. Each gets
a clear 4xx or runs as data; the API and the workers keep serving the good jobs."""

from __future__ import annotations

import httpx


async def test_hostile_bodies_get_clear_errors_and_good_jobs_still_complete(api_server, auth, worker_pool):
    worker_pool().start_all(concurrency=16)
    async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
        good = [{"job_id": f"good-{i}", "submitter": "h", "task": "echo", "instance": {"prompt": f"p{i}"}}
                for i in range(40)]
        assert (await http.post("/v1/jobs/batch", json={"jobs": good[:20]})).status_code == 200

        invalid_utf8 = await http.post("/v1/jobs", content=b'{"task": "echo", "instance": {"prompt": "\xff\xfe"}}',
                                       headers={"Content-Type": "application/json"})
        assert invalid_utf8.status_code in (400, 422), invalid_utf8.text
        broken = await http.post("/v1/jobs", content=b'{"task": "echo", "inst',
                                 headers={"Content-Type": "application/json"})
        assert broken.status_code == 422 and "json" in broken.text.lower()
        nested = '{"task": "echo", "instance": {"prompt": "x", "deep": ' + "[" * 5000 + "]" * 5000 + "}}"
        deep = await http.post("/v1/jobs", content=nested.encode(), headers={"Content-Type": "application/json"})
        assert deep.status_code in (400, 413, 422), deep.text[:300]  # the parser's recursion limit
        negative = await http.post("/v1/jobs", json={"task": "echo", "instance": {"prompt": "x"}, "timeout_s": -5})
        assert negative.status_code == 422 and "timeout_s" in negative.text
        not_an_object = await http.post("/v1/jobs/batch", json=["echo"])
        assert not_an_object.status_code == 422

        # A lone surrogate is a valid JSON escape but not Unicode text; a NUL byte is data.
        odd = await http.post("/v1/jobs", headers={"Content-Type": "application/json"},
                              content=b'{"job_id": "odd", "submitter": "h", "task": "echo", '
                                      b'"instance": {"prompt": "a\\u0000b\\ud800c"}}')
        assert odd.status_code == 422 and "not valid Unicode" in odd.json()["detail"], odd.text
        nul = await http.post("/v1/jobs", json={"job_id": "nul", "submitter": "h", "task": "echo",
                                                "instance": {"prompt": "a\u0000b"}})
        assert nul.status_code == 200, nul.text
        expected = {f"good-{i}" for i in range(40)} | {"nul"}
        assert (await http.post("/v1/jobs/batch", json={"jobs": good[20:]})).status_code == 200

        got, cursor = {}, None
        for _ in range(60):
            params = {"wait_s": 1.0, "max": 100, **({"ack": cursor} if cursor else {})}
            page = (await http.get("/v1/results/h", params=params)).json()
            got.update({r["job_id"]: r for r in page["results"]})
            cursor = page["cursor"] or cursor
            if set(got) >= expected:
                break
        status = (await http.get("/v1/status")).json()
    assert set(got) == expected
    assert all(got[j]["status"] == "completed" for j in expected)
    assert got["nul"]["trajectory"]["response_text"] == "a\u0000b"
    assert status["dead_letters"] == 0


async def test_results_cursor_that_redis_cannot_parse_is_a_422(api_server, auth):
    """The fuzzer's find: an ack cursor of digits beyond 64 bits (or non-ASCII digits) got
    past the pattern and made Redis answer 'Invalid stream ID', a 500."""
    async with httpx.AsyncClient(base_url=api_server, headers=auth, timeout=30) as http:
        for cursor in ("18446744073709551616-0", "0-99999999999999999999", "\u0663-0", "1" * 21 + "-0"):
            page = await http.get("/v1/results/h", params={"ack": cursor, "wait_s": 0})
            assert page.status_code == 422, (cursor, page.status_code, page.text)
        largest = await http.get("/v1/results/h", params={"ack": "18446744073709551615-18446744073709551615",
                                                          "wait_s": 0})
        assert largest.status_code == 200, largest.text
