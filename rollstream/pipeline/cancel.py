"""Cancellation flags: of one job, of a group, or of everything a submitter has in flight.
Every stage reads them before it starts work (and the agent loop between turns)."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from rollstream.messages import Job
from rollstream.pipeline.keys import Keys


async def cancel(r: aioredis.Redis, keys: Keys, *, job_id: str | None = None, group_id: str | None = None,
                 submitter: str | None = None, ttl_s: int = 24 * 3600) -> None:
    """Raise the flag(s). A submitter's flag holds the time of the cancel, so it stops
    every job of theirs submitted before it and none submitted after."""
    if not (job_id or group_id or submitter):
        raise ValueError("cancel needs a job_id, a group_id or a submitter")
    async with r.pipeline(transaction=False) as pipe:
        if job_id:
            pipe.set(keys.cancel_job(job_id), 1, ex=ttl_s)
        if group_id:
            pipe.set(keys.cancel_group(group_id), 1, ex=ttl_s)
        if submitter:
            pipe.set(keys.cancel_submitter(submitter), repr(time.time()), ex=ttl_s)
        await pipe.execute()


def flag_keys(keys: Keys, job: Job) -> list[str]:
    return [keys.cancel_job(job.job_id),
            keys.cancel_group(job.group_id or "-"),
            keys.cancel_submitter(job.submitter)]


def is_cancelled(job: Job, flags: list[bytes | None]) -> str | None:
    """Given the values of ``flag_keys(job)``, the reason the job is cancelled, or None."""
    by_job, by_group, by_submitter = flags
    if by_job is not None:
        return "job cancelled"
    if by_group is not None and job.group_id:
        return f"group {job.group_id} cancelled"
    if by_submitter is not None and job.submitted_at <= float(by_submitter):
        return f"all jobs of submitter {job.submitter} cancelled"
    return None


async def check(r: aioredis.Redis, keys: Keys, job: Job) -> str | None:
    return is_cancelled(job, await r.mget(flag_keys(keys, job)))
