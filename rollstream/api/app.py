"""The HTTP API: the Python client's operations for any language — submit jobs and groups,
job state, results (long-poll with a cursor, or a stream of NDJSON), cancel, status,
backends, Prometheus metrics and health. The OpenAPI spec at /openapi.json documents it
(behind the token, like /docs, unless the api_public_docs setting opens them)."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from rollstream.api.auth import BearerAuth, load_token
from rollstream.api.limits import BodySizeLimit
from rollstream.api.metrics import render_metrics
from rollstream.api.results import ResultsReader
from rollstream.config import Settings
from rollstream.errors import InvalidJob, JobTooLarge
from rollstream.messages import ID_PATTERN, ID_RULE, Job, Result, new_id
from rollstream.pipeline import cancel as cancel_flags
from rollstream.pipeline.connection import async_redis, transient_problem
from rollstream.pipeline.jobstate import JobState, read_state
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import PipelineStatus, redis_problem, snapshot
from rollstream.pipeline.submission import enqueue
from rollstream.tasks.registry import validate_instance

SUBMITTER = ID_PATTERN  # one id grammar for jobs, groups and submitters (messages.ID_RULE)


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
        state["results"] = ResultsReader(state["redis"], keys, dead_maxlen=settings.dead_maxlen)
        yield
        await state["redis"].aclose()

    app = FastAPI(title="rollstream", version="0.1.0", lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None,  # served below, behind the token
                  description="Rollout-as-a-service for RL of multi-turn LLM agents. "
                              "Every route but /health needs 'Authorization: Bearer <token>'.")
    guarded = [Depends(auth)]
    docs_guard = [] if settings.api_public_docs else guarded

    @app.get("/openapi.json", dependencies=docs_guard, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=docs_guard, include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="rollstream API")

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 echoes each bad input, and fails (a 500) on the ones JSON cannot
        # carry: NaN, Infinity. Where and why is what a client needs; the input it has.
        return JSONResponse({"detail": [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")}
                                        for e in exc.errors()]}, status_code=422)

    @app.exception_handler(redis.RedisError)
    async def redis_failed(_request: Request, exc: redis.RedisError) -> JSONResponse:
        # A Redis that refuses writes (full disk, read-only, out of memory) or cannot be
        # reached: 503 that says which, and that a retry later is safe.
        problem = transient_problem(exc)
        if problem is None:
            raise exc
        return JSONResponse({"detail": problem}, status_code=503, headers={"Retry-After": "1"})

    def r():
        return state["redis"]

    async def _submit(jobs: list[Job]) -> Submitted:
        for job in jobs:
            try:
                validate_instance(job.task, job.instance)
            except InvalidJob as exc:
                raise HTTPException(422, detail=f"job {job.job_id}: {exc}") from exc
        try:
            done = await enqueue(r(), keys, jobs, max_job_bytes=settings.max_job_bytes)
            return Submitted(job_ids=done.job_ids, duplicates=done.duplicates)
        except JobTooLarge as exc:
            raise HTTPException(413, detail=str(exc)) from exc
        except InvalidJob as exc:
            raise HTTPException(422, detail=str(exc)) from exc

    @app.get("/health", tags=["ops"])
    async def health() -> dict:
        """200 while Redis answers and takes writes; 503 saying what is wrong otherwise (a
        full disk under its AOF, a read-only replica, its memory limit, no answer)."""
        try:
            problem = await asyncio.wait_for(redis_problem(r(), keys, terse=True), 2.0)
        except asyncio.TimeoutError:
            problem = "Redis did not answer within 2 s"
        if problem:
            raise HTTPException(503, detail=problem)
        return {"ok": True}

    @app.post("/v1/jobs", response_model=Submitted, dependencies=guarded, tags=["jobs"])
    async def submit_job(job: Job) -> Submitted:
        return await _submit([job])

    @app.post("/v1/jobs/batch", response_model=Submitted, dependencies=guarded, tags=["jobs"])
    async def submit_batch(batch: BatchRequest) -> Submitted:
        return await _submit(batch.jobs)

    @app.post("/v1/groups", response_model=Submitted, dependencies=guarded, tags=["jobs"])
    async def submit_group(req: GroupRequest) -> Submitted:
        group_id = req.job.group_id or new_id()
        jobs = [req.job.model_copy(update={"job_id": new_id(), "group_id": group_id}) for _ in range(req.n)]
        return (await _submit(jobs)).model_copy(update={"group_id": group_id})

    @app.get("/v1/jobs/{job_id}", response_model=JobState, dependencies=guarded, tags=["jobs"])
    async def job_status(job_id: str = Path(..., pattern=ID_PATTERN)) -> JobState:
        st = await read_state(r(), keys, job_id)
        if st is None:
            raise HTTPException(404, detail=f"no job {job_id} (unknown, or finished more than "
                                            f"{settings.job_state_ttl_s}s ago)")
        return st

    @app.delete("/v1/jobs/{job_id}", dependencies=guarded, tags=["jobs"])
    async def cancel_job(job_id: str = Path(..., pattern=ID_PATTERN)) -> dict:
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
                      wait_s: float = Query(min(10.0, settings.api_max_wait_s), ge=0, le=settings.api_max_wait_s), max: int = Query(100, ge=1, le=1000)) -> Response:
        """Long-poll: results not yet acknowledged, waiting up to wait_s for the first one.
        Results stay deliverable until acknowledged by passing their page's cursor."""
        if ack is not None and any(int(part) >= 2**64 for part in ack.split("-")):
            raise HTTPException(422, detail=f"ack={ack} is not a cursor: pass back the 'cursor' of the previous page")
        items, cursor = await state["results"].page(submitter, ack=ack, wait_s=wait_s, count=max)
        # Each result was encoded on its own (a poison one is dead-lettered, not a 500).
        return Response('{"results":[' + ",".join(items) + '],"cursor":' + json.dumps(cursor) + "}",
                        media_type="application/json")

    @app.get("/v1/results/{submitter}/stream", dependencies=guarded, tags=["results"])
    async def results_stream(submitter: str = Path(..., pattern=SUBMITTER),
                             idle_timeout_s: float = Query(min(30.0, settings.api_max_wait_s), ge=0.1,
                                                           le=settings.api_max_wait_s)):
        """NDJSON: one result per line as they arrive; ends after idle_timeout_s without one."""
        async def lines():
            async for text in state["results"].stream(submitter, idle_timeout_s=idle_timeout_s):
                yield text + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/status", response_model=PipelineStatus, dependencies=guarded, tags=["ops"])
    async def status() -> PipelineStatus:
        return await snapshot(r(), keys, worker_ttl_s=settings.worker_ttl_s)

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
