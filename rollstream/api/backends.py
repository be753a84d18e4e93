"""Backend routes: register, list and remove inference servers in the balancer."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from rollstream.api.state import Shared
from rollstream.pipeline.balancer import BackendStatus, add_backend, list_backends, normalize_url, remove_backend

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
