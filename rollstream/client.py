"""The Python client a trainer (or any program) uses: submit jobs and groups, iterate
results exactly once, cancel, read job state. ``AsyncClient`` for asyncio code, ``Client``
for plain code; both speak to Redis directly, the HTTP API offers the same operations."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import redis
from redis.typing import KeyT, StreamIdT

from rollstream import eventloop
from rollstream.config import Settings, load_settings
from rollstream.errors import InvalidJob, RedisUnavailable
from rollstream.messages import ID_RULE, Job, Result, new_id, valid_id
from rollstream.pipeline import cancel as cancel_flags
from rollstream.pipeline.connection import (
    MAX_BLOCK_MS,
    SOCKET_TIMEOUT_S,
    async_redis,
    check_async,
    raise_if_cancelled,
    raise_refusal,
)
from rollstream.pipeline.embedded import running_url
from rollstream.pipeline.groups import ensure_group
from rollstream.pipeline.jobstate import JobState, read_state
from rollstream.pipeline.keys import RESULTS_GROUP, Keys
from rollstream.pipeline.poison import UNREADABLE, dead_letter_result, read_result
from rollstream.pipeline.submission import enqueue
from rollstream.pipeline.wire import FastRedis, stream_entries
from rollstream.tasks.registry import validate_instance

log = logging.getLogger(__name__)


# How many job ids a client remembers to drop a second result of the same job.
_REMEMBERED_RESULTS = 100_000


class SubmittedId(str):
    """A job id as ``submit`` returns it. ``duplicate`` is True when a job with this id was
    known already (queued, at work, or finished less than job_state_ttl_s ago): nothing was
    queued and no second result will come; ``status`` was its status then. A retried
    submission whose first reply was lost is such a duplicate of itself."""

    duplicate: bool = False
    status: str | None = None

    @classmethod
    def known(cls, job_id: str, status: str) -> SubmittedId:
        marked = cls(job_id)
        marked.duplicate, marked.status = True, status
        return marked


def _check_ids(job: Job) -> None:
    """Ids of a Job built without validation (model_construct, model_copy) must still keep
    the grammar: they become key names and paths."""
    for name in ("job_id", "group_id", "submitter"):
        value = getattr(job, name)
        if value is not None and not valid_id(value):
            raise InvalidJob(f"malformed job: {name}={value!r} is not an id ({ID_RULE})")


class AsyncClient:
    """Submit and collect rollouts. One client is one submitter: its results arrive on
    ``{ns}:results:{submitter}`` and each result is yielded once: it counts as done when the
    caller's loop comes back for the next one, and is acknowledged with the next submission
    or read, or at ``close``. One the caller did not finish (its loop raised or broke out, or
    it crashed) is delivered again."""

    def __init__(self, redis_url: str | None = None, *, submitter: str | None = None,
                 settings: Settings | None = None, validate_tasks: bool = True):
        self.settings = settings or load_settings(redis_url=redis_url)
        url = redis_url or self.settings.redis_url or running_url(self.settings.data_dir)
        if not url:
            raise RedisUnavailable("no Redis URL: pass redis_url, set REDIS_URL, or start 'rollstream up' "
                                   f"(its embedded Redis is found in {self.settings.data_dir} without a URL)")
        self.url = url
        self.r = async_redis(url)
        self.keys = Keys(self.settings.namespace)
        self.submitter = submitter or f"client-{uuid.uuid4().hex[:8]}"
        if not valid_id(self.submitter):
            raise ValueError(f"submitter={self.submitter!r} is not an id ({ID_RULE}): it names the "
                             "submitter's results stream")
        self.validate_tasks = validate_tasks
        self._results_stream = self.keys.results(self.submitter)
        self._consumer = f"c-{uuid.uuid4().hex[:8]}"
        self._group_ready = False
        self._backlog_done = False  # unacknowledged results of an earlier consumer: re-read once
        # A read whose reply was lost with its connection may have delivered results to this
        # consumer: they sit in its pending list, and the next read takes them from there.
        self._reread_own = False
        self._to_ack: list[bytes] = []
        # Job ids of the last results yielded. After a Redis failover a result can come twice:
        # its delivery, or its acknowledgement, may not have reached the replica promoted.
        self._yielded: dict[str, None] = {}
        # Lean connections for the two calls on a job's critical path: submit, and the
        # blocking result read (its own, since a blocking read holds its connection).
        self._fast_submit = FastRedis.from_client(self.r)
        self._fast_results = FastRedis.from_client(self.r)

    async def __aenter__(self) -> AsyncClient:
        await check_async(self.r, self.url)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._ack_pending()
        for fast in (self._fast_submit, self._fast_results):
            if fast is not None:
                await fast.close()
        await self.r.aclose()

    # -- submitting --------------------------------------------------------------------
    def _prepare(self, job: Job | dict) -> Job:
        if isinstance(job, dict):
            try:
                job = Job.model_validate({"submitter": self.submitter, **job})
            except Exception as exc:
                raise InvalidJob(f"malformed job: {exc}") from exc
        else:
            if job.submitter == "default":
                job = job.model_copy(update={"submitter": self.submitter})
            _check_ids(job)
        if self.validate_tasks:
            validate_instance(job.task, job.instance)
        return job

    async def _ensure_results_group(self) -> None:
        if not self._group_ready:
            await ensure_group(self.r, self._results_stream, RESULTS_GROUP)
            self._group_ready = True

    async def submit(self, job: Job | dict) -> SubmittedId:
        """Queue one job; returns its id (``.duplicate`` says if that id was known already and
        nothing was queued). Raises ``InvalidJob`` before queuing anything bad, and
        ``RedisRefusesWrites`` (safe to retry later) while Redis takes no writes."""
        return (await self.submit_many([job]))[0]

    async def submit_many(self, jobs: Sequence[Job | dict]) -> list[SubmittedId]:
        prepared = [self._prepare(j) for j in jobs]
        await self._ensure_results_group()
        # Acknowledgements still owed ride with the submission (one write, replies at once)
        # rather than with the next read, whose reply would then come in two parts.
        ids, self._to_ack = (self._to_ack, []) if self._fast_submit is not None else ([], self._to_ack)
        try:
            done = await enqueue(self.r, self.keys, prepared, max_job_bytes=self.settings.max_job_bytes,
                                 fast=self._fast_submit, before=self._ack_commands(ids),
                                 replica_acks=self.settings.replica_acks,
                                 replica_ack_timeout_ms=self.settings.replica_ack_timeout_ms,
                                 priority_aging_s=self.settings.priority_aging_s)
        except BaseException as exc:
            self._to_ack = ids + self._to_ack  # not known to be acknowledged: owe them still
            raise_refusal(exc, self.url)
            raise
        if not done.duplicates:
            return [SubmittedId(job_id) for job_id in done.job_ids]
        for job_id, status in done.duplicates.items():
            log.warning("job %s was submitted before (status %s): nothing queued, no second result will "
                        "come; give the job a new job_id to run it again", job_id, status)
        return [SubmittedId.known(j, done.duplicates[j]) if j in done.duplicates else SubmittedId(j)
                for j in done.job_ids]

    def _ack_commands(self, ids: list[bytes]) -> list[tuple]:
        if not ids:
            return []
        return [("XACK", self._results_stream, RESULTS_GROUP, *ids), ("XDEL", self._results_stream, *ids)]

    async def submit_group(self, job: Job | dict, n: int, *,
                           group_id: str | None = None) -> tuple[str, list[SubmittedId]]:
        """Queue ``n`` rollouts of the same instance as one group (GRPO/DAPO); returns
        the group id and the job ids."""
        if n < 1:
            raise InvalidJob("a group needs n ≥ 1 jobs")
        template = self._prepare(job)
        if group_id is not None and not valid_id(group_id):
            raise InvalidJob(f"malformed job: group_id={group_id!r} is not an id ({ID_RULE})")
        group_id = group_id or new_id()
        now = time.time()
        members = [template.model_copy(update={"job_id": new_id(), "group_id": group_id, "submitted_at": now})
                   for _ in range(n)]
        return group_id, await self.submit_many(members)

    # -- results -----------------------------------------------------------------------
    async def _ack_pending(self) -> None:
        if self._to_ack:
            ids, self._to_ack = self._to_ack, []
            try:
                async with self.r.pipeline(transaction=True) as pipe:
                    pipe.xack(self._results_stream, RESULTS_GROUP, *ids)
                    pipe.xdel(self._results_stream, *ids)
                    await pipe.execute()
            except BaseException as exc:
                self._to_ack = ids + self._to_ack  # not known to be acknowledged: owe them still
                raise_refusal(exc, self.url)
                raise

    async def _read(self, last_id: str, count: int, block_ms: int | None):
        """XREADGROUP on the results stream; acknowledgements still owed ride in the same
        round trip, so reading a result costs one round trip, not two."""
        streams: dict[KeyT, StreamIdT] = {self._results_stream: last_id}
        if self._fast_results is not None:
            read = ["XREADGROUP", "GROUP", RESULTS_GROUP, self._consumer, "COUNT", count]
            read += (["BLOCK", block_ms] if block_ms is not None else []) + ["STREAMS", self._results_stream, last_id]
            ids, self._to_ack = self._to_ack, []
            try:
                replies = await self._fast_results.execute_many(
                    [*self._ack_commands(ids), tuple(read)], timeout_s=(block_ms or 0) / 1000 + SOCKET_TIMEOUT_S)
            except BaseException:
                self._to_ack = ids + self._to_ack  # not known to be acknowledged: owe them still
                raise
            entries = stream_entries(replies[-1])
            return [[self._results_stream, entries]] if entries else []
        if not self._to_ack:
            return await self.r.xreadgroup(RESULTS_GROUP, self._consumer, streams, count=count, block=block_ms)
        ids, self._to_ack = self._to_ack, []
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.xack(self._results_stream, RESULTS_GROUP, *ids)
            pipe.xdel(self._results_stream, *ids)
            pipe.xreadgroup(RESULTS_GROUP, self._consumer, streams, count=count, block=block_ms)
            try:
                return (await pipe.execute())[-1]
            except BaseException:
                self._to_ack = ids + self._to_ack  # not known to be acknowledged: owe them still
                raise

    async def results(self, timeout_s: float | None = None, *, max_results: int | None = None,
                      batch: int = 256) -> AsyncGenerator[Result, None]:
        """Yield results as they arrive. Stops after ``timeout_s`` without a new result
        (None waits forever) or after ``max_results``. A result is acknowledged once the loop
        comes back for the next one (or the iterator ends): one whose loop body raised, or
        broke out, is delivered again by the next ``results`` call. An entry that is not a
        readable result goes to the dead letters; the results behind it still come."""
        await self._ensure_results_group()
        yielded = 0
        claim_others = not self._backlog_done
        backlog = claim_others or self._reread_own
        self._backlog_done, self._reread_own = True, False
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while max_results is None or yielded < max_results:
            if backlog:
                block_ms = None
            else:
                left_ms = MAX_BLOCK_MS if deadline is None else int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    return
                block_ms = max(1, min(left_ms, MAX_BLOCK_MS))
            try:
                resp = await self._read("0" if backlog else ">", batch, block_ms)
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._reread_own = True
                raise
            except redis.ResponseError as exc:  # MISCONF (a full disk under Redis), READONLY, OOM: say so
                raise_refusal(exc, self.url)
                raise
            raise_if_cancelled()
            entries = resp[0][1] if resp else []
            if backlog:
                backlog = False
                if claim_others:
                    claim_others = False
                    resp = await self.r.xautoclaim(self._results_stream, RESULTS_GROUP, self._consumer, 0,
                                                   start_id="0-0", count=batch)
                    entries = [*entries, *resp[1]]
                entries = [(m, f) for m, f in entries if f]  # deleted after delivery: acknowledged already
            if not entries:
                continue  # this slice was quiet; the deadline decides when to stop
            if deadline is not None and timeout_s is not None:  # one is None where the other is
                deadline = time.monotonic() + timeout_s  # timeout_s counts from the last result
            for msg_id, fields in entries:
                try:
                    result = read_result(fields)
                except UNREADABLE as exc:
                    await dead_letter_result(self.r, self.keys, self.submitter, msg_id, fields,
                                             f"{type(exc).__name__}: {exc}", dead_maxlen=self.settings.dead_maxlen)
                    continue
                if result.job_id in self._yielded:
                    log.warning("job %s: a second result (a failover lost the first one's acknowledgement or "
                                "the stage's hand-off); acknowledged and dropped", result.job_id)
                    self._to_ack.append(msg_id)
                    continue
                self._reread_own = True  # until the caller comes back: if it never does, read it again
                yield result
                self._yielded[result.job_id] = None
                if len(self._yielded) > _REMEMBERED_RESULTS:
                    del self._yielded[next(iter(self._yielded))]
                self._reread_own = False
                self._to_ack.append(msg_id)  # the caller came back for more: it is done with this one
                yielded += 1
                if max_results is not None and yielded >= max_results:
                    break
        # The last results are acknowledged with the next read or at close(), not here:
        # a round trip less between one result and the next request.

    async def collect(self, n: int, timeout_s: float = 60.0) -> list[Result]:
        """The next ``n`` results; raises TimeoutError if they do not all come in time."""
        out: list[Result] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            async for result in self.results(timeout_s=left, max_results=n - len(out)):
                out.append(result)
        await self._ack_pending()
        if len(out) < n:
            raise TimeoutError(f"got {len(out)} of {n} results in {timeout_s}s; check 'rollstream status' "
                               "for stuck stages or dead workers")
        return out

    # -- control -----------------------------------------------------------------------
    async def cancel(self, *, job_id: str | None = None, group_id: str | None = None,
                     everything: bool = False) -> None:
        """Cancel one job, a group, or everything this submitter has in flight. Each
        cancelled job still yields one result, with status 'cancelled'."""
        await cancel_flags.cancel(self.r, self.keys, job_id=job_id, group_id=group_id,
                                  submitter=self.submitter if everything else None,
                                  ttl_s=self.settings.job_state_ttl_s)

    async def status(self, job_id: str) -> JobState | None:
        return await read_state(self.r, self.keys, job_id)

    async def set_policy_version(self, version: int) -> None:
        await self.r.set(self.keys.policy_version, int(version))

    async def policy_version(self) -> int:
        return int(await self.r.get(self.keys.policy_version) or 0)


class Client:
    """The same operations without asyncio (runs a private event loop)."""

    def __init__(self, redis_url: str | None = None, **kwargs: Any):
        self._client = AsyncClient(redis_url, **kwargs)
        self._loop = eventloop.loop_factory(self._client.settings.event_loop)()
        self._run(check_async(self._client.r, self._client.url))

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    @property
    def submitter(self) -> str:
        return self._client.submitter

    def submit(self, job: Job | dict) -> str:
        return self._run(self._client.submit(job))

    def submit_many(self, jobs: Sequence[Job | dict]) -> list[SubmittedId]:
        return self._run(self._client.submit_many(jobs))

    def submit_group(self, job: Job | dict, n: int, **kw) -> tuple[str, list[SubmittedId]]:
        return self._run(self._client.submit_group(job, n, **kw))

    def results(self, timeout_s: float | None = None, *, max_results: int | None = None) -> Iterator[Result]:
        agen = self._client.results(timeout_s, max_results=max_results)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def collect(self, n: int, timeout_s: float = 60.0) -> list[Result]:
        return self._run(self._client.collect(n, timeout_s))

    def cancel(self, **kw) -> None:
        self._run(self._client.cancel(**kw))

    def status(self, job_id: str) -> JobState | None:
        return self._run(self._client.status(job_id))

    def close(self) -> None:
        try:
            self._run(self._client.close())
        except (redis.RedisError, OSError):
            pass
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
