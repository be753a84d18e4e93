"""Job routes: submit one job, a batch or a group into the init stream, read a job's state,
cancel a job, a group or a submitter's jobs — the Python client's operations over HTTP."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, Field

from rollstream.api.state import ApiState, Shared
from rollstream.errors import InvalidJob, JobTooLarge
from rollstream.messages import ID_PATTERN, ID_RULE, Job, new_id
from rollstream.pipeline import cancel as cancel_flags
from rollstream.pipeline.jobstate import JobState, read_state
from rollstream.pipeline.submission import enqueue
from rollstream.tasks.registry import validate_instance

router = APIRouter(tags=["jobs"])


class Submitted(BaseModel):
    job_ids: list[str]
    group_id: str | None = None
    duplicates: dict[str, str] = Field(default_factory=dict, description=(
        "Job ids that were known already (queued, at work, or finished less than job_state_ttl_s ago), "
        "with their status: nothing was queued for them and no second result will come."))


class GroupRequest(BaseModel):
    job: Job
    n: int = Field(ge=1, le=4096, description="Rollouts of the same instance (GRPO/DAPO group size).")


class BatchRequest(BaseModel):
    jobs: list[Job] = Field(min_length=1, max_length=10_000)


class CancelRequest(BaseModel):
    job_id: str | None = Field(default=None, pattern=ID_PATTERN, description=ID_RULE)
    group_id: str | None = Field(default=None, pattern=ID_PATTERN, description=ID_RULE)
    submitter: str | None = Field(default=None, pattern=ID_PATTERN,
                                  description="Cancel everything this submitter has in flight.")


async def _submit(state: ApiState, jobs: list[Job]) -> Submitted:
    for job in jobs:
        try:
            validate_instance(job.task, job.instance)
        except InvalidJob as exc:
            raise HTTPException(422, detail=f"job {job.job_id}: {exc}") from exc
    try:
        done = await enqueue(state.r, state.keys, jobs, max_job_bytes=state.settings.max_job_bytes,
                             replica_acks=state.settings.replica_acks,
                             replica_ack_timeout_ms=state.settings.replica_ack_timeout_ms,
                             priority_aging_s=state.settings.priority_aging_s)
        return Submitted(job_ids=done.job_ids, duplicates=done.duplicates)
    except JobTooLarge as exc:
        raise HTTPException(413, detail=str(exc)) from exc
    except InvalidJob as exc:
        raise HTTPException(422, detail=str(exc)) from exc


@router.post("/v1/jobs", response_model=Submitted)
async def submit_job(job: Job, state: Shared) -> Submitted:
    return await _submit(state, [job])


@router.post("/v1/jobs/batch", response_model=Submitted)
async def submit_batch(batch: BatchRequest, state: Shared) -> Submitted:
    return await _submit(state, batch.jobs)


@router.post("/v1/groups", response_model=Submitted)
async def submit_group(req: GroupRequest, state: Shared) -> Submitted:
    group_id = req.job.group_id or new_id()
    jobs = [req.job.model_copy(update={"job_id": new_id(), "group_id": group_id}) for _ in range(req.n)]
    return (await _submit(state, jobs)).model_copy(update={"group_id": group_id})


@router.get("/v1/jobs/{job_id}", response_model=JobState)
async def job_status(state: Shared, job_id: str = Path(..., pattern=ID_PATTERN)) -> JobState:
    st = await read_state(state.r, state.keys, job_id)
    if st is None:
        raise HTTPException(404, detail=f"no job {job_id} (unknown, or finished more than "
                                        f"{state.settings.job_state_ttl_s}s ago)")
    return st


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(state: Shared, job_id: str = Path(..., pattern=ID_PATTERN)) -> dict:
    await cancel_flags.cancel(state.r, state.keys, job_id=job_id, ttl_s=state.settings.job_state_ttl_s)
    return {"cancelled": job_id}


@router.post("/v1/cancel")
async def cancel(req: CancelRequest, state: Shared) -> dict:
    if not (req.job_id or req.group_id or req.submitter):
        raise HTTPException(422, detail="give job_id, group_id or submitter")
    await cancel_flags.cancel(state.r, state.keys, job_id=req.job_id, group_id=req.group_id,
                              submitter=req.submitter, ttl_s=state.settings.job_state_ttl_s)
    return {"cancelled": req.model_dump(exclude_none=True)}
