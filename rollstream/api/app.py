"""The HTTP API: the Python client's operations for any language — submit jobs and groups,
job state, results (long-poll with a cursor, or a stream of NDJSON), cancel, status,
backends, node drains, Prometheus metrics and health. The OpenAPI spec at /openapi.json documents it
(behind the token, like /docs, unless the api_public_docs setting opens them).

The routes live by resource (jobs.py, results.py, backends.py, nodes.py, ops.py); create_app
composes them, guards them with the token and keeps what they share on ``app.state``."""

from __future__ import annotations

import redis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response

from rollstream.api import backends, jobs, nodes, ops, results
from rollstream.api.auth import BearerAuth, load_token
from rollstream.api.limits import BodySizeLimit
from rollstream.api.state import ApiState, lifespan
from rollstream.config import Settings
from rollstream.pipeline.connection import transient_problem
from rollstream.pipeline.keys import Keys


async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's own 422 echoes each bad input, and fails (a 500) on the ones JSON cannot
    # carry: NaN, Infinity. Where and why is what a client needs; the input it has.
    return JSONResponse({"detail": [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")}
                                    for e in exc.errors()]}, status_code=422)


async def _redis_failed(_request: Request, exc: redis.RedisError) -> JSONResponse:
    # A Redis that refuses writes (full disk, read-only, out of memory) or cannot be
    # reached: 503 that says which, and that a retry later is safe.
    problem = transient_problem(exc)
    if problem is None:
        raise exc
    return JSONResponse({"detail": problem}, status_code=503, headers={"Retry-After": "1"})


def create_app(settings: Settings, *, token: str | None = None) -> FastAPI:
    app = FastAPI(title="rollstream", version="0.1.0", lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None,  # served below, behind the token
                  exception_handlers={RequestValidationError: _invalid_request, redis.RedisError: _redis_failed},
                  description="Rollout-as-a-service for RL of multi-turn LLM agents. "
                              "Every route but /health needs 'Authorization: Bearer <token>'.")
    app.state.api = ApiState(settings, Keys(settings.namespace))
    guarded = [Depends(BearerAuth(token or load_token(settings.data_dir)))]
    docs_guard = [] if settings.api_public_docs else guarded

    @app.get("/openapi.json", dependencies=docs_guard, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=docs_guard, include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="rollstream API")

    app.include_router(ops.health_router)  # no token: load balancers and probes ask it
    for router in (jobs.router, results.router(settings.api_max_wait_s), ops.router, backends.router, nodes.router):
        app.include_router(router, dependencies=guarded)
    return app


def asgi(settings: Settings, *, max_body_bytes: int | None = None, token: str | None = None):
    """The app wrapped in the request size limit: what uvicorn serves."""
    return BodySizeLimit(create_app(settings, token=token), max_body_bytes or settings.max_job_bytes * 2)
