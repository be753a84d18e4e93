"""The consumer loop every stage worker runs: read its stream through a consumer group,
keep N jobs in flight, keep them fresh with heartbeats, reclaim what dead workers left,
follow cancellations, and hand each job on through ``pipeline.handoff``. A stage hop costs
one wake-up and one awaited round trip (the hand-off script); the "running" mark is sent off
the critical path, and only for jobs still at work after ``MARK_RUNNING_AFTER_S``; a finished
job's latencies join the shared histograms with the process's next flush."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import redis
from pydantic import ValidationError

from rollstream.errors import InvalidJob, JobCancelled, JobFailed
from rollstream.messages import DeadLetter, Envelope, Result
from rollstream.pipeline import cancel, histograms
from rollstream.pipeline.codec import DecodeError, decode_envelope
from rollstream.pipeline.connection import SOCKET_TIMEOUT_S, Outage, raise_if_cancelled, transient_problem
from rollstream.pipeline.groups import autoclaim, ensure_group, remove_idle_consumer
from rollstream.pipeline.handoff import SandboxCount, Source, sandbox_of
from rollstream.pipeline.jobstate import RunningMarks
from rollstream.pipeline.rescue import rescue_dead_nodes
from rollstream.pipeline.wire import FastRedis, stream_entries
from rollstream.workers.malformed import malformed_message
from rollstream.workers.stage import Forward, Stage, WorkerContext, active_s, ended_result, queued_s

log = logging.getLogger(__name__)

# A job still in its stage after this long is marked "running" in its state hash. Shorter
# stage work never needs the mark (its hand-off writes the stage's start time and worker),
# which spares a Redis script call per stage and job; observers see the mark this late.
MARK_RUNNING_AFTER_S = 0.02

# The interrupt reason of a job whose timeout_s ran out while its stage worked on it.
_TIMED_OUT = "timed out"


def _id(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class ConsumerLoop:
    def __init__(self, stage: Stage, ctx: WorkerContext, concurrency: int, consumer: str | None = None):
        self.stage = stage
        self.ctx = ctx
        self.s = ctx.settings
        self.r = ctx.redis
        self.concurrency = max(1, concurrency)
        self.stream = ctx.keys.stage_stream(stage.name, ctx.node)
        self.group = stage.name
        self.consumer = consumer or f"{ctx.node}:{stage.name}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # A Redis that refuses writes (full disk: MISCONF; READONLY, OOM, LOADING) or drops its
        # connections is waited out, logged once; hand-offs it refused are sent again.
        self.outage = Outage(self.consumer)
        ctx.handoff.wait_out = self._wait_out
        self.inflight: dict[str, tuple[asyncio.Task, Envelope | None]] = {}
        self._cancel_reasons: dict[str, str] = {}
        self._processing: set[str] = set()  # only work inside Stage.process is ever interrupted
        # When each job in Stage.process runs out of its timeout_s (loop time), and the one timer
        # that serves them all (a timer per job would cost more than a fast job's stage).
        self._deadlines: dict[str, float] = {}
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self.processed = 0
        self.book = cancel.CancelBook(ttl_s=self.s.job_state_ttl_s)
        self.marks = RunningMarks(self.r, ctx.keys)
        self._unmarked: dict[str, tuple[str, str, dict]] = {}  # msg_id -> "running" mark not yet sent
        self._mark_timer: asyncio.TimerHandle | None = None
        self._side_tasks: set[asyncio.Task] = set()  # sent without awaiting; kept from GC
        # The wake-up read, on its own connection. Between a read's reply and the next read,
        # jobs that finish at once send their hand-off on it too: a batch's corked with that
        # next read, a lone job's at once (see _read_loop).
        self._reader = FastRedis.from_client(self.r)
        self._reader_blocked = False
        # Init's view of the node's sandbox count: as read with the last read, plus the
        # sandboxes this process forwarded since (see _free_slots).
        self._live_at_read: int | None = None
        self._forwards_since_read = 0
        self.observations = histograms.Observations()

    # -- lifecycle ---------------------------------------------------------------------
    def stop(self) -> None:
        """Stop pulling work; in-flight jobs get ``shutdown_grace_s`` to finish."""
        self._stopping.set()

    async def _register(self) -> None:
        """Create the group and announce this worker, riding out a Redis that restarts."""
        while True:
            try:
                await ensure_group(self.r, self.stream, self.group)
                await self._heartbeat()
                # Cancels issued before this worker started must hold for its first read.
                await self.book.catch_up(self.r, self.ctx.keys)
                return
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc) is None:
                    raise
                await asyncio.sleep(self.outage.failed(exc))

    async def serve(self) -> None:
        await self._register()
        background = [asyncio.create_task(self._every(self.s.heartbeat_interval_s, self._heartbeat)),
                      asyncio.create_task(self._every(max(self.s.visibility_timeout_s / 4, 0.2), self._reclaim)),
                      asyncio.create_task(self._follow_cancellations()),
                      asyncio.create_task(self._every(1.0, self._watch_cancellations)),
                      asyncio.create_task(self._every(histograms.FLUSH_S, self._flush_observations))]
        if self.stage.rescues_dead_nodes:
            background.append(asyncio.create_task(self._every(max(self.s.worker_ttl_s / 2, 0.5), self._rescue)))
        log.info("worker %s serving %s with %d slots", self.consumer, self.stream, self.concurrency)
        try:
            await self._read_loop()
        finally:
            await self._drain()
            await self._flush_observations(final=True)
            for task in background:
                task.cancel()
            for timer in (self._mark_timer, self._deadline_timer):
                if timer is not None:
                    timer.cancel()
            await asyncio.gather(*background, *self._side_tasks, return_exceptions=True)
            await self._deregister()
            if self._reader is not None:
                await self._reader.close()
            await self.marks.aclose()
            await self.ctx.handoff.aclose()

    async def _rescue(self) -> None:
        """Move jobs of dead nodes back to init. Not while Redis refuses writes, nor within
        worker_ttl_s after: every node's heartbeat went stale with the outage, and a live node
        needs a heartbeat to show it lives."""
        if self.outage.within(self.s.worker_ttl_s):
            return
        await rescue_dead_nodes(self.ctx.redis, self.ctx.keys, self.ctx.handoff, self.s, self.consumer)

    async def _every(self, period_s: float, fn) -> None:
        while not self._stopping.is_set():
            try:
                await fn()
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc):
                    self.outage.failed(exc)
                else:
                    log.warning("%s: background step %s failed: %s", self.consumer, getattr(fn, "__name__", fn), exc)
            raise_if_cancelled()
            try:
                await asyncio.wait_for(self._stopping.wait(), period_s)
            except asyncio.TimeoutError:
                pass

    # -- reading -----------------------------------------------------------------------
    async def _free_slots(self) -> int:
        free = self.concurrency - len(self.inflight)
        if self.stage.limits_by_node_sandboxes and free > 0:
            # Back-pressure: pull only while the node has sandbox slots (those of jobs on its
            # run and eval streams, plus what this process is creating). The count comes with
            # every read (see _read), and this process's forwards since then are added to it:
            # an estimate that can only be high (eval's releases lower the true count), never
            # low. A count cached for 50 ms without those forwards let the node reach 6
            # sandboxes with a limit of 3 (tests/pipeline/test_hot_path.py).
            if self._live_at_read is None:  # unknown, or no room at the last look: ask now
                if self._reader is not None:
                    self._reader.uncork()  # with the hand-offs held so far
                key = self.ctx.keys.node_sandboxes(self.ctx.node)
                self._forwards_since_read = 0
                self._live_at_read = int(await (self._reader.execute("SCARD", key) if self._reader
                                                else self.r.scard(key)))
            live = self._live_at_read + self._forwards_since_read
            free = min(free, self.s.max_sandboxes_per_node - live - len(self.inflight))
            if free <= 0 or self._reader is None:
                self._live_at_read = None
        return free

    async def _read_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                free = await self._free_slots()
                if free <= 0:
                    self._slot_freed.clear()
                    try:
                        await asyncio.wait_for(self._slot_freed.wait(), 0.2)
                    except asyncio.TimeoutError:
                        pass
                    continue
                entries = await self._read(free)
                raise_if_cancelled()
            except (redis.RedisError, OSError) as exc:
                if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                    # the stream was deleted under us (e.g. FLUSHALL)
                    try:
                        await ensure_group(self.r, self.stream, self.group)
                    except (redis.RedisError, OSError) as again:
                        if transient_problem(again) is None:
                            raise
                        await asyncio.sleep(self.outage.failed(again))
                    continue
                if transient_problem(exc) is None:
                    raise
                await asyncio.sleep(self.outage.failed(exc))
                continue
            self.outage.recovered()
            if entries:
                if self._reader is not None and len(entries) > 1:
                    # A batch: its hand-offs go out with the next read, in one write (one
                    # wake-up of Redis for them all). A lone job's hand-off goes at once:
                    # holding it for the read costs its next stage ~0.1 ms, and no write
                    # is saved that a busy worker would notice.
                    self._reader.cork()  # released with the next read (see _read)
                self._admit(entries)
                # Let the new jobs run up to their first wait before this loop sends its next
                # read: on the critical path a job comes first.
                await asyncio.sleep(0)

    async def _read(self, count: int) -> list[tuple[str, dict, int]]:
        """The next messages for this consumer (waiting up to read_block_ms), as
        (id, fields, deliveries=1)."""
        block = self.s.read_block_ms
        if self._reader is None:
            resp = await self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block)
            return [(_id(m), f, 1) for _stream, items in resp or [] for m, f in items]
        commands = [("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block,
                     "STREAMS", self.stream, ">")]
        counting = self.stage.limits_by_node_sandboxes
        if counting:  # the node's sandbox count for the next read's back-pressure, in the same write
            commands.insert(0, ("SCARD", self.ctx.keys.node_sandboxes(self.ctx.node)))
            self._forwards_since_read = 0
        self._reader_blocked = True
        try:
            replies = await self._reader.execute_many(commands, timeout_s=block / 1000 + SOCKET_TIMEOUT_S,
                                                      uncork=True)
        finally:
            self._reader_blocked = False
        if counting:
            self._live_at_read = int(replies[0])
        return [(_id(m), f, 1) for m, f in stream_entries(replies[-1])]

    def _admit(self, entries: list[tuple[str, dict, int]]) -> None:
        """Start a batch of messages, each as its own task, with no round trip: the
        cancellation check reads the in-memory book (the hand-off script re-checks the
        flags), and the "running" marks of those still at work ``MARK_RUNNING_AFTER_S``
        later go out in one pipeline that nobody waits for. Messages stay pending with us
        until their hand-off."""
        started = time.time()
        stage = self.stage.name
        marks = self._unmarked
        for msg_id, fields, deliveries in entries:
            if msg_id in self.inflight:
                continue
            src = Source(self.stream, self.group, msg_id, self.consumer, started_at=started)
            try:
                env = decode_envelope(fields)
                if problem := self.stage.admission_problem(env):
                    raise InvalidJob(f"job {env.job.job_id}: {problem}")
            except (DecodeError, ValidationError, InvalidJob) as exc:
                self._track(msg_id, None, self._guard(src, None, self._undecodable(src, fields, exc)))
                continue
            marks[msg_id] = (env.job.job_id, msg_id, {"stage": stage, "status": "running", "worker": self.consumer,
                                                      "node": self.ctx.node, f"{stage}_started_at": started})
            self._track(msg_id, env, self._guard(src, env, self._run_job(src, env, deliveries)))
        if marks and self._mark_timer is None:
            self._mark_timer = asyncio.get_running_loop().call_later(MARK_RUNNING_AFTER_S, self._send_marks)

    def _send_marks(self) -> None:
        """Mark "running" the jobs admitted before now that are still at work (one batch)."""
        self._mark_timer = None
        if self._unmarked:
            batch, self._unmarked = list(self._unmarked.values()), {}
            self._side(self.marks.mark(batch), "marking jobs running")

    def _side(self, coro, what: str) -> None:
        """Run ``coro`` without waiting for it; a failure is logged, never raised."""
        async def guarded() -> None:
            try:
                await coro
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc):
                    self.outage.failed(exc)
                else:
                    log.warning("%s: %s failed: %s", self.consumer, what, exc)

        task = asyncio.create_task(guarded())
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _track(self, msg_id: str, env: Envelope | None, coro) -> None:
        task = asyncio.create_task(coro)
        self.inflight[msg_id] = (task, env)
        task.add_done_callback(lambda _t, m=msg_id: self._done(m))

    def _done(self, msg_id: str) -> None:
        self.inflight.pop(msg_id, None)
        self._cancel_reasons.pop(msg_id, None)
        if self._unmarked.pop(msg_id, None) is not None and not self._unmarked and self._mark_timer is not None:
            self._mark_timer.cancel()  # every job of the batch left in time: no mark at all
            self._mark_timer = None
        self.processed += 1
        self._slot_freed.set()

    # -- one job -----------------------------------------------------------------------
    async def _guard(self, src: Source, env: Envelope | None, coro) -> None:
        try:
            await coro
        except (redis.RedisError, OSError) as exc:
            if transient_problem(exc) is None:
                raise
            # The job stays pending; after the visibility timeout a worker reclaims it.
            log.error("job %s: Redis failed during %s (%s); left pending for reclaim",
                      env.job.job_id if env else "?", self.stage.name, exc)
        except (ValueError, TypeError, OverflowError) as exc:
            if env is None:
                raise
            # What no codec can carry on (a hand-added message's 2**70, say) would fail the
            # same way at every delivery: it ends now, as a dead letter and a failed result
            # that carry only the ids, never as a message pending forever.
            log.exception("job %s cannot go on from %s", env.job.job_id, self.stage.name)
            job, error = env.job, f"job cannot be carried on from {self.stage.name}: {type(exc).__name__}: {exc}"
            letter = DeadLetter(job_id=job.job_id, submitter=job.submitter, stage=self.stage.name, error=error)
            result = Result(job_id=job.job_id, group_id=job.group_id, submitter=job.submitter, task=job.task,
                            status="failed", error=error, error_stage=self.stage.name, failure="job")
            await self.ctx.handoff.dead_letter(src, letter, result, count=await self._release(env))

    async def _wait_out(self, exc: BaseException) -> bool:
        """A hand-off that Redis refused (it did not run): wait, and say whether to send it
        again (not once this worker is stopping: the job then stays pending for reclaim)."""
        if self._stopping.is_set():
            return False
        delay = self.outage.failed(exc)
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
            return False
        except asyncio.TimeoutError:
            return True

    async def _run_job(self, src: Source, env: Envelope, deliveries: int) -> None:
        job, stage, started = env.job, self.stage.name, src.started_at
        if deliveries > self.s.max_deliveries:
            return await self._give_up(src, env, f"delivered {deliveries} times to {stage} workers that "
                                                 "died or hung before finishing it")
        reason = self.book.reason(job)
        if reason:
            return await self._end(src, env, "cancelled", reason)
        if deliveries > 1 and stage != "init":
            return await self._retry(src, env, f"{stage} worker died mid-job (delivery {deliveries})")
        env.timings_s[f"{stage}_wait_s"] = max(0.0, started - int(src.msg_id.split("-")[0]) / 1000)
        # timeout_s counts time at work in stages, not in queues (a backlog must not expire
        # jobs that never ran); queue_timeout_s, when set, bounds the queues.
        remaining_s = job.timeout_s - active_s(env, stage)
        if job.queue_timeout_s is not None and queued_s(env, stage) > job.queue_timeout_s:
            return await self._end(src, env, "failed", f"job waited {queued_s(env, stage):.1f} s in queues "
                                   f"(up to {stage}), over its queue_timeout_s={job.queue_timeout_s:g}; it never ran")
        try:
            if remaining_s <= 0:
                raise asyncio.TimeoutError
            self._processing.add(src.msg_id)
            self._set_deadline(src.msg_id, remaining_s)
            outcome = await self.stage.process(env, self.ctx.task_context(lambda: self._cancelled(job)))
        except asyncio.TimeoutError:
            return await self._give_up(src, env, f"job timed out in {stage}: over its timeout_s={job.timeout_s} "
                                       "of time at work in stages")
        except JobCancelled as exc:
            return await self._end(src, env, "cancelled", str(exc) or "cancelled")
        except (InvalidJob, ValidationError) as exc:
            return await self._give_up(src, env, f"{type(exc).__name__}: {exc}", failure="job")
        except JobFailed as exc:
            if not exc.retryable:
                return await self._give_up(src, env, str(exc), failure=exc.failure)
            return await self._retry(src, env, str(exc), failure=exc.failure)
        except asyncio.CancelledError:
            why = self._cancel_reasons.get(src.msg_id)
            if why is None:
                raise
            if why == "shutdown":
                return await self._hand_back(src, env)
            if why is _TIMED_OUT:
                return await self._give_up(src, env, f"job timed out in {stage}: over its timeout_s={job.timeout_s} "
                                           "of time at work in stages")
            return await self._end(src, env, "cancelled", why)
        except Exception as exc:
            log.exception("job %s failed in %s", job.job_id, stage)
            return await self._retry(src, env, f"{type(exc).__name__}: {exc}")
        finally:
            self._processing.discard(src.msg_id)
            self._deadlines.pop(src.msg_id, None)
        env.timings_s[f"{stage}_s"] = time.time() - started
        # The reader, when no read holds it: the hand-off then goes out with the next read.
        via = self._reader if not self._reader_blocked else None
        if isinstance(outcome, Forward):
            to_stream = self.ctx.keys.stage_stream(outcome.stage, self.ctx.node)
            try:
                moved = await self.ctx.handoff.forward(src, env, to_stream, outcome.stage, via=via)
            except JobCancelled as exc:  # cancelled while this stage worked: it goes no further
                return await self._end(src, env, "cancelled", str(exc))
            if moved and self.stage.limits_by_node_sandboxes and sandbox_of(env):
                self._forwards_since_read += 1  # it counts against the node now
        else:
            outcome.timings_s = env.timings_s
            # Eval tore the sandbox down; it stops counting in the same script.
            moved = await self.ctx.handoff.finish(src, outcome, count=self.ctx.handoff.sandbox_gone(env), via=via)
            if moved:
                for key, seconds in histograms.result_latencies(self.ctx.keys, outcome):
                    self.observations.observe(key, seconds)
        if not moved:
            log.warning("job %s: %s finished after another worker reclaimed it; dropped this copy",
                        job.job_id, stage)

    def _set_deadline(self, msg_id: str, remaining_s: float) -> None:
        loop = asyncio.get_running_loop()
        due = self._deadlines[msg_id] = loop.time() + remaining_s
        timer = self._deadline_timer
        if timer is None or due < timer.when():
            if timer is not None:
                timer.cancel()
            self._deadline_timer = loop.call_at(due, self._expire_deadlines)

    def _expire_deadlines(self) -> None:
        """Interrupt the jobs whose timeout ran out; wait for the next deadline."""
        self._deadline_timer = None
        loop = asyncio.get_running_loop()
        now, earliest = loop.time(), None
        for msg_id, due in list(self._deadlines.items()):
            if due > now:
                earliest = due if earliest is None else min(earliest, due)
                continue
            del self._deadlines[msg_id]
            held = self.inflight.get(msg_id)
            if held is not None and msg_id in self._processing and msg_id not in self._cancel_reasons:
                self._cancel_reasons[msg_id] = _TIMED_OUT
                held[0].cancel()
        if earliest is not None:
            self._deadline_timer = loop.call_at(earliest, self._expire_deadlines)

    async def _cancelled(self, job) -> str | None:
        """For tasks that check between steps (the agent loop between turns)."""
        return self.book.reason(job) or await cancel.check(self.r, self.ctx.keys, job)

    async def _release(self, env: Envelope) -> SandboxCount | None:
        """Tear down what the job holds on this node; returns the sandbox count change for
        the hand-off that follows (which applies it atomically with the move)."""
        try:
            await self.stage.release(env)
        except Exception:
            log.exception("job %s: freeing its resources failed", env.job.job_id)
        return self.ctx.handoff.sandbox_gone(env)

    async def _end(self, src: Source, env: Envelope, status: str, reason: str) -> None:
        count = await self._release(env)
        await self.ctx.handoff.finish(src, ended_result(env, status, reason, self.stage.name), count=count)

    async def _give_up(self, src: Source, env: Envelope, error: str, failure: str = "infrastructure") -> None:
        count = await self._release(env)
        history = "; earlier attempts: " + " | ".join(env.errors) if env.errors else ""
        letter = DeadLetter(job_id=env.job.job_id, submitter=env.job.submitter, stage=self.stage.name,
                            error=error + history, envelope=env)
        log.warning("job %s dead-lettered in %s: %s", env.job.job_id, self.stage.name, error)
        await self.ctx.handoff.dead_letter(src, letter, ended_result(env, "failed", error + history, self.stage.name,
                                                                    failure), count=count)

    async def _retry(self, src: Source, env: Envelope, error: str, failure: str = "infrastructure") -> None:
        """Free the node's resources and start the job over from init, unless it has had
        all its attempts."""
        count = await self._release(env)
        env.errors.append(f"{self.stage.name}: {error}")
        if env.attempt + 1 >= self.s.max_deliveries:
            env.errors.pop()
            return await self._give_up(src, env, f"{error} (attempt {env.attempt + 1} of {self.s.max_deliveries})",
                                       failure)
        restarted = env.model_copy(update={"attempt": env.attempt + 1, "sandbox": None, "state": {},
                                           "trajectory": None, "node": None})
        await self.ctx.handoff.requeue(src, restarted, self.ctx.keys.init_stream, "init", error, count=count)

    async def _hand_back(self, src: Source, env: Envelope) -> None:
        count = await self._release(env)
        fresh = env.model_copy(update={"sandbox": None, "state": {}, "trajectory": None, "node": None})
        await self.ctx.handoff.requeue(src, fresh, self.ctx.keys.init_stream, "init",
                                       f"handed back by {self.consumer} at shutdown", count=count)

    async def _undecodable(self, src: Source, fields: dict, exc: Exception) -> None:
        letter, result = malformed_message(fields, exc, self.stage.name)
        log.warning("message %s on %s dead-lettered: %s", src.msg_id, src.stream, letter.error)
        await self.ctx.handoff.dead_letter(src, letter, result)

    # -- background duties -------------------------------------------------------------
    async def _flush_observations(self, final: bool = False) -> None:
        try:
            await self.observations.flush(self.r)
        except (redis.RedisError, OSError) as exc:
            if not final:
                raise
            log.warning("%s: latency observations not added to the histograms at exit: %s", self.consumer, exc)

    async def _heartbeat(self) -> None:
        now = time.time()
        ids = list(self.inflight)
        keys = self.ctx.keys
        async with self.r.pipeline(transaction=False) as pipe:
            if ids:  # resetting idle time tells reclaimers these are alive
                pipe.xclaim(self.stream, self.group, self.consumer, 0, ids, justid=True)
            pipe.zadd(keys.workers, {self.consumer: now})
            # Workers that stopped heart-beating (killed, their machine gone) leave the list.
            pipe.zremrangebyscore(keys.workers, "-inf", now - self.s.worker_ttl_s)
            pipe.zadd(keys.nodes, {self.ctx.node: now})
            pipe.hset(keys.worker(self.consumer), mapping={
                "stage": self.stage.name, "node": self.ctx.node, "pid": os.getpid(), "concurrency": self.concurrency,
                "inflight": len(ids), "processed": self.processed, "heartbeat_at": now,
                "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0]})
            pipe.expire(keys.worker(self.consumer), int(self.s.worker_ttl_s * 3) + 1)
            await pipe.execute()
        self.outage.recovered()  # Redis took these writes (a read loop held by back-pressure may not tell)

    async def _reclaim(self) -> None:
        free = self.concurrency - len(self.inflight)
        if free <= 0 or self._stopping.is_set():
            return
        claimed, deleted = await autoclaim(self.r, self.stream, self.group, self.consumer,
                                           int(self.s.visibility_timeout_s * 1000), free)
        if deleted:
            await self.r.xack(self.stream, self.group, *deleted)
        if not claimed:
            return
        # Delivery counts of everything claimed, in one round trip (off the critical path).
        async with self.r.pipeline(transaction=False) as pipe:
            for msg_id, _fields in claimed:
                pipe.xpending_range(self.stream, self.group, min=_id(msg_id), max=_id(msg_id), count=1)
            infos = await pipe.execute()
        entries = []
        for (msg_id, fields), info in zip(claimed, infos):
            msg_id = _id(msg_id)
            deliveries = info[0]["times_delivered"] if info else self.s.max_deliveries + 1
            log.info("%s reclaimed %s (delivery %d)", self.consumer, msg_id, deliveries)
            entries.append((msg_id, fields or {}, deliveries))
        self._admit(entries)

    async def _follow_cancellations(self) -> None:
        """Tail the cancellation notices: the book learns them within a round trip, and
        jobs already at work are interrupted at once."""
        while not self._stopping.is_set():
            try:
                if await self.book.catch_up(self.r, self.ctx.keys, block_ms=self.s.read_block_ms):
                    self._interrupt(self.book.reason)
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc):
                    await asyncio.sleep(self.outage.failed(exc))
                    continue
                log.warning("%s: following cancellations failed (%s); retrying in 1 s", self.consumer, exc)
                await asyncio.sleep(1.0)
            raise_if_cancelled()

    def _interrupt(self, reason_of) -> None:
        for msg_id, (task, env) in list(self.inflight.items()):
            if env is None or msg_id not in self._processing or msg_id in self._cancel_reasons:
                continue
            reason = reason_of(env.job)
            if reason:
                self._cancel_reasons[msg_id] = reason
                task.cancel()

    async def _watch_cancellations(self) -> None:
        """Backstop to the notices: flags raised without one (by hand with redis-cli) still
        stop jobs at work within a second."""
        jobs = [(m, env.job) for m, (_t, env) in list(self.inflight.items())
                if env is not None and m in self._processing and m not in self._cancel_reasons]
        if not jobs:
            return
        reasons = await cancel.check_many(self.r, self.ctx.keys, [job for _m, job in jobs])
        for (msg_id, _job), reason in zip(jobs, reasons):
            if reason and msg_id in self._processing:
                self._cancel_reasons[msg_id] = reason
                self.inflight[msg_id][0].cancel()

    async def _drain(self) -> None:
        if self.inflight:
            log.info("%s stopping: %d jobs in flight, %ss grace", self.consumer, len(self.inflight),
                     self.s.shutdown_grace_s)
            tasks = [t for t, _e in self.inflight.values()]
            _done, pending = await asyncio.wait(tasks, timeout=self.s.shutdown_grace_s)
            for msg_id, (task, _env) in list(self.inflight.items()):
                if task in pending:
                    if msg_id in self._processing:  # hand the job back (see _run_job)
                        self._cancel_reasons[msg_id] = "shutdown"
                    task.cancel()  # anything else stays pending in Redis and is reclaimed
            if pending:
                _done, stuck = await asyncio.wait(pending, timeout=10.0)
                if stuck:
                    log.error("%s: %d jobs did not stop; their messages stay pending for reclaim",
                              self.consumer, len(stuck))

    async def _deregister(self) -> None:
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.zrem(self.ctx.keys.workers, self.consumer)
                pipe.delete(self.ctx.keys.worker(self.consumer))
                await pipe.execute()
            await remove_idle_consumer(self.r, self.stream, self.group, self.consumer)
        except (redis.RedisError, OSError) as exc:
            log.warning("%s: could not deregister (%s)", self.consumer, exc)
