"""Cancellation of one job, of a group, or of everything a submitter has in flight: flags
(the authority, read by the hand-off script and the agent loop) plus a notice stream that
workers follow into an in-memory ``CancelBook``, so admission costs no round trip."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import redis.asyncio as aioredis

from rollstream.errors import InvalidJob
from rollstream.messages import ID_RULE, Job, valid_id
from rollstream.pipeline.keys import Keys

if TYPE_CHECKING:
    from rollstream.pipeline.wire import StreamReply


async def cancel(r: aioredis.Redis, keys: Keys, *, job_id: str | None = None, group_id: str | None = None,
                 submitter: str | None = None, ttl_s: int = 24 * 3600) -> None:
    """Raise the flag(s) and post a notice. A submitter's flag holds the time of the
    cancel, so it stops every job of theirs submitted before it and none submitted after."""
    if not (job_id or group_id or submitter):
        raise ValueError("cancel needs a job_id, a group_id or a submitter")
    for name, value in (("job_id", job_id), ("group_id", group_id), ("submitter", submitter)):
        if value and not valid_id(value):  # each names a key
            raise InvalidJob(f"cancel: {name}={value!r} is not an id ({ID_RULE})")
    now = time.time()
    async with r.pipeline(transaction=True) as pipe:  # flags and notice land together
        if job_id:
            pipe.set(keys.cancel_job(job_id), 1, ex=ttl_s)
        if group_id:
            pipe.set(keys.cancel_group(group_id), 1, ex=ttl_s)
        if submitter:
            pipe.set(keys.cancel_submitter(submitter), repr(now), ex=ttl_s)
        # Notices older than the flags' TTL are trimmed: the flags are gone by then too.
        pipe.xadd(keys.cancels, {"job": job_id or "", "group": group_id or "", "submitter": submitter or "",
                                 "at": repr(now)}, minid=str(int((now - ttl_s) * 1000)), approximate=True)
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


def reason_for_code(job: Job, code: int) -> str:
    """The reason for the hand-off script's refusal codes 2 (job), 3 (group), 4 (submitter)."""
    return {2: "job cancelled", 3: f"group {job.group_id} cancelled",
            4: f"all jobs of submitter {job.submitter} cancelled"}.get(code, "cancelled")


async def check(r: aioredis.Redis, keys: Keys, job: Job) -> str | None:
    return is_cancelled(job, cast(list[bytes | None], await r.mget(flag_keys(keys, job))))


async def check_many(r: aioredis.Redis, keys: Keys, jobs: list[Job]) -> list[str | None]:
    """`check` for many jobs in one round trip."""
    async with r.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.mget(flag_keys(keys, job))
        all_flags = await pipe.execute()
    return [is_cancelled(job, flags) for job, flags in zip(jobs, all_flags)]


@dataclass
class CancelBook:
    """What one worker knows has been cancelled, read from the notice stream. It may lag
    the flags by one notice in flight; the hand-off script's check of the flags covers that
    gap (a cancelled job never crosses a stage boundary) and the worker's watcher then
    interrupts the job. Entries older than ``ttl_s`` are forgotten, like the flags."""

    ttl_s: float = 24 * 3600
    jobs: dict[str, float] = field(default_factory=dict)
    groups: dict[str, float] = field(default_factory=dict)
    submitters: dict[str, float] = field(default_factory=dict)
    last_id: str = "0-0"
    _pruned_at: float = 0.0

    def note(self, fields: dict) -> None:
        get = lambda name: (fields.get(name.encode()) or b"").decode()  # noqa: E731
        try:
            at = float(get("at") or time.time())
        except ValueError:
            at = time.time()
        if get("job"):
            self.jobs[get("job")] = at
        if get("group"):
            self.groups[get("group")] = at
        if get("submitter"):
            self.submitters[get("submitter")] = max(at, self.submitters.get(get("submitter"), 0.0))

    def reason(self, job: Job) -> str | None:
        if job.job_id in self.jobs:
            return "job cancelled"
        if job.group_id and job.group_id in self.groups:
            return f"group {job.group_id} cancelled"
        at = self.submitters.get(job.submitter)
        if at is not None and job.submitted_at <= at:
            return f"all jobs of submitter {job.submitter} cancelled"
        return None

    async def catch_up(self, r: aioredis.Redis, keys: Keys, *, block_ms: int | None = None,
                       page: int = 1000) -> int:
        """Read the notices after ``last_id`` (waiting up to ``block_ms`` for the first);
        returns how many arrived."""
        total = 0
        while True:
            resp = cast("StreamReply", await r.xread({keys.cancels: self.last_id}, count=page,
                                                   block=block_ms if not total else None))
            entries = resp[0][1] if resp else []
            for msg_id, fields in entries:
                self.last_id = msg_id.decode() if isinstance(msg_id, bytes) else msg_id
                self.note(fields)
            total += len(entries)
            if len(entries) < page:
                break
        self._prune()
        return total

    def _prune(self) -> None:
        now = time.time()
        if now - self._pruned_at < 60:
            return
        self._pruned_at = now
        cutoff = now - self.ttl_s
        for book in (self.jobs, self.groups, self.submitters):
            for key in [k for k, at in book.items() if at < cutoff]:
                del book[key]
