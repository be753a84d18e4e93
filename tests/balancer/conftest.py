"""Fixtures for the balancer tests: an async client of the session's real redis-server
(`redis_url`, from tests/conftest.py) and a balancer in a namespace of its own per test."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from rollstream.llm.balancer import Balancer


@pytest.fixture
async def redis_client(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def namespace() -> str:
    # Each test gets its own key prefix, so tests never see each other's backends.
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def balancer(redis_client: Redis, namespace: str) -> Balancer:
    return Balancer(redis_client, namespace=namespace, group_affinity_slack=2, lease_ttl_s=30)


