"""The redis+sentinel:// URL (what an operator writes in REDIS_URL), the lean connection leaving
a server that answers READONLY, and a submission no replica confirmed (replica_acks)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis

from rollstream.client import AsyncClient
from rollstream.errors import RedisRefusesWrites
from rollstream.messages import new_id
from rollstream.pipeline import sentinel
from rollstream.pipeline.connection import async_redis, redacted
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.wire import FastRedis


def test_a_sentinel_url_names_the_sentinels_the_service_the_database_and_the_credentials():
    parts = sentinel.parse("redis+sentinel://app:s3cret@s1:26380,s2,[::1]:26381/rollstream/2"
                           "?sentinel_password=daemon")
    assert parts.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert (parts.service, parts.db, parts.username, parts.password) == ("rollstream", 2, "app", "s3cret")
    assert parts.sentinel_password == "daemon"
    assert sentinel.parse("redis+sentinel://:pw@h/svc").password == "pw"
    assert sentinel.parse("redis+sentinel://h/svc").db == 0


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h1:26379", "/SERVICE"),
    ("redis+sentinel:///svc", "names no Sentinel"),
    ("redis+sentinel://h1:port/svc", "not a number"),
    ("redis+sentinel://h1/svc/db", "not a number"),
    ("redis+sentinel://h1/svc?socket_timeout=1", "unknown option"),
])
def test_a_malformed_sentinel_url_is_refused_saying_what_is_wrong(url, says):
    with pytest.raises(ValueError, match=says):
        sentinel.parse(url)


def test_passwords_in_a_sentinel_url_never_reach_a_log():
    url = "redis+sentinel://app:s3cret@s1:26379,s2:26379/svc/0?sentinel_password=daemon"
    assert "s3cret" not in redacted(url) and "daemon" not in redacted(url)
    with pytest.raises(ValueError) as refused:
        sentinel.parse("redis+sentinel://app:s3cret@s1:26379/svc/x")
    assert "s3cret" not in str(refused.value)


async def test_the_lean_connection_leaves_a_server_that_answers_readonly(sentinel_redis):
    """A connection still open to a primary that a failover demoted gets READONLY: it is dropped,
    so the write sent again goes where the Sentinels point now."""
    replica = sentinel_redis.data_ports[1]
    addresses = [("127.0.0.1", replica), ("127.0.0.1", sentinel_redis.primary_port())]

    async def where_the_sentinels_point():
        return addresses.pop(0) if len(addresses) > 1 else addresses[0]

    fast = FastRedis(primary=where_the_sentinels_point)
    try:
        with pytest.raises(redis.exceptions.ReadOnlyError):
            await fast.execute("SET", "k", "v")
        assert await fast.execute("SET", "k", "v") == b"OK"  # reconnected, to the primary
    finally:
        await fast.close()


@pytest.fixture
def lone_primary(tmp_path):
    """A redis-server on a loopback port with no replica (yet); yields (port, start_replica)."""
    procs = []

    def start(*extra: str) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        folder = tmp_path / str(port)
        folder.mkdir()
        procs.append(subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                                       "127.0.0.1", "--dir", str(folder), "--save", "", *extra],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for _ in range(500):
            try:
                redis.Redis(host="127.0.0.1", port=port).ping()
                return port
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {port} did not start")

    # A replica's first sync starts at once: Redis 7 otherwise waits 5 s (repl-diskless-sync-delay)
    # for more replicas to share one transfer, and the test would wait with it.
    primary = start("--repl-diskless-sync-delay", "0")
    yield primary, lambda: start("--replicaof", "127.0.0.1", str(primary))
    for proc in procs:
        proc.terminate()
        proc.wait(10)


async def test_a_submission_no_replica_confirmed_fails_and_its_retry_queues_nothing_twice(
        lone_primary, settings, wait_until):
    port, start_replica = lone_primary
    url = f"redis://127.0.0.1:{port}/0"
    settings = settings.model_copy(update={"redis_url": url, "replica_acks": 1, "replica_ack_timeout_ms": 200})
    job = {"job_id": new_id(), "task": "echo", "instance": {"prompt": "p"}}
    r = async_redis(url)
    try:
        async with AsyncClient(settings=settings) as client:
            with pytest.raises(RedisRefusesWrites, match="0 of 1 replica"):
                await client.submit(job)
            start_replica()

            async def replica_online():  # synced: a replica acknowledges offsets only from then on
                return (await r.info("replication")).get("slave0", {}).get("state") == "online"

            await wait_until(replica_online, what="the replica online")
        # The retry waits longer: 200 ms was for the refusal above; on a busy machine a replica
        # that is online can take longer than that to answer WAIT's GETACK.
        patient = settings.model_copy(update={"replica_ack_timeout_ms": 10_000})
        async with AsyncClient(settings=patient) as client:
            again = await client.submit(job)  # the same job id: now confirmed, queued once
        assert again.duplicate and again.status == "queued"
        assert await r.xlen(Keys(settings.namespace).init_stream) == 1
    finally:
        await r.aclose()
