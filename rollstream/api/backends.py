"""Backend routes: register, list and remove inference servers in the balancer."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from rollstream.pipeline.balancer import BackendStatus, add_backend, list_backends, remove_backend
from rollstream.pipeline.keys import Keys


class BackendRequest(BaseModel):
    url: str = Field(pattern=r"^https?://[^\s]{1,2000}$", description="Base URL of an OpenAI-compatible server.")
    info: dict = Field(default_factory=dict)


def router(guarded, r, keys: Keys) -> APIRouter:
    api = APIRouter(dependencies=guarded, tags=["backends"])

    @api.get("/v1/backends", response_model=list[BackendStatus])
    async def backends() -> list[BackendStatus]:
        return await list_backends(r(), keys.namespace)

    @api.post("/v1/backends", response_model=BackendStatus)
    async def register(req: BackendRequest) -> BackendStatus:
        await add_backend(r(), req.url, keys.namespace, info=req.info)
        for b in await list_backends(r(), keys.namespace):
            if b.url.rstrip("/") == req.url.rstrip("/") or b.url == req.url:
                return b
        raise HTTPException(500, detail="backend registered but not listed")

    @api.delete("/v1/backends")
    async def remove(url: str) -> dict:
        if not await remove_backend(r(), url, keys.namespace):
            raise HTTPException(404, detail=f"no backend {url}")
        return {"removed": url}

    return api
