"""The HTTP API: the Python client's operations for any language — submit jobs and groups,
job state, results (long-poll with a cursor, or a stream of NDJSON), cancel, status,
backends, Prometheus metrics and health. The OpenAPI spec at /openapi.json documents it."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from rollstream.api.auth import BearerAuth, load_token
from rollstream.api.limits import BodySizeLimit
from rollstream.api.metrics import render_metrics
from rollstream.api.results import ResultsReader
from rollstream.config import Settings
from rollstream.errors import InvalidJob, JobTooLarge
from rollstream.messages import Job, Result, new_id
from rollstream.pipeline import cancel as cancel_flags
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.jobstate import JobState, read_state
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import PipelineStatus, snapshot
from rollstream.pipeline.submission import enqueue
from rollstream.tasks.registry import validate_instance

SUBMITTER = r"^[A-Za-z0-9_.\-]{1,200}$"


class Submitted(BaseModel):
    job_ids: list[str]
    group_id: str | None = None


class GroupRequest(BaseModel):
    job: Job
    n: int = Field(ge=1, le=4096, description="Rollouts of the same instance (GRPO/DAPO group size).")


class BatchRequest(BaseModel):
    jobs: list[Job] = Field(min_length=1, max_length=10_000)


class CancelRequest(BaseModel):
    job_id: str | None = None
    group_id: str | None = None
    submitter: str | None = Field(default=None, pattern=SUBMITTER,
                                  description="Cancel everything this submitter has in flight.")


class ResultsPage(BaseModel):
    results: list[Result]
    cursor: str | None = Field(None, description="Pass back as ?ack= to acknowledge these results.")


def create_app(settings: Settings, *, token: str | None = None) -> FastAPI:
    keys = Keys(settings.namespace)
    auth = BearerAuth(token or load_token(settings.data_dir))
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["redis"] = async_redis(settings.redis_url)
        state["results"] = ResultsReader(state["redis"], keys)
        yield
        await state["redis"].aclose()

    app = FastAPI(title="rollstream", version="0.1.0", lifespan=lifespan,
                  description="Rollout-as-a-service for RL of multi-turn LLM agents. "
                              "Every route but /health needs 'Authorization: Bearer <token>'.")
    guarded = [Depends(auth)]

    def r():
        return state["redis"]

    async def _submit(jobs: list[Job]) -> list[str]:
        for job in jobs:
            try:
                validate_instance(job.task, job.instance)
            except InvalidJob as exc:
                raise HTTPException(422, detail=f"job {job.job_id}: {exc}") from exc
        try:
            return await enqueue(r(), keys, jobs, max_job_bytes=settings.max_job_bytes)
        except JobTooLarge as exc:
            raise HTTPException(413, detail=str(exc)) from exc
        except InvalidJob as exc:
            raise HTTPException(422, detail=str(exc)) from exc

    @app.get("/health", tags=["ops"])
    async def health() -> dict:
        try:
            await asyncio.wait_for(r().ping(), 2.0)
        except Exception as exc:
            raise HTTPException(503, detail=f"Redis unreachable: {type(exc).__name__}") from exc
        return {"ok": True}

    @app.post("/v1/jobs", response_model=Submitted, dependencies=guarded, tags=["jobs"])
    async def submit_job(job: Job) -> Submitted:
        return Submitted(job_ids=await _submit([job]))

    @app.post("/v1/jobs/batch", response_model=Submitted, dependencies=guarded, tags=["jobs"])
    async def submit_batch(batch: BatchRequest) -> Submitted:
        return Submitted(job_ids=await _submit(batch.jobs))

    @app.post("/v1/groups", response_model=Submitted, dependencies=guarded, tags=["jobs"])
    async def submit_group(req: GroupRequest) -> Submitted:
        group_id = req.job.group_id or new_id()
        jobs = [req.job.model_copy(update={"job_id": new_id(), "group_id": group_id}) for _ in range(req.n)]
        return Submitted(job_ids=await _submit(jobs), group_id=group_id)

    @app.get("/v1/jobs/{job_id}", response_model=JobState, dependencies=guarded, tags=["jobs"])
    async def job_status(job_id: str) -> JobState:
        st = await read_state(r(), keys, job_id)
        if st is None:
            raise HTTPException(404, detail=f"no job {job_id} (unknown, or finished more than "
                                            f"{settings.job_state_ttl_s}s ago)")
        return st

    @app.delete("/v1/jobs/{job_id}", dependencies=guarded, tags=["jobs"])
    async def cancel_job(job_id: str) -> dict:
        await cancel_flags.cancel(r(), keys, job_id=job_id, ttl_s=settings.job_state_ttl_s)
        return {"cancelled": job_id}

    @app.post("/v1/cancel", dependencies=guarded, tags=["jobs"])
    async def cancel(req: CancelRequest) -> dict:
        if not (req.job_id or req.group_id or req.submitter):
            raise HTTPException(422, detail="give job_id, group_id or submitter")
        await cancel_flags.cancel(r(), keys, job_id=req.job_id, group_id=req.group_id,
                                  submitter=req.submitter, ttl_s=settings.job_state_ttl_s)
        return {"cancelled": req.model_dump(exclude_none=True)}

    @app.get("/v1/results/{submitter}", response_model=ResultsPage, dependencies=guarded, tags=["results"])
    async def results(submitter: str = Path(..., pattern=SUBMITTER),
                      ack: str | None = Query(None, pattern=r"^[0-9]{1,20}-[0-9]{1,20}$", description="Cursor of the previous page."),
                      wait_s: float = Query(min(10.0, settings.api_max_wait_s), ge=0, le=settings.api_max_wait_s), max: int = Query(100, ge=1, le=1000)) -> ResultsPage:
        """Long-poll: results not yet acknowledged, waiting up to wait_s for the first one.
        Results stay deliverable until acknowledged by passing their page's cursor."""
        if ack is not None and any(int(part) >= 2**64 for part in ack.split("-")):
            raise HTTPException(422, detail=f"ack={ack} is not a cursor: pass back the 'cursor' of the previous page")
        items, cursor = await state["results"].page(submitter, ack=ack, wait_s=wait_s, count=max)
        return ResultsPage(results=items, cursor=cursor)

    @app.get("/v1/results/{submitter}/stream", dependencies=guarded, tags=["results"])
    async def results_stream(submitter: str = Path(..., pattern=SUBMITTER),
                             idle_timeout_s: float = Query(min(30.0, settings.api_max_wait_s), ge=0.1,
                                                           le=settings.api_max_wait_s)):
        """NDJSON: one result per line as they arrive; ends after idle_timeout_s without one."""
        async def lines():
            async for result in state["results"].stream(submitter, idle_timeout_s=idle_timeout_s):
                yield result.model_dump_json() + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/status", response_model=PipelineStatus, dependencies=guarded, tags=["ops"])
    async def status() -> PipelineStatus:
        return await snapshot(r(), keys)

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=guarded, tags=["ops"])
    async def metrics() -> str:
        return await render_metrics(r(), keys)

    _mount_backends(app, guarded, r, keys)
    return app


def _mount_backends(app: FastAPI, guarded, r, keys: Keys) -> None:
    """Backend routes, through the balancer's own functions."""
    from rollstream.api.backends import router

    app.include_router(router(guarded, r, keys))


def asgi(settings: Settings, *, max_body_bytes: int | None = None, token: str | None = None):
    """The app wrapped in the request size limit: what uvicorn serves."""
    return BodySizeLimit(create_app(settings, token=token), max_body_bytes or settings.max_job_bytes * 2)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)
