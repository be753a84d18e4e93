"""Node routes: drain a rollout node (its init, run and eval workers) out of the fleet; the
HTTP side of ``rollstream drain`` (pipeline/drain.py)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, Field

from rollstream.api.state import Shared
from rollstream.messages import ID_PATTERN
from rollstream.pipeline.drain import DrainStarted, request_drain

router = APIRouter(tags=["nodes"])


class DrainRequest(BaseModel):
    grace_s: float | None = Field(None, ge=0, le=7 * 24 * 3600,
                                  description="Seconds the node's workers may finish their jobs before handing "
                                  "the rest back to init (default: the drain_grace_s setting).")


@router.post("/v1/nodes/{node}/drain", response_model=DrainStarted)
async def drain(state: Shared, node: str = Path(..., pattern=ID_PATTERN),
                req: DrainRequest | None = None) -> DrainStarted:
    """Drain a node: its init workers take no more jobs, its run and eval workers finish what it
    holds, what is left at the deadline goes back to init, and its workers leave the live list
    (GET /v1/status shows them as draining until then). 404 if the node has no live worker."""
    grace_s = state.settings.drain_grace_s if req is None or req.grace_s is None else req.grace_s
    try:
        return await request_drain(state.r, state.keys, node, grace_s, worker_ttl_s=state.settings.worker_ttl_s)
    except LookupError as exc:
        raise HTTPException(404, detail=str(exc)) from None
