"""Putting jobs on the init stream: a job state hash and a stream entry per job, written by
one Lua script, so a batch is queued whole or not at all, and each job at most once per job
id. Validation of task names and instances happens before this, at the edge (client, API)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from rollstream.errors import InvalidJob, JobTooLarge
from rollstream.messages import INIT_STAGE, Envelope, Job, job_problem
from rollstream.pipeline.codec import pack
from rollstream.pipeline.jobstate import JobStateFields, hash_args
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.priorities import INIT_GROUP, SUBMIT_SCRIPT, rank_offset_s
from rollstream.pipeline.replication import ReplicasBehind, script_then_wait
from rollstream.pipeline.wire import FastRedis


def initial_state(job: Job) -> JobStateFields:
    return JobStateFields(job_id=job.job_id, group_id=job.group_id or "", submitter=job.submitter, task=job.task,
                          stage=INIT_STAGE, status="queued", attempts=0, submitted_at=job.submitted_at,
                          priority=job.priority)


def check_bounds(job: Job) -> None:
    """Raise ``InvalidJob`` naming where a job breaks the payload bounds (nesting, 64-bit
    integers, finite numbers): what would fail later, in a stage or in its results."""
    problem = job_problem(job)
    if problem:
        raise InvalidJob(f"job {job.job_id}: {problem}")


def encode_for_init(job: Job, max_job_bytes: int) -> bytes:
    check_bounds(job)
    try:
        payload = pack(Envelope(job=job))
    except UnicodeEncodeError as exc:  # a lone surrogate (\ud800) that JSON let through
        bad = exc.object[max(0, exc.start - 20):exc.end + 20] if isinstance(exc.object, str) else ""
        raise InvalidJob(f"job {job.job_id} has text that is not valid Unicode near {bad!r} "
                         f"({exc.reason}); send UTF-8 text, or bytes as base64") from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise InvalidJob(f"job {job.job_id} cannot be encoded: {exc}") from None
    if len(payload) > max_job_bytes:
        raise JobTooLarge(f"job {job.job_id} is {len(payload)} bytes encoded, over the limit of "
                         f"{max_job_bytes}; keep large files out of the job (point at them) or raise "
                         "ROLLSTREAM_MAX_JOB_BYTES")
    return payload


@dataclass
class Enqueued:
    """What a submission did: every job's id, and those already known (queued, at work, or
    finished less than job_state_ttl_s ago) with their status then: nothing was queued for
    those, and no second result will come."""

    job_ids: list[str]
    duplicates: dict[str, str] = field(default_factory=dict)


async def enqueue(r: aioredis.Redis, keys: Keys, jobs: list[Job], *, max_job_bytes: int,
                  fast: FastRedis | None = None, before: Sequence[tuple] = (), replica_acks: int = 0,
                  replica_ack_timeout_ms: int = 1000,
                  priority_aging_s: float = 3.0) -> Enqueued:
    """Queue already-validated jobs for the init stage. Idempotent per job id while its
    state hash lives (until job_state_ttl_s after it finished): a retried submission queues
    nothing twice, and says which ids it found known. ``before``: commands that ride in the
    same write (only with ``fast``). ``replica_acks``: raise ``ReplicasBehind`` unless that
    many replicas hold the jobs (replication.py), so an acknowledged job survives a failover.
    Jobs behind others wait for init by priority (priorities.py, ``priority_aging_s``)."""
    if before and fast is None:
        raise ValueError("commands can ride along with a submission only on a lean connection")
    payloads = [encode_for_init(job, max_job_bytes) for job in jobs]
    submitters = sorted({job.submitter for job in jobs})
    args: list = [time.time(), len(submitters), *submitters, INIT_GROUP]
    for job, payload in zip(jobs, payloads):
        state = hash_args(initial_state(job))
        args += [payload, rank_offset_s(job.priority, priority_aging_s), len(state) // 2, *state]
    script_keys = [keys.init_stream, keys.submitters, keys.init_waiting, *(keys.job(job.job_id) for job in jobs)]
    if replica_acks:
        queued, confirmed = await script_then_wait(r, fast, SUBMIT_SCRIPT, script_keys, args, acks=replica_acks,
                                                   timeout_ms=replica_ack_timeout_ms, before=before)
        if confirmed < replica_acks:
            raise ReplicasBehind(queued, confirmed, replica_acks, replica_ack_timeout_ms)
    elif fast is not None:  # the client's lean connection: submit is on a job's critical path
        queued = await fast.evalsha(SUBMIT_SCRIPT, script_keys, args, before=before)
    else:
        queued = await r.register_script(SUBMIT_SCRIPT)(keys=script_keys, args=args)
    done = Enqueued([job.job_id for job in jobs])
    known = [job.job_id for job, fresh in zip(jobs, queued) if not int(fresh)]
    if known:  # rare: a retried submission, or a job id used twice; one more round trip
        async with r.pipeline(transaction=False) as pipe:
            for job_id in known:
                pipe.hget(keys.job(job_id), "status")
            found = await pipe.execute()
        done.duplicates = {job_id: (s.decode() if isinstance(s, bytes) else s) or "unknown"
                           for job_id, s in zip(known, found)}
    return done
