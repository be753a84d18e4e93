"""Malformed or unknown jobs: rejected at submit, or dead-lettered with a failed result."""

from __future__ import annotations

import json

import pytest

from rollstream.client import AsyncClient
from rollstream.errors import InvalidJob, UnknownTask
from rollstream.messages import DeadLetter
from rollstream.pipeline.codec import unpack
from rollstream.pipeline.keys import Keys


async def test_unknown_task_is_rejected_at_submit(settings):
    async with AsyncClient(settings=settings) as client:
        with pytest.raises(UnknownTask, match="unknown task 'nope'.*echo"):
            await client.submit({"task": "nope", "instance": {}})
        with pytest.raises(InvalidJob, match="prompt"):
            await client.submit({"task": "echo", "instance": {"prompt": 3}})
        with pytest.raises(InvalidJob, match="malformed job"):
            await client.submit({"task": "echo", "instance": {"prompt": "x"}, "bogus_field": 1})
        for field, bad in [("job_id", "a b"), ("job_id", "x{1}"), ("group_id", "g\tg"), ("job_id", "")]:
            with pytest.raises(InvalidJob, match=f"(?s)malformed job.*{field}"):  # ids go into key names
                await client.submit({"task": "echo", "instance": {"prompt": "x"}, field: bad})
        assert await client.r.xlen(Keys(settings.namespace).init_stream) == 0


async def test_job_over_size_limit_is_rejected(settings):
    small = settings.model_copy(update={"max_job_bytes": 1000})
    async with AsyncClient(settings=small) as client:
        with pytest.raises(InvalidJob, match="over the limit"):
            await client.submit({"task": "echo", "instance": {"prompt": "x" * 5000}})


async def test_malformed_messages_in_the_stream_end_as_dead_letters_and_failed_results(settings, stage_workers):
    keys = Keys(settings.namespace)
    async with AsyncClient(settings=settings, submitter="alice") as client:
        r = client.r
        await client.submit({"task": "echo", "instance": {"prompt": "ok"}})  # creates the results group
        await r.xadd(keys.init_stream, {"data": b"\xc1 not msgpack"})
        await r.xadd(keys.init_stream, {"json": "{broken"})
        await r.xadd(keys.init_stream, {"json": json.dumps({"task": "nope", "job_id": "j-unknown",
                                                            "submitter": "alice", "instance": {}})})
        await r.xadd(keys.init_stream, {"json": json.dumps({"task": 5, "job_id": "j-bad", "submitter": "alice"})})
        await r.xadd(keys.init_stream, {"json": json.dumps({"task": "echo", "job_id": "j-good",
                                                            "submitter": "alice", "instance": {"prompt": "hi"}})})
        async with stage_workers(settings):
            results = {res.job_id: res for res in await client.collect(4, timeout_s=20)}
        dead = [unpack(DeadLetter, f[b"data"]) for _id, f in await r.xrange(keys.dead)]
    assert results["j-good"].status == "completed" and results["j-good"].reward == 1.0
    assert results["j-unknown"].status == "failed" and "unknown task 'nope'" in results["j-unknown"].error
    assert results["j-bad"].status == "failed" and "malformed job message" in results["j-bad"].error
    assert len(dead) == 4
    errors = " ".join(d.error for d in dead)
    assert "not msgpack" in errors and "not valid JSON" in errors
    assert await r.xlen(keys.init_stream) == 0  # nothing stuck
