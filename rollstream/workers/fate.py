"""A job's fate in a stage: whether it leaves before any work (delivered too often, cancelled,
redelivered after its worker died, out of queue time), and how it leaves when its work fails or
is interrupted: finished (cancelled, or failed for good), dead-lettered, requeued at init (a
retry, which counts an attempt, or a hand-back at shutdown, which does not). Each decision frees
what the job holds on this node and returns the move; ``pipeline.handoff`` records it, and the
node's sandbox count with it, in one script."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal, cast

from pydantic import ValidationError

from rollstream.errors import InvalidJob, JobCancelled, JobFailed
from rollstream.messages import STAGES, DeadLetter, Envelope, FailureKind, Result, StageName, valid_id
from rollstream.pipeline.codec import fields_payload
from rollstream.pipeline.handoff import DeadLetterJob, Finish, Move, Requeue, Source
from rollstream.workers.deadlines import TIMED_OUT
from rollstream.workers.stage import Stage, WorkerContext

log = logging.getLogger(__name__)


def active_s(env: Envelope, stage: StageName) -> float:
    """Seconds this attempt of the job has spent at work in the stages before ``stage``: what
    its ``timeout_s`` counts (queue time does not). Each attempt restarts from init, so the
    earlier stages' timings are always this attempt's own."""
    return sum(env.timings_s.get(f"{s}_s", 0.0) for s in STAGES[:STAGES.index(stage)])


def queued_s(env: Envelope, stage: StageName) -> float:
    """Seconds the job has waited in stage queues up to the start of ``stage`` (that stage's
    own wait included): what its ``queue_timeout_s`` bounds."""
    return sum(env.timings_s.get(f"{s}_wait_s", 0.0) for s in STAGES[:STAGES.index(stage) + 1])


def queue_overrun(env: Envelope, stage: StageName) -> str | None:
    """Why the job must end unrun: it waited in queues (up to ``stage``) longer than its
    queue_timeout_s; None while it has not."""
    limit = env.job.queue_timeout_s
    if limit is None or (waited := queued_s(env, stage)) <= limit:
        return None
    return f"job waited {waited:.1f} s in queues (up to {stage}), over its queue_timeout_s={limit:g}; it never ran"


class Fate:
    """The decisions of one stage's worker; each returns the move that records it."""

    def __init__(self, stage: Stage, ctx: WorkerContext, consumer: str):
        self.stage = stage
        self.ctx = ctx
        self.consumer = consumer

    # -- before work -------------------------------------------------------------------
    async def before_work(self, src: Source, env: Envelope, deliveries: int, cancelled: str | None) -> Move | None:
        """The move of a job that leaves before this stage works on it (``cancelled``: why its
        submitter stopped it, if it did), or None: it is to be worked on."""
        stage = self.stage.name
        if deliveries > self.ctx.settings.max_deliveries:
            why = f"delivered {deliveries} times to {stage} workers that died or hung before finishing it"
            return await self.dead_letter(env, why)
        if cancelled:
            return await self.finish(env, "cancelled", cancelled)
        if deliveries > 1 and self.stage.restarts_redelivered_jobs:
            return await self.requeue(env, f"{stage} worker died mid-job (delivery {deliveries})")
        env.timings_s[f"{stage}_wait_s"] = max(0.0, src.started_at - src.queued_at)
        if overrun := queue_overrun(env, stage):
            return await self.finish(env, "failed", overrun)
        return None

    def time_left_s(self, env: Envelope) -> float:
        """What is left of the job's ``timeout_s`` (time at work in stages, not in queues)."""
        return env.job.timeout_s - active_s(env, self.stage.name)

    # -- after work that did not hand the job on ---------------------------------------
    async def failed(self, env: Envelope, exc: Exception) -> Move:
        """The stage's work on the job raised ``exc`` (called while handling it): a job that
        is at fault or out of time is dead-lettered, a cancelled one finishes, and the rest
        start over from init while they have attempts left."""
        if isinstance(exc, asyncio.TimeoutError):
            return await self.dead_letter(env, self._timed_out(env))
        if isinstance(exc, JobCancelled):
            return await self.finish(env, "cancelled", str(exc) or "cancelled")
        if isinstance(exc, (InvalidJob, ValidationError)):
            return await self.dead_letter(env, f"{type(exc).__name__}: {exc}", failure="job")
        if isinstance(exc, JobFailed):
            failure = cast(FailureKind, exc.failure)  # errors.py names the kinds without importing them
            if not exc.retryable:
                return await self.dead_letter(env, str(exc), failure=failure)
            return await self.requeue(env, str(exc), failure=failure)
        log.exception("job %s failed in %s", env.job.job_id, self.stage.name)
        return await self.requeue(env, f"{type(exc).__name__}: {exc}")

    async def interrupted(self, env: Envelope, why: str) -> Move:
        """The stage's work on the job was interrupted for ``why`` (cancellations.py)."""
        if why == "shutdown":
            return await self.requeue(env, None)
        if why is TIMED_OUT:
            return await self.dead_letter(env, self._timed_out(env))
        return await self.finish(env, "cancelled", why)

    def _timed_out(self, env: Envelope) -> str:
        return f"job timed out in {self.stage.name}: over its timeout_s={env.job.timeout_s} of time at work in stages"

    # -- the moves ---------------------------------------------------------------------
    async def finish(self, env: Envelope, status: Literal["cancelled", "failed"], reason: str) -> Finish:
        """Finish the job now, "cancelled" or "failed" (for good, with no dead letter)."""
        await self._release(env)
        stage = self.stage.name
        if status == "cancelled":
            return Finish(Result.cancelled(env, reason, stage))
        return Finish(Result.failed(env, reason, stage))

    async def dead_letter(self, env: Envelope, error: str, failure: FailureKind = "infrastructure") -> DeadLetterJob:
        await self._release(env)
        stage, error = self.stage.name, env.with_earlier_errors(error)
        log.warning("job %s dead-lettered in %s: %s", env.job.job_id, stage, error)
        return DeadLetterJob(DeadLetter.of_job(env, stage, error), Result.failed(env, error, stage, failure))

    async def requeue(self, env: Envelope, error: str | None, failure: FailureKind = "infrastructure") -> Move:
        """Start the job over from init: a retry after ``error``, which counts as an attempt
        (dead-lettered once it was the last), or, with None, a hand-back at shutdown."""
        if error is None:
            await self._release(env)
            return Requeue(env.restarted(), f"handed back by {self.consumer} at shutdown")
        attempts = self.ctx.settings.max_deliveries
        if env.is_last_attempt(attempts):
            return await self.dead_letter(env, f"{error} (attempt {env.attempt + 1} of {attempts})", failure)
        await self._release(env)
        return Requeue(env.restarted(failed_with=f"{self.stage.name}: {error}"), error)

    async def cannot_carry_on(self, env: Envelope, exc: Exception) -> DeadLetterJob:
        """What no codec can carry on (a hand-added message's 2**70, say) would fail the
        same way at every delivery: it ends now, as a dead letter and a failed result that
        carry only the ids, never as a message pending forever."""
        stage, job = self.stage.name, env.job
        log.exception("job %s cannot go on from %s", job.job_id, stage)
        error = f"job cannot be carried on from {stage}: {type(exc).__name__}: {exc}"
        await self._release(env)
        return DeadLetterJob(DeadLetter.of_job(env, stage, error, with_envelope=False),
                             Result.invalid_job(job.job_id, job.submitter, error, stage, group_id=job.group_id,
                                                task=job.task))

    def undecodable(self, src: Source, fields: dict, exc: Exception) -> DeadLetterJob:
        """A message on the stage's stream that cannot be read as a job (a hand-added XADD, a
        corrupt entry): a dead letter, and a failed result where it names a submitter validly."""
        job_id, submitter = _best_effort_ids(fields)
        error = f"malformed job message: {exc}"
        raw = fields.get(b"data") or fields.get(b"json") or repr(fields).encode()
        letter = DeadLetter(job_id=job_id if valid_id(job_id) else None, submitter=submitter, stage=self.stage.name,
                            error=error, raw=raw)
        log.warning("message %s on %s dead-lettered: %s", src.msg_id, src.stream, error)
        return DeadLetterJob(letter, Result.invalid_job(job_id, submitter, error, self.stage.name)
                             if job_id and submitter else None)

    async def _release(self, env: Envelope) -> None:
        """Tear down what the job holds on this node: it leaves the node with the move."""
        try:
            await self.stage.release(env)
        except Exception:
            log.exception("job %s: freeing its resources failed", env.job.job_id)


def _best_effort_ids(fields: dict) -> tuple[str | None, str | None]:
    try:
        payload = fields_payload(fields)
        job = payload.get("job", payload) if isinstance(payload, dict) else {}
        job_id, submitter = job.get("job_id"), job.get("submitter", "default")
        # Only a submitter of the id grammar names a results stream; a job id outside it is
        # returned (cut short) for the failed result to carry, never used in a key.
        if not (isinstance(job_id, str) and job_id and valid_id(submitter)):
            return None, None
        return job_id[:200], submitter
    except Exception:
        return None, None
