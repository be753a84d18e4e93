"""Backend routes: register, list and remove inference servers in the balancer; pause and resume
generation across them."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from rollstream.api.state import Shared
from rollstream.llm.balancer import (
    BackendStatus,
    Balancer,
    add_backend,
    list_backends,
    normalize_url,
    remove_backend,
)

router = APIRouter(tags=["backends"])


class BackendRequest(BaseModel):
    # A host first: "http:///" has none.
    url: str = Field(pattern=r"^https?://[^\s/][^\s]{0,2000}$", description="Base URL of an OpenAI-compatible server.")
    info: dict = Field(default_factory=dict)


@router.get("/v1/backends", response_model=list[BackendStatus])
async def backends(state: Shared) -> list[BackendStatus]:
    return await list_backends(state.r, state.keys.namespace)


@router.post("/v1/backends", response_model=BackendStatus)
async def register(req: BackendRequest, state: Shared) -> BackendStatus:
    await add_backend(state.r, req.url, state.keys.namespace, info=req.info)
    url = normalize_url(req.url)
    for b in await list_backends(state.r, state.keys.namespace):
        if b.url == url:
            return b
    raise HTTPException(500, detail="backend registered but not listed")


@router.delete("/v1/backends")
async def remove(url: str, state: Shared) -> dict:
    try:
        normalize_url(url)
    except ValueError as exc:
        raise HTTPException(422, detail=str(exc)) from None
    if not await remove_backend(state.r, url, state.keys.namespace):
        raise HTTPException(404, detail=f"no backend {url}")
    return {"removed": url}


class PauseRequest(BaseModel):
    reason: str = Field("paused through the API", max_length=500, description="Why; shown while paused.")
    ttl_s: float = Field(600.0, ge=1, le=86400, description="The pause ends by itself after this long (s).")
    drain_timeout_s: float = Field(120.0, gt=0, le=3600, description="How long turns in flight may take to finish.")


@router.post("/v1/backends/pause")
async def pause(req: PauseRequest, state: Shared) -> dict:
    """Pause generation on every backend; answers once the turns in flight have finished."""
    balancer = Balancer(state.r, namespace=state.keys.namespace)
    try:
        drained_s = await balancer.pause(req.reason, ttl_s=req.ttl_s, drain_timeout_s=req.drain_timeout_s)
    except TimeoutError as exc:
        raise HTTPException(504, detail=str(exc)) from None
    return {"paused": True, "reason": req.reason, "drained_s": drained_s}


@router.post("/v1/backends/resume")
async def resume(state: Shared) -> dict:
    return {"resumed": await Balancer(state.r, namespace=state.keys.namespace).resume()}
