"""rollstream's own exceptions. Each message says what went wrong and what to do about it."""

from __future__ import annotations


class RollstreamError(Exception):
    """Base of every error rollstream raises on purpose."""


class RedisUnavailable(RollstreamError):
    """No Redis answered at the configured address."""


class RedisRefusesWrites(RedisUnavailable):
    """Redis answers but refuses writes for now (MISCONF: its disk is full; READONLY, OOM,
    LOADING); the message says which and what to do. Retrying later is safe."""


class InvalidJob(RollstreamError):
    """A job failed validation: malformed, too large, or naming an unknown task."""


class UnknownTask(InvalidJob):
    """The job names a task that no installed plugin provides."""


class JobTooLarge(InvalidJob):
    """The encoded job is over max_job_bytes."""


class JobFailed(RollstreamError):
    """A stage could not complete a job. ``retryable`` says whether another attempt may help;
    ``failure`` whose fault it is (see ``rollstream.messages.FailureKind``): the service's
    ("infrastructure", the default), the policy's own ("agent"), the submission's ("job") or the
    environment's ("task": it is broken; raise it with ``retryable=False``)."""

    def __init__(self, message: str, *, retryable: bool = True, failure: str = "infrastructure"):
        super().__init__(message)
        self.retryable = retryable
        self.failure = failure


class JobCancelled(RollstreamError):
    """The job (or its group, or its submitter's whole batch) was cancelled."""


class StaleDelivery(RollstreamError):
    """This worker no longer owns the message (it was reclaimed by another worker)."""
