"""The hand-off script's guarantees on a real Redis: a cancelled job never crosses a stage
boundary, the node's sandbox set moves with the job, a late "running" mark never rewinds a
job's state, and the lean connection keeps replies in order through cancels and restarts."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from rollstream.errors import JobCancelled
from rollstream.messages import DeadLetter, Envelope, Job, Result
from rollstream.pipeline import cancel
from rollstream.pipeline.codec import decode_envelope, pack
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.handoff import DeadLetterJob, Finish, Forward, Handoff, Requeue, Source
from rollstream.pipeline.jobstate import JobStateFields, RunningMark, RunningMarks, entry_token, read_state
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.wire import FastRedis
from rollstream.sandbox_spec import SandboxHandle


@pytest.fixture
async def broker(settings):
    r = async_redis(settings.redis_url)
    keys = Keys(settings.namespace)
    handoff = Handoff(r, keys, state_ttl_s=60, results_maxlen=1000, dead_maxlen=1000)
    yield r, keys, handoff
    await handoff.aclose()
    await r.aclose()


async def _take(r, keys: Keys, stage: str, env: Envelope, consumer: str = "w1") -> Source:
    """Queue ``env`` on ``stage``'s stream and read it as ``consumer``, as a worker would."""
    stream = keys.stage_stream(stage, "n1")
    await r.xgroup_create(stream, stage, id="0", mkstream=True)
    await r.xadd(stream, {"data": pack(env)})
    [(_s, [(msg_id, _f)])] = await r.xreadgroup(stage, consumer, {stream: ">"}, count=1)
    return Source(stream, stage, msg_id.decode(), consumer, started_at=123.5)


def _env(**kw) -> Envelope:
    return Envelope(job=Job(task="echo", instance={"prompt": "x"}, submitter="s1", **kw), node="n1")


async def test_a_job_cancelled_while_its_stage_worked_is_not_forwarded(broker):
    r, keys, handoff = broker
    env = _env(group_id="g1")
    src = await _take(r, keys, "init", env)
    # A flag raised with no notice: the worker's book cannot know; the script must.
    await r.set(keys.cancel_group("g1"), 1)
    with pytest.raises(JobCancelled, match="group g1 cancelled"):
        await handoff.forward(src, env, keys.run_stream("n1"), "run")
    assert await r.xlen(keys.run_stream("n1")) == 0
    pending = await r.xpending(src.stream, "init")
    assert pending["pending"] == 1  # still ours: the worker ends the job as cancelled


async def test_a_submitter_cancel_spares_jobs_submitted_after_it(broker):
    r, keys, handoff = broker
    env = _env()
    await cancel.cancel(r, keys, submitter="s1")  # earlier than the job below
    later = _env()
    src = await _take(r, keys, "init", later)
    assert await handoff.forward(src, later, keys.run_stream("n1"), "run")
    assert env.job.submitted_at < later.job.submitted_at
    book = cancel.CancelBook()
    await book.catch_up(r, keys)
    assert book.reason(env.job) and not book.reason(later.job)


async def test_the_sandbox_count_moves_with_the_job(broker):
    r, keys, handoff = broker
    env = _env()
    env.sandbox = SandboxHandle(id="sb1", backend="bwrap", socket_path="/s/sb1/sock", supervisor_pid=7,
                                workdir="/workspace")
    src = await _take(r, keys, "init", env)
    assert await handoff.forward(src, env, keys.run_stream("n1"), "run")
    assert await r.smembers(keys.node_sandboxes("n1")) == {b"sb1"}
    state = await read_state(r, keys, env.job.job_id)
    assert state.stage == "run" and state.sandbox == "sb1" and state.timings["init_started_at"] == 123.5

    src = await _take(r, keys, "eval", env)
    assert await handoff.record(src, Finish(Result.completed(env, 1.0)), env)
    assert await r.scard(keys.node_sandboxes("n1")) == 0
    assert (await read_state(r, keys, env.job.job_id)).status == "completed"


async def test_a_job_leaving_its_node_by_requeue_or_dead_letter_stops_counting_its_sandbox(broker):
    """The hand-off counts a job's sandbox from the job it moves: on out of init, off as the job
    leaves its node by whichever move (the worker passes no count)."""
    r, keys, handoff = broker
    envs = [_env(), _env()]
    for n, env in enumerate(envs):
        env.sandbox = SandboxHandle(id=f"sb{n}", backend="bwrap", socket_path=f"/s/sb{n}/sock", supervisor_pid=7,
                                    workdir="/workspace")
    first, second = envs
    src = await _take(r, keys, "init", first)
    assert await handoff.record(src, Forward("run"), first, node="n1")
    eval_src = await _take(r, keys, "eval", second)  # forwarded on from run with its sandbox counted
    await r.sadd(keys.node_sandboxes("n1"), "sb1")
    assert await r.smembers(keys.node_sandboxes("n1")) == {b"sb0", b"sb1"}

    src = await _take(r, keys, "run", first)
    assert await handoff.record(src, Requeue(first.restarted(failed_with="run: boom"), "boom"), first)
    assert await r.smembers(keys.node_sandboxes("n1")) == {b"sb1"}
    [(_id, fields)] = await r.xrange(keys.init_stream)
    requeued = decode_envelope(fields)
    assert requeued.sandbox is None and requeued.attempt == 1 and requeued.errors == ["run: boom"]

    letter = DeadLetterJob(DeadLetter.of_job(second, "eval", "gave up"), Result.failed(second, "gave up", "eval"))
    assert await handoff.record(eval_src, letter, second)
    assert await r.scard(keys.node_sandboxes("n1")) == 0
    assert (await read_state(r, keys, second.job.job_id)).stage == "dead"


async def test_a_late_running_mark_never_rewinds_the_state(broker):
    r, keys, handoff = broker
    marks = RunningMarks(r, keys)
    env = _env()
    src = await _take(r, keys, "init", env)
    token = entry_token(src.stream, src.msg_id)
    await marks.mark([RunningMark(env.job.job_id, token, JobStateFields(stage="init", status="running"))])
    assert (await read_state(r, keys, env.job.job_id)).status == "running"
    assert await handoff.forward(src, env, keys.run_stream("n1"), "run")
    # The same mark arriving after the hand-off (it is sent without waiting) is dropped.
    await marks.mark([RunningMark(env.job.job_id, token, JobStateFields(stage="init", status="running"))])
    state = await read_state(r, keys, env.job.job_id)
    assert (state.stage, state.status) == ("run", "queued")
    await marks.aclose()


async def test_a_late_mark_is_dropped_when_the_next_entry_has_the_same_id_in_another_stream(broker):
    """Entry ids are per stream: a hand-off within the millisecond gives the job's run entry
    the id its init entry had (this flaked once in CI when the mark matched by id alone)."""
    r, keys, handoff = broker
    marks = RunningMarks(r, keys)
    env = _env()
    later = int(time.time() * 1000) + 60_000  # ids above the clock: XADD * then counts on from them
    init_stream, run_stream = keys.stage_stream("init", "n1"), keys.run_stream("n1")
    await r.xgroup_create(init_stream, "init", id="0", mkstream=True)
    await r.xadd(init_stream, {"data": pack(env)}, id=f"{later}-1")
    [(_s, [(msg_id, _f)])] = await r.xreadgroup("init", "w1", {init_stream: ">"}, count=1)
    src = Source(init_stream, "init", msg_id.decode(), "w1", started_at=123.5)
    await r.xadd(run_stream, {"filler": "1"}, id=f"{later}-0")  # the run stream's next id: {later}-1
    assert await handoff.forward(src, env, run_stream, "run")
    assert (await r.xrange(run_stream))[-1][0].decode() == src.msg_id  # the same id, another stream
    assert (await r.hget(keys.job(env.job.job_id), "msg_id")).decode() == entry_token(run_stream, src.msg_id)
    running = JobStateFields(stage="init", status="running")
    await marks.mark([RunningMark(env.job.job_id, entry_token(src.stream, src.msg_id), running)])
    state = await read_state(r, keys, env.job.job_id)
    assert (state.stage, state.status) == ("run", "queued")
    await marks.aclose()


async def test_the_lean_connection_survives_cancelled_callers_and_lost_scripts(redis_url, namespace):
    r = async_redis(redis_url)
    fast = FastRedis.from_client(r)
    assert fast is not None
    try:
        blocked = asyncio.create_task(fast.execute("XREAD", "BLOCK", 300, "STREAMS", f"{namespace}:s", "$"))
        await asyncio.sleep(0.05)
        blocked.cancel()  # its reply still comes and must not be handed to the next caller
        assert await fast.execute("PING") == b"PONG"
        replies = await asyncio.gather(*(fast.execute("ECHO", str(i)) for i in range(50)))
        assert replies == [str(i).encode() for i in range(50)]
        await r.script_flush()
        assert await fast.evalsha("return ARGV[1]", [], ["hi"]) == b"hi"
        await r.client_kill_filter(skipme=False, _type="normal")  # every connection dropped
        for _ in range(2):  # the call that finds it dead fails; it reconnects for the next
            try:
                assert await fast.execute("PING") == b"PONG"
                break
            except redis.ConnectionError:
                pass
        assert await fast.execute("PING") == b"PONG"
    finally:
        await fast.close()
        await r.aclose()
