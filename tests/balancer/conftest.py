"""Fixtures for the balancer tests: a real redis-server on a unix socket (the same name,
`redis_url`, as the project-wide fixture the lead hoists into tests/conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import pytest
import redis
from redis.asyncio import Redis

from rollstream.pipeline.balancer import Balancer


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    folder = tmp_path_factory.mktemp("redis")
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
         "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    url = f"unix://{sock}"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on {sock}")
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


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


