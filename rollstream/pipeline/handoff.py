"""Stage hand-off: the moves a job makes between streams (forward it to the next stage, finish
it into its submitter's results stream, dead-letter it, requeue it at init), each recorded by
one atomic Lua script together with the acknowledgement of the message it came from, the
update of its state hash, the node's sandbox count and (forwarding) the authoritative check of
its cancellation flags. workers/fate.py decides which move; ``Handoff.record`` makes it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollstream.errors import JobCancelled
from rollstream.messages import INIT_STAGE, STAGES, DeadLetter, Envelope, Job, Result, StageName
from rollstream.pipeline import cancel
from rollstream.pipeline.codec import pack
from rollstream.pipeline.connection import refused_write
from rollstream.pipeline.jobstate import JobStateFields, hash_args
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.replication import ReplicasBehind, script_then_wait
from rollstream.pipeline.wire import FastRedis

log = logging.getLogger(__name__)

_SCRIPT = resources.files("rollstream.pipeline").joinpath("lua/transition.lua").read_text()


@dataclass(frozen=True)
class Source:
    """Where a message came from and who holds it."""

    stream: str
    group: str
    msg_id: str
    consumer: str = ""  # '' skips the ownership check
    started_at: float = 0.0  # when the stage started the job: written as <stage>_started_at
    queued_at: float = 0.0  # when the job was queued for the stage (priorities.queued_at)


@dataclass(frozen=True)
class SandboxCount:
    """A change to the node's live-sandbox set (init's back-pressure), applied by the same
    script as the move so that the count never drifts from where the jobs are."""

    op: str  # 'SADD' or 'SREM'
    node: str
    sandbox_id: str


def sandbox_of(env: Envelope) -> str:
    return env.sandbox.id if env.sandbox else ""


def _sandbox_gone(leaving: Envelope | None) -> SandboxCount | None:
    """The count change for a job that leaves its node, its sandbox torn down (None if it had none)."""
    if leaving is None or not leaving.node or not (sandbox_id := sandbox_of(leaving)):
        return None
    return SandboxCount("SREM", leaving.node, sandbox_id)


# The moves, as workers/fate.py decides them and ``Handoff.record`` makes them.
@dataclass(frozen=True)
class Forward:
    """On to ``stage``'s stream on this node (what a stage returns when it is done with a job)."""

    stage: StageName


@dataclass(frozen=True)
class Finish:
    """The job's one result, to its submitter's results stream."""

    result: Result


@dataclass(frozen=True)
class DeadLetterJob:
    """The job to the dead letters and, when its submitter is known, its failed result."""

    letter: DeadLetter
    result: Result | None


@dataclass(frozen=True)
class Requeue:
    """Back to init, as ``env`` (the job as init takes it again); ``reason`` goes to its state."""

    env: Envelope
    reason: str


Move = Forward | Finish | DeadLetterJob | Requeue


class Handoff:
    """The only place that moves jobs between streams."""

    def __init__(self, r: aioredis.Redis, keys: Keys, *, state_ttl_s: int,
                 results_maxlen: int, dead_maxlen: int, replica_acks: int = 0, replica_ack_timeout_ms: int = 1000):
        self.r = r
        # Each move counts once this many replicas hold it (replication.py): 0, at once.
        self.replica_acks, self.replica_ack_timeout_ms = replica_acks, replica_ack_timeout_ms
        self.keys = keys
        self.state_ttl_s = state_ttl_s
        self.results_maxlen = results_maxlen
        self.dead_maxlen = dead_maxlen
        self._script = r.register_script(_SCRIPT)
        self._fast = FastRedis.from_client(r)  # the script is the one awaited call per hop
        # Called with a refusal (MISCONF: Redis's disk is full; READONLY, OOM, LOADING): a
        # refused script did not run, so it is sent again once this returns True.
        self.wait_out: Callable[[BaseException], Awaitable[bool]] | None = None

    async def aclose(self) -> None:
        if self._fast is not None:
            await self._fast.close()

    async def record(self, src: Source, move: Move, held: Envelope | None, *, node: str = "",
                     via: FastRedis | None = None) -> bool:
        """Make ``move`` for the message ``src``, whose job this stage holds as ``held`` (None:
        a message that is no job), on ``node``. A job leaving the node stops counting its
        sandbox against it in the same script; one forwarded out of init starts to. False if
        this consumer no longer owns the message; ``JobCancelled`` as for ``forward``."""
        if isinstance(move, Forward):
            assert held is not None, "only a job is forwarded"
            return await self.forward(src, held, self.keys.stage_stream(move.stage, node), move.stage, via=via)
        if isinstance(move, Finish):
            return await self.finish(src, move.result, leaving=held, via=via)
        if isinstance(move, DeadLetterJob):
            return await self.dead_letter(src, move.letter, move.result, leaving=held)
        return await self.requeue(src, move.env, move.reason, leaving=held)

    async def _move(self, src: Source, job_id: str, state: JobStateFields, dests: list[tuple[str, int, bytes]],
                    *, ttl_s: int = 0, stat: str = "", count: SandboxCount | None = None,
                    refuse_if_cancelled: Job | None = None, via: FastRedis | None = None) -> int:
        stage: StageName | None = next((s for s in STAGES if s == src.group), None)  # else a client's move
        if state and src.consumer:
            state.setdefault("worker", src.consumer)
        started = (stage, src.started_at) if state and src.started_at and stage is not None else None
        flat = hash_args(state, started)
        job = refuse_if_cancelled
        flags = cancel.flag_keys(self.keys, job) if job else [self.keys.job(job_id)] * 3
        keys = [src.stream, self.keys.job(job_id), self.keys.stats(stage or "client"),
                self.keys.node_sandboxes(count.node) if count else self.keys.job(job_id), *flags,
                *(d[0] for d in dests)]
        args: list = [src.group, src.msg_id, src.consumer, ttl_s, stat,
                      count.op if count else "", count.sandbox_id if count else "",
                      repr(job.submitted_at) if job else "", "1" if job and job.group_id else "",
                      len(flat) // 2, len(dests), *flat]
        for _, maxlen, payload in dests:
            args += [maxlen, payload]
        if self.replica_acks and src.consumer:  # sent again until confirmed: only a move the owner check guards
            return await self._move_replicated(keys, args)
        while True:
            try:
                return await self._run_script(keys, args, via)
            except ResponseError as exc:
                if self.wait_out is None or not refused_write(exc) or not await self.wait_out(exc):
                    raise
                via = None

    async def _move_replicated(self, keys: list, args: list) -> int:
        """The move, then WAIT until ``replica_acks`` replicas hold it. Until they confirm, the
        script is sent again (with the WAIT): on the same primary it finds the message moved
        (0) and the WAIT covers the first move; on a primary promoted without it, it moves it
        there. So is one whose connection was lost (a primary killed, or left for the one the
        Sentinels name now): the owner check makes sending it twice harmless. Never on the
        reader's connection: a WAIT would hold up the next read."""
        moved = 0
        while True:
            try:
                code, confirmed = await script_then_wait(self.r, self._fast, _SCRIPT, keys, args,
                                                         acks=self.replica_acks,
                                                         timeout_ms=self.replica_ack_timeout_ms)
                code = int(code)
                moved = moved or (1 if code == 1 else 0)
                if confirmed < self.replica_acks and moved:
                    raise ReplicasBehind(code, confirmed, self.replica_acks, self.replica_ack_timeout_ms)
                return code or moved
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if self.wait_out is None or not await self.wait_out(exc):
                    raise
            except ResponseError as exc:
                if self.wait_out is not None and refused_write(exc) and await self.wait_out(exc):
                    continue
                if not isinstance(exc, ReplicasBehind):
                    raise
                log.warning("a hand-off is on the primary but unconfirmed by replicas as this worker stops: %s", exc)
                return moved

    async def _run_script(self, keys: list, args: list, via: FastRedis | None) -> int:
        if via is not None:
            try:
                return int(await via.evalsha(_SCRIPT, keys, args, load=False))
            except NoScriptError:  # Redis restarted: load it on our own connection, which no read holds
                pass
        if self._fast is not None:
            return int(await self._fast.evalsha(_SCRIPT, keys, args))
        return int(await self._script(keys=keys, args=args))

    async def forward(self, src: Source, env: Envelope, to_stream: str, to_stage: StageName, *,
                      via: FastRedis | None = None) -> bool:
        """Acknowledge ``src`` and queue the job on the next stage's stream; False if this
        consumer no longer owns the message. Raises ``JobCancelled`` (and moves nothing: the
        message stays pending with the caller, who ends the job) if the job was cancelled:
        a cancelled job never reaches the next stage. ``via``: a connection to send the
        script on instead of the hand-off's own (one that no blocking command holds)."""
        state = JobStateFields(stage=to_stage, status="queued", node=env.node or "", attempts=env.attempt + 1)
        sandbox_id = sandbox_of(env)
        if sandbox_id:
            state["sandbox"] = sandbox_id
        # A sandbox leaving init starts counting against its node, atomically with the move.
        count = SandboxCount("SADD", env.node or "", sandbox_id) if sandbox_id and src.group == INIT_STAGE else None
        code = await self._move(src, env.job.job_id, state, [(to_stream, 0, pack(env))], stat="forwarded",
                                count=count, refuse_if_cancelled=env.job, via=via)
        if code > 1:
            raise JobCancelled(cancel.reason_for_code(env.job, code))
        return code == 1

    async def finish(self, src: Source, result: Result, *, leaving: Envelope | None = None,
                     via: FastRedis | None = None) -> bool:
        """Acknowledge ``src`` and deliver the job's one result (and stop counting the sandbox
        of the job ``leaving`` its node against it; ``via`` as for ``forward``)."""
        state = JobStateFields(stage="done", status=result.status, finished_at=result.finished_at,
                               error=result.error or "", attempts=result.attempts)
        if result.reward is not None:
            state["reward"] = result.reward
        if result.failure is not None:
            state["failure"] = result.failure
        dests = [(self.keys.results(result.submitter), self.results_maxlen, pack(result))]
        return await self._move(src, result.job_id, state, dests, ttl_s=self.state_ttl_s, stat=result.status,
                                count=_sandbox_gone(leaving), via=via) == 1

    async def dead_letter(self, src: Source, letter: DeadLetter, result: Result | None, *,
                          leaving: Envelope | None = None) -> bool:
        """Acknowledge ``src``, record the dead letter and, when the submitter is known,
        deliver a failed result so it never waits in silence."""
        dests = [(self.keys.dead, self.dead_maxlen, pack(letter))]
        state = JobStateFields(stage="dead", status="failed", error=letter.error, finished_at=time.time())
        if result is not None:
            dests.append((self.keys.results(result.submitter), self.results_maxlen, pack(result)))
            if result.failure is not None:
                state["failure"] = result.failure
        job_id = letter.job_id or f"undecodable-{src.msg_id}"
        if letter.job_id is None:
            state = JobStateFields()
        return await self._move(src, job_id, state, dests, ttl_s=self.state_ttl_s if state else 0, stat="dead",
                                count=_sandbox_gone(leaving)) == 1

    async def requeue(self, src: Source, env: Envelope, reason: str, *, leaving: Envelope | None = None) -> bool:
        """Acknowledge ``src`` and put the job on init's stream again (a retry, or work handed
        back by a worker that is shutting down or a node that died)."""
        state = JobStateFields(stage=INIT_STAGE, status="queued", attempts=env.attempt + 1, last_error=reason[:2000])
        return await self._move(src, env.job.job_id, state, [(self.keys.init_stream, 0, pack(env))],
                                stat="requeued", count=_sandbox_gone(leaving)) == 1
