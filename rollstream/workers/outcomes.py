"""How a job leaves a stage when its stage does not hand it on: ended (cancelled, or failed
for good), dead-lettered, started over from init while it has attempts left, or handed
back at shutdown. Each frees what the job holds on this node first, and the node's sandbox
count changes in the same script as the move (``pipeline.handoff``)."""

from __future__ import annotations

import asyncio
import logging

from pydantic import ValidationError

from rollstream.errors import InvalidJob, JobCancelled, JobFailed
from rollstream.messages import INIT_STAGE, DeadLetter, Envelope, FailureKind, Result, ResultStatus
from rollstream.pipeline.handoff import SandboxCount, Source
from rollstream.workers.deadlines import TIMED_OUT, timed_out
from rollstream.workers.malformed import malformed_message
from rollstream.workers.stage import Stage, WorkerContext, ended_result

log = logging.getLogger(__name__)


def _from_init(env: Envelope, **update) -> Envelope:
    """The job as init takes it again: nothing this node made for it (sandbox, state,
    trajectory, node) goes with it."""
    return env.model_copy(update={"sandbox": None, "state": {}, "trajectory": None, "node": None, **update})


class Outcomes:
    def __init__(self, stage: Stage, ctx: WorkerContext, consumer: str):
        self.stage = stage
        self.ctx = ctx
        self.handoff = ctx.handoff
        self.consumer = consumer

    async def failed(self, src: Source, env: Envelope, exc: Exception) -> None:
        """The stage's work on the job raised ``exc`` (called while handling it): a job that
        is at fault or out of time is dead-lettered, a cancelled one ends, and the rest
        start over from init while they have attempts left."""
        if isinstance(exc, asyncio.TimeoutError):
            return await self.give_up(src, env, timed_out(env.job, self.stage.name))
        if isinstance(exc, JobCancelled):
            return await self.end(src, env, "cancelled", str(exc) or "cancelled")
        if isinstance(exc, (InvalidJob, ValidationError)):
            return await self.give_up(src, env, f"{type(exc).__name__}: {exc}", failure="job")
        if isinstance(exc, JobFailed):
            if not exc.retryable:
                return await self.give_up(src, env, str(exc), failure=exc.failure)
            return await self.retry(src, env, str(exc), failure=exc.failure)
        log.exception("job %s failed in %s", env.job.job_id, self.stage.name)
        return await self.retry(src, env, f"{type(exc).__name__}: {exc}")

    async def interrupted(self, src: Source, env: Envelope, why: str) -> None:
        """The stage's work on the job was interrupted for ``why`` (cancellations.py)."""
        if why == "shutdown":
            return await self.hand_back(src, env)
        if why is TIMED_OUT:
            return await self.give_up(src, env, timed_out(env.job, self.stage.name))
        return await self.end(src, env, "cancelled", why)

    async def release(self, env: Envelope) -> SandboxCount | None:
        """Tear down what the job holds on this node; returns the sandbox count change for
        the hand-off that follows (which applies it atomically with the move)."""
        try:
            await self.stage.release(env)
        except Exception:
            log.exception("job %s: freeing its resources failed", env.job.job_id)
        return self.handoff.sandbox_gone(env)

    async def end(self, src: Source, env: Envelope, status: ResultStatus, reason: str) -> None:
        count = await self.release(env)
        await self.handoff.finish(src, ended_result(env, status, reason, self.stage.name), count=count)

    async def give_up(self, src: Source, env: Envelope, error: str, failure: FailureKind = "infrastructure") -> None:
        count = await self.release(env)
        stage = self.stage.name
        history = "; earlier attempts: " + " | ".join(env.errors) if env.errors else ""
        letter = DeadLetter(job_id=env.job.job_id, submitter=env.job.submitter, stage=stage,
                            error=error + history, envelope=env)
        log.warning("job %s dead-lettered in %s: %s", env.job.job_id, stage, error)
        await self.handoff.dead_letter(src, letter, ended_result(env, "failed", error + history, stage, failure),
                                       count=count)

    async def retry(self, src: Source, env: Envelope, error: str, failure: FailureKind = "infrastructure") -> None:
        """Free the node's resources and start the job over from init, unless it has had
        all its attempts."""
        count = await self.release(env)
        env.errors.append(f"{self.stage.name}: {error}")
        attempts = self.ctx.settings.max_deliveries
        if env.attempt + 1 >= attempts:
            env.errors.pop()
            return await self.give_up(src, env, f"{error} (attempt {env.attempt + 1} of {attempts})", failure)
        await self.handoff.requeue(src, _from_init(env, attempt=env.attempt + 1), self.ctx.keys.init_stream, INIT_STAGE,
                                   error, count=count)

    async def hand_back(self, src: Source, env: Envelope) -> None:
        count = await self.release(env)
        await self.handoff.requeue(src, _from_init(env), self.ctx.keys.init_stream, INIT_STAGE,
                                   f"handed back by {self.consumer} at shutdown", count=count)

    async def undecodable(self, src: Source, fields: dict, exc: Exception) -> None:
        letter, result = malformed_message(fields, exc, self.stage.name)
        log.warning("message %s on %s dead-lettered: %s", src.msg_id, src.stream, letter.error)
        await self.handoff.dead_letter(src, letter, result)

    async def cannot_carry_on(self, src: Source, env: Envelope, exc: Exception) -> None:
        """What no codec can carry on (a hand-added message's 2**70, say) would fail the
        same way at every delivery: it ends now, as a dead letter and a failed result that
        carry only the ids, never as a message pending forever."""
        stage = self.stage.name
        log.exception("job %s cannot go on from %s", env.job.job_id, stage)
        job, error = env.job, f"job cannot be carried on from {stage}: {type(exc).__name__}: {exc}"
        letter = DeadLetter(job_id=job.job_id, submitter=job.submitter, stage=stage, error=error)
        result = Result(job_id=job.job_id, group_id=job.group_id, submitter=job.submitter, task=job.task,
                        status="failed", error=error, error_stage=stage, failure="job")
        await self.handoff.dead_letter(src, letter, result, count=await self.release(env))
