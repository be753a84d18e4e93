"""What every route of the HTTP API shares — the settings, the key names, the Redis
connection and the results reader — kept on ``app.state`` by create_app and handed to
the routes as a FastAPI dependency (``state: Shared``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Request

from rollstream.api.results_reader import ResultsReader
from rollstream.config import Settings
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys


@dataclass
class ApiState:
    settings: Settings
    keys: Keys
    redis: aioredis.Redis | None = None  # set while the app runs (lifespan)
    results: ResultsReader | None = None

    @property
    def r(self) -> aioredis.Redis:
        assert self.redis is not None, "the API's Redis is opened by the app's lifespan"
        return self.redis

    @property
    def reader(self) -> ResultsReader:
        assert self.results is not None, "the API's results reader is made by the app's lifespan"
        return self.results


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One Redis connection pool per app, opened on start and closed on shutdown."""
    state: ApiState = app.state.api
    if state.settings.redis_url is None:  # `rollstream api` starts or names one (cli.common.require_redis)
        raise RuntimeError("the API needs a Redis: set REDIS_URL or pass --redis")
    state.redis = async_redis(state.settings.redis_url)
    state.results = ResultsReader(state.redis, state.keys, dead_maxlen=state.settings.dead_maxlen)
    yield
    await state.redis.aclose()


def _api_state(request: Request) -> ApiState:
    return request.app.state.api


Shared = Annotated[ApiState, Depends(_api_state)]
