"""Putting jobs on the init stream: a job state hash and a stream entry per job, written in
one MULTI so a job is either fully queued or not at all. Validation of task names and
instances happens before this, at the edge (client, API)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope, Job
from rollstream.pipeline.codec import pack
from rollstream.pipeline.keys import Keys


def initial_state(job: Job) -> dict:
    return {
        "job_id": job.job_id,
        "group_id": job.group_id or "",
        "submitter": job.submitter,
        "task": job.task,
        "stage": "init",
        "status": "queued",
        "attempts": 0,
        "submitted_at": job.submitted_at,
    }


def encode_for_init(job: Job, max_job_bytes: int) -> bytes:
    payload = pack(Envelope(job=job))
    if len(payload) > max_job_bytes:
        raise InvalidJob(f"job {job.job_id} is {len(payload)} bytes encoded, over the limit of "
                         f"{max_job_bytes}; keep large files out of the job (point at them) or raise "
                         "ROLLSTREAM_MAX_JOB_BYTES")
    return payload


async def enqueue(r: aioredis.Redis, keys: Keys, jobs: list[Job], *, max_job_bytes: int) -> list[str]:
    """Queue already-validated jobs for the init stage; returns their ids."""
    payloads = [encode_for_init(job, max_job_bytes) for job in jobs]
    async with r.pipeline(transaction=True) as pipe:
        for job, payload in zip(jobs, payloads):
            pipe.hset(keys.job(job.job_id), mapping=initial_state(job))
            pipe.xadd(keys.init_stream, {"data": payload})
        for submitter in {job.submitter for job in jobs}:
            pipe.zadd(keys.submitters, {submitter: time.time()})
        await pipe.execute()
    return [job.job_id for job in jobs]
