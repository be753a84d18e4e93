"""The job-state and worker hashes are written and read through one typed record each, and keep
the wire of the version before them: a rolling upgrade reads hashes the old workers wrote, and
old readers read what the new ones write. The reference is the old code's dicts, as redis-py
wrote them with HSET, on the session's real redis-server."""

from __future__ import annotations

import time
import typing

import pytest

from rollstream.messages import Job, Result
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.handoff import Handoff, Source
from rollstream.pipeline.jobstate import JobState, JobStateFields, RunningMark, RunningMarks, read_state
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.submission import enqueue
from rollstream.pipeline.workerstate import WorkerRecord


@pytest.fixture
async def r(redis_url):
    client = async_redis(redis_url)
    yield client
    await client.aclose()


async def _hash_as_written(r, key, old: dict) -> dict[bytes, bytes]:
    """``old`` as the previous version wrote it (redis-py's HSET of the dict), read back."""
    await r.hset(key, mapping=old)
    return await r.hgetall(key)


def test_the_write_record_names_the_fields_the_read_record_has():
    written = set(typing.get_type_hints(JobStateFields))
    read = set(JobState.model_fields) - {"timings", "ttl_s"}
    assert written == read


async def test_a_state_hash_an_old_worker_wrote_parses_with_its_stage_and_status(r, namespace):
    keys = Keys(namespace)
    now = time.time()
    old = {"job_id": "j1", "group_id": "", "submitter": "me", "task": "echo", "stage": "run", "status": "running",
           "attempts": 1, "submitted_at": now - 3, "priority": 50, "node": "n1", "sandbox": "sb1",
           "worker": "w-run-1", "init_started_at": now - 2, "run_started_at": now - 1, "msg_id": "s 1-0"}
    await r.hset(keys.job("j1"), mapping=old)
    state = await read_state(r, keys, "j1")
    assert state is not None
    assert (state.stage, state.status, state.attempts, state.node, state.sandbox) == ("run", "running", 1, "n1", "sb1")
    assert state.submitted_at == pytest.approx(now - 3, abs=1e-3)
    assert state.timings == {"init_started_at": pytest.approx(now - 2, abs=1e-3),
                             "run_started_at": pytest.approx(now - 1, abs=1e-3)}
    done = {"stage": "done", "status": "failed", "finished_at": now, "error": "boom", "attempts": 2,
            "failure": "infrastructure"}
    await r.hset(keys.job("j1"), mapping=done)
    state = await read_state(r, keys, "j1")
    assert (state.stage, state.status, state.failure, state.error) == ("done", "failed", "infrastructure", "boom")


async def test_a_submitted_job_has_the_state_hash_the_old_submission_wrote(r, namespace):
    keys = Keys(namespace)
    job = Job(task="echo", instance={"prompt": "p"}, submitter="me")
    await enqueue(r, keys, [job], max_job_bytes=1 << 20)
    old = {"job_id": job.job_id, "group_id": job.group_id or "", "submitter": job.submitter, "task": job.task,
           "stage": "init", "status": "queued", "attempts": 0, "submitted_at": job.submitted_at,
           "priority": job.priority}
    written = await r.hgetall(keys.job(job.job_id))
    reference = await _hash_as_written(r, f"{namespace}:reference", old)
    assert {k: v for k, v in written.items() if k != b"msg_id"} == reference


async def test_a_finish_and_a_running_mark_write_the_fields_the_old_dicts_wrote(r, namespace):
    keys = Keys(namespace)
    stream, group, consumer = f"{namespace}:s", "eval", "w-eval-1"
    await r.xgroup_create(stream, group, id="0", mkstream=True)
    msg_id = (await r.xadd(stream, {"data": b"x"})).decode()
    await r.xreadgroup(group, consumer, {stream: ">"}, count=1)

    marks = RunningMarks(r, keys)
    started = time.time()
    fields = JobStateFields(stage="eval", status="running", worker=consumer, node="n1")
    await marks.mark([RunningMark("j2", "", fields, ("eval", started))])
    await marks.aclose()
    old_mark = {"stage": "eval", "status": "running", "worker": consumer, "node": "n1", "eval_started_at": started}
    assert await r.hgetall(keys.job("j2")) == await _hash_as_written(r, f"{namespace}:ref1", old_mark)

    handoff = Handoff(r, keys, state_ttl_s=60, results_maxlen=100, dead_maxlen=100)
    result = Result(job_id="j2", submitter="me", task="echo", status="completed", reward=1.0, attempts=1)
    src = Source(stream, group, msg_id, consumer, started_at=started)
    assert await handoff.finish(src, result)
    await handoff.aclose()
    old_finish = {"stage": "done", "status": "completed", "finished_at": result.finished_at, "error": "",
                  "attempts": 1, "reward": 1.0, "worker": consumer, "eval_started_at": started}
    reference = await _hash_as_written(r, f"{namespace}:ref1", old_finish)
    written = await r.hgetall(keys.job("j2"))
    assert {k: v for k, v in written.items() if k != b"msg_id"} == reference
    state = await read_state(r, keys, "j2")
    assert (state.stage, state.status, state.reward) == ("done", "completed", 1.0)


async def test_a_worker_hash_keeps_its_wire_both_ways(r, namespace):
    keys = Keys(namespace)
    now = time.time()
    old = {"stage": "run", "node": "n1", "pid": 4242, "concurrency": 64, "inflight": 3, "processed": 17,
           "heartbeat_at": now, "draining": 1, "event_loop": "uvloop"}
    raw = await _hash_as_written(r, keys.worker("old"), old)
    assert WorkerRecord.parse(raw) == WorkerRecord(stage="run", node="n1", pid=4242, concurrency=64, inflight=3,
                                                   processed=17, heartbeat_at=now, draining=True, event_loop="uvloop")
    new = WorkerRecord.parse(raw)
    await r.hset(keys.worker("new"), mapping=new.hash_fields())
    assert await r.hgetall(keys.worker("new")) == raw
    assert WorkerRecord.parse({}) is None  # an expired worker's hash
