"""Operator routes: health (for load balancers and probes, without the token), the
pipeline's status and its Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException
from fastapi.responses import PlainTextResponse

from rollstream.api.metrics import render_metrics
from rollstream.api.state import Shared
from rollstream.pipeline.status import PipelineStatus, redis_problem, snapshot

health_router = APIRouter(tags=["ops"])
router = APIRouter(tags=["ops"])


@health_router.get("/health")
async def health(state: Shared) -> dict:
    """200 while Redis answers and takes writes; 503 saying what is wrong otherwise (a
    full disk under its AOF, a read-only replica, its memory limit, no answer)."""
    try:
        problem = await asyncio.wait_for(redis_problem(state.r, state.keys, terse=True), 2.0)
    except TimeoutError:
        problem = "Redis did not answer within 2 s"
    if problem:
        raise HTTPException(503, detail=problem)
    return {"ok": True}


@router.get("/v1/status", response_model=PipelineStatus)
async def status(state: Shared) -> PipelineStatus:
    return await snapshot(state.r, state.keys, worker_ttl_s=state.settings.worker_ttl_s)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: Shared) -> str:
    return await render_metrics(state.r, state.keys)
