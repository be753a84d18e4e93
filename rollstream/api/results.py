"""Result routes: a submitter's results as a long-polled page with a cursor that
acknowledges them, or as a stream of NDJSON lines (read by results_reader.py)."""

from __future__ import annotations

import json

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field

from rollstream.api.state import Shared
from rollstream.messages import ID_PATTERN, Result


class ResultsPage(BaseModel):
    results: list[Result]
    cursor: str | None = Field(None, description="Pass back as ?ack= to acknowledge these results.")


def router(api_max_wait_s: float) -> APIRouter:
    """The routes for one app: their waits' defaults and bounds, which the OpenAPI spec
    shows, come from its ``api_max_wait_s`` setting."""
    api = APIRouter(tags=["results"])

    @api.get("/v1/results/{submitter}", response_model=ResultsPage)
    async def results(
        state: Shared,
        submitter: str = Path(..., pattern=ID_PATTERN),
        ack: str | None = Query(None, pattern=r"^[0-9]{1,20}-[0-9]{1,20}$", description="Cursor of the previous page."),
        wait_s: float = Query(min(10.0, api_max_wait_s), ge=0, le=api_max_wait_s),
        max: int = Query(100, ge=1, le=1000),
    ) -> Response:
        """Long-poll: results not yet acknowledged, waiting up to wait_s for the first one.
        Results stay deliverable until acknowledged by passing their page's cursor."""
        if ack is not None and any(int(part) >= 2**64 for part in ack.split("-")):
            raise HTTPException(422, detail=f"ack={ack} is not a cursor: pass back the 'cursor' of the previous page")
        items, cursor = await state.reader.page(submitter, ack=ack, wait_s=wait_s, count=max)
        # Each result was encoded on its own (a poison one is dead-lettered, not a 500).
        return Response(
            '{"results":[' + ",".join(items) + '],"cursor":' + json.dumps(cursor) + "}", media_type="application/json"
        )

    @api.get("/v1/results/{submitter}/stream")
    async def results_stream(
        state: Shared,
        submitter: str = Path(..., pattern=ID_PATTERN),
        idle_timeout_s: float = Query(min(30.0, api_max_wait_s), ge=0.1, le=api_max_wait_s),
    ):
        """NDJSON: one result per line as they arrive; ends after idle_timeout_s without one."""

        async def lines():
            async for text in state.reader.stream(submitter, idle_timeout_s=idle_timeout_s):
                yield text + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return api
