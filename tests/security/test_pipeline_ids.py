"""Hole 1, the grammar side: job, group and submitter ids follow one grammar
(messages.ID_PATTERN) at every door — the Python client (async and sync), and a message added
to the init stream by hand, which ends as a dead letter and a failed result for its submitter,
never as a path the eval stage deletes or a worker that dies. (The HTTP door: test_api_ids.py.)"""

from __future__ import annotations

import json

import pytest

from rollstream.client import AsyncClient, Client
from rollstream.errors import InvalidJob
from rollstream.messages import DeadLetter, Job
from rollstream.pipeline.codec import unpack
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.priorities import queued_count

from .pipeline_workers import alive, stage_tasks

# What an attacker tries: absolute paths, '..', key separators, option-like, non-ASCII, NUL,
# control characters, a trailing newline, and an id too long to be a key or a file name.
BAD_IDS = ["/tmp/victim", "../../../../tmp/victim2", "a/b", "..", ".hidden", "a:b", "-rf", "é", "a\x00b",
           "a\tb", "ok\n", "x" * 129, "", "{tag}"]
GOOD_IDS = ["a", "job-1", "G_7.v2", "0" * 128, "a..b"]


async def test_every_bad_id_is_refused_by_the_async_client(settings):
    async with AsyncClient(settings=settings, submitter="alice") as client:
        for bad in BAD_IDS:
            for field in ("job_id", "group_id", "submitter"):
                with pytest.raises(InvalidJob, match=field):
                    await client.submit({"task": "echo", "instance": {"prompt": "x"}, field: bad})
            with pytest.raises(InvalidJob, match="group_id"):
                await client.submit_group({"task": "echo", "instance": {"prompt": "x"}}, 2, group_id=bad)
            # A Job built without validation is checked all the same.
            with pytest.raises(InvalidJob, match="job_id"):
                await client.submit(Job.model_construct(**{**Job(task="echo", instance={"prompt": "x"}).__dict__,
                                                           "job_id": bad}))
            if bad:
                with pytest.raises(ValueError, match="submitter"):
                    AsyncClient(settings=settings, submitter=bad)
                for field in ("job_id", "group_id"):  # cancel flags are keys named by these
                    with pytest.raises(InvalidJob, match=field):
                        await client.cancel(**{field: bad})
        for good in GOOD_IDS:
            await client.submit({"task": "echo", "instance": {"prompt": "x"}, "job_id": good, "group_id": good})
        assert await queued_count(client.r, Keys(settings.namespace)) == len(GOOD_IDS)


def test_every_bad_id_is_refused_by_the_sync_client(settings):
    with Client(settings=settings, submitter="bob") as client:
        for bad in BAD_IDS:
            with pytest.raises(InvalidJob, match="job_id"):
                client.submit({"task": "echo", "instance": {"prompt": "x"}, "job_id": bad})
            with pytest.raises(InvalidJob, match="group_id"):
                client.submit_group({"task": "echo", "instance": {"prompt": "x"}}, 2, group_id=bad)


async def test_raw_xadd_with_a_path_as_job_id_is_dead_lettered_and_deletes_nothing(settings, tmp_path):
    """Eval's teardown of the echo task removes <work>/<job_id>: with an absolute or '..' id
    that was a host folder. Now such a message never reaches a stage."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    work = settings.data_dir / "work"
    work.mkdir(parents=True)
    dotted = "../" * (len(work.parts) - 1) + str(victim).lstrip("/")
    keys = Keys(settings.namespace)
    bad_ids = [str(victim), dotted, "a:b", "-rf", "é", "a\x00b"]
    async with AsyncClient(settings=settings, submitter="alice") as client:
        await client._ensure_results_group()
        for i, bad in enumerate(bad_ids):
            entry = {"task": "echo", "instance": {"prompt": "x"}, "job_id": bad, "submitter": "alice"}
            await client.r.xadd(keys.init_stream, {"json": json.dumps(entry)})
            # The same job for a submitter outside the grammar: a dead letter only (no stream named by it).
            await client.r.xadd(keys.init_stream, {"json": json.dumps({**entry, "job_id": f"j{i}",
                                                                       "submitter": "../x"})})
        await client.r.xadd(keys.init_stream, {"json": json.dumps(
            {"task": "echo", "instance": {"prompt": "hi"}, "job_id": "good", "submitter": "alice"})})
        async with stage_tasks(settings) as tasks:
            results = await client.collect(len(bad_ids) + 1, timeout_s=30)
            assert alive(tasks) == []
        dead = [unpack(DeadLetter, f[b"data"]) for _id, f in await client.r.xrange(keys.dead)]
        stray = [k for k in await client.r.keys(f"{settings.namespace}:*") if b"victim" in k or b"../" in k]
    by_id = {r.job_id: r for r in results}
    assert by_id["good"].status == "completed"
    for bad in bad_ids:
        assert by_id[bad].status == "failed" and by_id[bad].failure == "job", by_id[bad]
        assert "job_id" in by_id[bad].error
    assert len(dead) == 2 * len(bad_ids)
    assert (victim / "precious").read_text() == "keep me"
    assert stray == []  # no key was named after a bad id
