"""A message on a stage stream that cannot be read as a job (a hand-added XADD, a corrupt
entry): what goes to the dead letters, and the failed result its submitter gets where the
message names one validly."""

from __future__ import annotations

from rollstream.messages import DeadLetter, Result, valid_id
from rollstream.pipeline.codec import fields_payload


def malformed_message(fields: dict, exc: Exception, stage: str) -> tuple[DeadLetter, Result | None]:
    job_id, submitter = _best_effort_ids(fields)
    error = f"malformed job message: {exc}"
    raw = fields.get(b"data") or fields.get(b"json") or repr(fields).encode()
    letter = DeadLetter(job_id=job_id if valid_id(job_id) else None, submitter=submitter, stage=stage,
                        error=error, raw=raw)
    result = Result(job_id=job_id, submitter=submitter, status="failed", error=error, failure="job",
                    error_stage=stage) if job_id and submitter else None
    return letter, result


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
