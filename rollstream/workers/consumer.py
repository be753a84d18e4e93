"""The consumer loop every stage worker runs: read its stream through a consumer group,
keep N jobs in flight, keep them fresh with heartbeats (membership.py), reclaim what dead
workers left, and hand each job on through ``pipeline.handoff``. SIGTERM or a drain of its
node (pipeline/drain.py) stops it; heartbeats go on until its jobs are let go. fate.py
decides how a job leaves that its stage does not hand on; cancellations.py and deadlines.py
interrupt work in a stage. A stage hop costs one wake-up and one awaited round trip (the
hand-off script); the "running" mark goes off the critical path (running_marks.py), and a
finished job's latencies join the shared histograms with the process's next flush."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from typing import cast

import redis
from pydantic import ValidationError

from rollstream.errors import InvalidJob, JobCancelled
from rollstream.messages import Envelope
from rollstream.pipeline import histograms
from rollstream.pipeline.codec import DecodeError, decode_envelope
from rollstream.pipeline.connection import SOCKET_TIMEOUT_S, Outage, raise_if_cancelled, transient_problem
from rollstream.pipeline.groups import ensure_group
from rollstream.pipeline.handoff import Finish, Forward, Move, Source, sandbox_of
from rollstream.pipeline.jobstate import JobStateFields, RunningMark, entry_token
from rollstream.pipeline.priorities import feed, feed_command, queued_at
from rollstream.pipeline.rescue import rescue_dead_nodes
from rollstream.pipeline.wire import FastRedis, StreamReply, stream_entries
from rollstream.workers.cancellations import Cancellations
from rollstream.workers.deadlines import TIMED_OUT, Deadlines
from rollstream.workers.fate import Fate
from rollstream.workers.letting_go import LettingGo
from rollstream.workers.membership import Membership, message_id
from rollstream.workers.running_marks import LateRunningMarks
from rollstream.workers.sandbox_slots import SandboxSlots
from rollstream.workers.stage import Stage, WorkerContext

log = logging.getLogger(__name__)


class ConsumerLoop:
    """One stage's worker: up to ``concurrency`` jobs in flight, each in its own task."""

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
        # message id -> (its task, its envelope; None for a message that is no job)
        self.inflight: dict[str, tuple[asyncio.Task, Envelope | None]] = {}
        self.membership = Membership(ctx, stage.name, self.stream, self.consumer, self.concurrency, self.outage)
        self.cancels = Cancellations(self.r, ctx.keys, self.inflight, outage=self.outage, consumer=self.consumer,
                                     ttl_s=self.s.job_state_ttl_s, read_block_ms=self.s.read_block_ms)
        self.deadlines = Deadlines(on_due=lambda msg_id: self.cancels.interrupt(msg_id, TIMED_OUT))
        self.fate = Fate(stage, ctx, self.consumer)
        self._stopping = asyncio.Event()
        self._let_go = asyncio.Event()  # set once in-flight jobs finished or went back: heartbeats end
        self.letting_go = LettingGo(self.membership, self.consumer, self._stopping, self.stop, self._heartbeat,
                                    self.inflight)
        self._slot_freed = asyncio.Event()
        self.processed = 0
        self.running_marks = LateRunningMarks(self.r, ctx.keys, outage=self.outage, consumer=self.consumer)
        # The wake-up read, on its own connection. Between a read's reply and the next read,
        # jobs that finish at once send their hand-off on it too: a batch's corked with that
        # next read, a lone job's at once (see _read_loop).
        self._reader = FastRedis.from_client(self.r)
        self._reader_blocked = False
        # The node's sandbox slots, for a stage that pulls work only while some are free.
        self.sandbox_slots = (SandboxSlots(self.r, self._reader, ctx.keys, ctx.node, self.s)
                              if stage.limits_by_node_sandboxes else None)
        self.observations = histograms.Observations()

    # -- lifecycle ---------------------------------------------------------------------
    def stop(self) -> None:
        """Stop pulling work; in-flight jobs get ``shutdown_grace_s`` to finish."""
        self._stopping.set()

    def terminate(self) -> None:
        """SIGTERM: let go of this worker's jobs within ``shutdown_grace_s`` (letting_go.py)."""
        self.letting_go.by(time.time() + self.s.shutdown_grace_s)

    async def _register(self) -> None:
        """Create the group and announce this worker, riding out a Redis that restarts."""
        while True:
            try:
                await self.membership.join()
                # Cancels issued before this worker started must hold for its first read.
                await self.cancels.catch_up()
                return
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc) is None:
                    raise
                await asyncio.sleep(self.outage.failed(exc))

    async def serve(self) -> None:
        await self._register()
        background = [asyncio.create_task(self._every(self.s.heartbeat_interval_s, self._heartbeat, self._let_go)),
                      asyncio.create_task(self._every(max(self.s.visibility_timeout_s / 4, 0.2), self._reclaim)),
                      asyncio.create_task(self.cancels.follow(self._stopping)),
                      asyncio.create_task(self._every(1.0, self.cancels.watch)),
                      asyncio.create_task(self._every(histograms.FLUSH_S, self._flush_observations))]
        if self.stage.rescues_dead_nodes:
            background.append(asyncio.create_task(self._every(max(self.s.worker_ttl_s / 2, 0.5), self._rescue)))
        log.info("worker %s serving %s with %d slots", self.consumer, self.stream, self.concurrency)
        try:
            await self._read_loop()
        finally:
            await self._drain()
            self._let_go.set()
            await self._flush_observations(final=True)
            background += self.letting_go.tasks
            for task in background:
                task.cancel()
            self.running_marks.stop()
            self.deadlines.close()
            await asyncio.gather(*background, return_exceptions=True)
            await self.membership.leave()
            await self.membership.hand_back_node_if_last(self.ctx)
            if self._reader is not None:
                await self._reader.close()
            await self.running_marks.aclose()
            await self.ctx.handoff.aclose()

    async def _heartbeat(self) -> None:
        deadline = await self.membership.heartbeat(list(self.inflight), self.processed, self.letting_go.draining)
        if deadline is not None:
            self.letting_go.node_drain_heard(deadline)

    async def _rescue(self) -> None:
        """Move jobs of dead nodes back to init. Not while Redis refuses writes, nor within
        worker_ttl_s after: every node's heartbeat went stale with the outage, and a live node
        needs a heartbeat to show it lives."""
        if self.outage.within(self.s.worker_ttl_s):
            return
        await rescue_dead_nodes(self.ctx.redis, self.ctx.keys, self.ctx.handoff, self.s, self.consumer)

    async def _every(self, period_s: float, fn, until: asyncio.Event | None = None) -> None:
        until = until or self._stopping
        while not until.is_set():
            try:
                await fn()
            except (redis.RedisError, OSError) as exc:
                if transient_problem(exc):
                    self.outage.failed(exc)
                else:
                    log.warning("%s: background step %s failed: %s", self.consumer, getattr(fn, "__name__", fn), exc)
            raise_if_cancelled()
            try:
                await asyncio.wait_for(until.wait(), period_s)
            except TimeoutError:
                pass

    async def _flush_observations(self, final: bool = False) -> None:
        try:
            await self.observations.flush(self.r)
        except (redis.RedisError, OSError) as exc:
            if not final:
                raise
            log.warning("%s: latency observations not added to the histograms at exit: %s", self.consumer, exc)

    # -- reading and claiming ----------------------------------------------------------
    async def _free_slots(self) -> int:
        free = self.concurrency - len(self.inflight)
        if self.sandbox_slots is not None and free > 0:
            free = await self.sandbox_slots.free(free, len(self.inflight))
        return free

    async def _read_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                free = await self._free_slots()
                if free <= 0:
                    self._slot_freed.clear()
                    try:
                        await asyncio.wait_for(self._slot_freed.wait(), 0.2)
                    except TimeoutError:
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
            if self.stage.serves_by_priority:
                await feed(self.r, self.ctx.keys, count)
            resp = cast(StreamReply, await self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                                             count=count, block=block))
            return [(message_id(m), f, 1) for _stream, items in resp or [] for m, f in items]
        commands = [("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block,
                     "STREAMS", self.stream, ">")]
        if self.stage.serves_by_priority:  # the best-ranked waiting jobs onto the stream, then read them
            commands.insert(0, feed_command(self.ctx.keys, count))
        slots = self.sandbox_slots
        if slots is not None:  # the node's sandbox count for the next read's back-pressure, in the same write
            commands.insert(0, slots.read_command())
        self._reader_blocked = True
        try:
            replies = await self._reader.execute_many(commands, timeout_s=block / 1000 + SOCKET_TIMEOUT_S,
                                                      uncork=True)
        finally:
            self._reader_blocked = False
        if slots is not None:
            slots.counted(replies[0])
        return [(message_id(m), f, 1) for m, f in stream_entries(replies[-1])]

    def _admit(self, entries: list[tuple[str, dict, int]]) -> None:
        """Start a batch of messages, each as its own task, with no round trip: the
        cancellation check reads the in-memory book (the hand-off script re-checks the
        flags), and the "running" marks of those still at work a little later go out in one
        pipeline that nobody waits for (running_marks.py). Messages stay pending with us
        until their hand-off."""
        started = time.time()
        stage = self.stage.name
        marks = self.running_marks.unsent
        for msg_id, fields, deliveries in entries:
            if msg_id in self.inflight:
                continue
            src = Source(self.stream, self.group, msg_id, self.consumer, started_at=started,
                         queued_at=queued_at(msg_id, fields))
            try:
                env = decode_envelope(fields)
                if problem := self.stage.admission_problem(env):
                    raise InvalidJob(f"job {env.job.job_id}: {problem}")
            except (DecodeError, ValidationError, InvalidJob) as exc:
                move = self.fate.undecodable(src, fields, exc)
                self._track(msg_id, None, self._guard(src, None, self._record(src, None, move)))
                continue
            running = JobStateFields(stage=stage, status="running", worker=self.consumer, node=self.ctx.node)
            marks[msg_id] = RunningMark(env.job.job_id, entry_token(self.stream, msg_id), running, (stage, started))
            self._track(msg_id, env, self._guard(src, env, self._run_job(src, env, deliveries)))
        self.running_marks.send_soon()

    def _track(self, msg_id: str, env: Envelope | None, coro) -> None:
        task = asyncio.create_task(coro)
        self.inflight[msg_id] = (task, env)
        task.add_done_callback(functools.partial(self._done, msg_id))

    def _done(self, msg_id: str, _task: asyncio.Task) -> None:
        self.inflight.pop(msg_id, None)
        self.cancels.reasons.pop(msg_id, None)
        self.running_marks.left(msg_id)
        self.processed += 1
        self._slot_freed.set()

    async def _reclaim(self) -> None:
        free = self.concurrency - len(self.inflight)
        if free > 0 and not self._stopping.is_set() and (entries := await self.membership.reclaim(free)):
            self._admit(entries)

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
            await self._record(src, env, await self.fate.cannot_carry_on(env, exc))

    async def _wait_out(self, exc: BaseException) -> bool:
        """A hand-off that Redis refused (it did not run): wait, and say whether to send it
        again (not once this worker is stopping: the job then stays pending for reclaim)."""
        if self._stopping.is_set():
            return False
        delay = self.outage.failed(exc)
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
            return False
        except TimeoutError:
            return True

    async def _run_job(self, src: Source, env: Envelope, deliveries: int) -> None:
        """One job: the checks before work, the stage's work, and the one move that follows
        (fate.py decides how a job leaves that its stage does not hand on)."""
        move = await self.fate.before_work(src, env, deliveries, self.cancels.book.reason(env.job))
        if move is None:
            move = await self._work(src, env)
        # The reader, when no read holds it: the hand-off then goes out with the next read.
        via = self._reader if not self._reader_blocked else None
        try:
            moved = await self._record(src, env, move, via=via)
        except JobCancelled as exc:  # cancelled while this stage worked: it goes no further
            moved = await self._record(src, env, await self.fate.finish(env, "cancelled", str(exc)))
        if not moved and isinstance(move, (Forward, Finish)):
            log.warning("job %s: %s finished after another worker reclaimed it; dropped this copy",
                        env.job.job_id, self.stage.name)

    async def _work(self, src: Source, env: Envelope) -> Move:
        """The stage's work on the job, within what is left of its time; its move."""
        left_s, at_work = self.fate.time_left_s(env), self.cancels.at_work
        try:
            if left_s <= 0:
                raise TimeoutError
            at_work.add(src.msg_id)
            self.deadlines.set(src.msg_id, left_s)
            outcome = await self.stage.process(env, self.ctx.task_context(lambda: self.cancels.check(env.job)))
        except asyncio.CancelledError:
            why = self.cancels.reasons.get(src.msg_id)
            if why is None:
                raise
            return await self.fate.interrupted(env, why)
        except Exception as exc:  # a timeout, a cancellation, the job's fault or the service's
            return await self.fate.failed(env, exc)
        finally:
            at_work.discard(src.msg_id)
            self.deadlines.clear(src.msg_id)
        env.timings_s[f"{self.stage.name}_s"] = time.time() - src.started_at
        if isinstance(outcome, Forward):
            return outcome
        outcome.timings_s = env.timings_s
        return Finish(outcome)

    async def _record(self, src: Source, env: Envelope | None, move: Move, via=None) -> bool:
        """Make the move (pipeline/handoff.py), and count what it did on this node: a sandbox
        forwarded out of init (with its sandbox, if any), a result's latencies."""
        moved = await self.ctx.handoff.record(src, move, env, node=self.ctx.node, via=via)
        if moved and isinstance(move, Forward) and self.sandbox_slots is not None and env:
            self.sandbox_slots.forwarded(with_sandbox=bool(sandbox_of(env)))
        elif moved and isinstance(move, Finish) and move.result.ok:
            for key, seconds in histograms.result_latencies(self.ctx.keys, move.result):
                self.observations.observe(key, seconds)
        return moved

    # -- shutdown ----------------------------------------------------------------------
    async def _drain(self) -> None:
        if self.inflight:
            grace_s = self.letting_go.grace_s(self.s.shutdown_grace_s)
            log.info("%s stopping: %d jobs in flight, %.1fs grace", self.consumer, len(self.inflight), grace_s)
            tasks = [t for t, _e in self.inflight.values()]
            _done, pending = await asyncio.wait(tasks, timeout=grace_s)
            for msg_id, (task, _env) in list(self.inflight.items()):
                if task in pending:
                    if msg_id in self.cancels.at_work:  # hand the job back (see _run_job)
                        self.cancels.reasons[msg_id] = "shutdown"
                    task.cancel()  # anything else stays pending in Redis and is reclaimed
            if pending:
                _done, stuck = await asyncio.wait(pending, timeout=10.0)
                if stuck:
                    log.error("%s: %d jobs did not stop; their messages stay pending for reclaim",
                              self.consumer, len(stuck))
