"""Redis behind Sentinel: workers and the client reach the primary through a redis+sentinel://
URL, follow a failover by themselves, and a primary SIGKILLed mid-load loses no job the client
was told was queued and doubles none (replica_acks=1: Redis WAIT before a write counts)."""

from __future__ import annotations

import asyncio
from collections import Counter

import redis

from rollstream.client import AsyncClient
from rollstream.errors import RedisUnavailable
from rollstream.messages import new_id
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys

# Longer than a failover (about 2-5 s here): jobs held while the primary changes are not taken
# from their live workers, and live nodes are not rescued as dead.
DURABLE = {"visibility_timeout_s": 10.0, "worker_ttl_s": 10.0}
ACKS_ENV = {"ROLLSTREAM_REPLICA_ACKS": "1", "ROLLSTREAM_REPLICA_ACK_TIMEOUT_MS": "2000"}


def _echo(job_id: str, run_s: float = 0.2) -> dict:
    return {"job_id": job_id, "task": "echo", "instance": {"prompt": job_id, "run_s": run_s}}


async def _submit_until_told_to_stop(client: AsyncClient, acknowledged: list[str], stop: asyncio.Event) -> None:
    """What a trainer does: submit, and retry a submission that failed with the same job id
    (a retry queues nothing twice) until Redis says it holds it."""
    while not stop.is_set():
        ids = [new_id() for _ in range(4)]
        while True:
            try:
                await client.submit_many([_echo(j) for j in ids])
                break
            except (RedisUnavailable, redis.RedisError, OSError):
                await asyncio.sleep(0.2)
        acknowledged.extend(ids)
        await asyncio.sleep(0.05)


async def _read_results(client: AsyncClient, seen: Counter, stop: asyncio.Event) -> None:
    """Results as a trainer reads them: a read that fails while the primary changes is retried."""
    while not stop.is_set():
        try:
            async for result in client.results(timeout_s=0.5):
                assert result.status == "completed", result
                seen[result.job_id] += 1
        except (RedisUnavailable, redis.RedisError, OSError):
            await asyncio.sleep(0.2)


async def test_primary_killed_mid_load_loses_no_acknowledged_job_and_doubles_none(
        sentinel_redis, worker_pool, settings, wait_until):
    url = sentinel_redis.url
    settings = settings.model_copy(update={"redis_url": url, "replica_acks": 1, "replica_ack_timeout_ms": 2000,
                                           **DURABLE})
    pool = worker_pool(redis_url=url, **DURABLE)
    pool.env.update(ACKS_ENV)
    pool.start_all(concurrency=16)
    watcher = async_redis(url)
    keys = Keys(settings.namespace)
    try:
        await pool.wait_registered(watcher, keys.workers, 3)
        acknowledged: list[str] = []
        seen: Counter = Counter()
        stop_submitting, stop_reading = asyncio.Event(), asyncio.Event()
        async with AsyncClient(settings=settings) as client:
            submitter = asyncio.create_task(_submit_until_told_to_stop(client, acknowledged, stop_submitting))
            reader = asyncio.create_task(_read_results(client, seen, stop_reading))

            async def some_done():
                return sum(seen.values()) >= 20

            await wait_until(some_done, timeout_s=60, what="20 results before the failover")
            old = sentinel_redis.kill_primary()
            new = await sentinel_redis.wait_failover(old)
            before_recovery = len(acknowledged)

            async def submitting_again():
                return len(acknowledged) >= before_recovery + 20

            await wait_until(submitting_again, timeout_s=60, what="submissions acknowledged by the new primary")
            stop_submitting.set()
            await submitter

            async def all_in():
                return set(seen) >= set(acknowledged)

            await wait_until(all_in, timeout_s=90, what=f"results of all {len(acknowledged)} acknowledged jobs")
            await asyncio.sleep(2.0)  # a late second result would arrive now
            stop_reading.set()
            await reader
        pool.check_alive()  # every worker followed the failover: none exited
        assert new != old
        doubled = {job_id: n for job_id, n in seen.items() if n > 1}
        assert not doubled, f"jobs with more than one result: {doubled}"
        assert set(seen) == set(acknowledged), (
            f"lost: {sorted(set(acknowledged) - set(seen))[:10]}, "
            f"unknown: {sorted(set(seen) - set(acknowledged))[:10]}")
    finally:
        await watcher.aclose()


async def test_workers_and_the_client_leave_a_primary_that_sentinel_demotes(
        sentinel_redis, worker_pool, settings, wait_until):
    """SENTINEL FAILOVER: the old primary answers on for seconds (until the Sentinels turn it
    into a replica), without replicas: writes there that no replica confirms must go again to the
    new primary, and once the old one is a replica every client must leave it."""
    url = sentinel_redis.url
    settings = settings.model_copy(update={"redis_url": url, "replica_acks": 1, "replica_ack_timeout_ms": 2000,
                                           **DURABLE})
    pool = worker_pool(redis_url=url, **DURABLE)
    pool.env.update(ACKS_ENV)
    pool.start_all(concurrency=16)
    watcher = async_redis(url)
    try:
        await pool.wait_registered(watcher, Keys(settings.namespace).workers, 3)
        async with AsyncClient(settings=settings) as client:
            before = await client.submit_many([_echo(new_id(), run_s=2.0) for _ in range(8)])

            async def at_work():
                return all(s and s.stage == "run" for s in [await client.status(j) for j in before])

            await wait_until(at_work, what="jobs at work in run")
            old = sentinel_redis.primary_port()
            redis.Redis(host="127.0.0.1", port=sentinel_redis.sentinel_ports[0]).execute_command(
                "SENTINEL", "FAILOVER", sentinel_redis.service)
            new = await sentinel_redis.wait_failover(old)

            async def old_is_replica():
                return redis.Redis(host="127.0.0.1", port=old).info("replication")["role"] == "slave"

            await wait_until(old_is_replica, timeout_s=60, what="the old primary turned into a replica")
            while True:  # the client's first call after the switch may meet the demoted primary
                try:
                    after = await client.submit_many([_echo(new_id()) for _ in range(8)])
                    break
                except (RedisUnavailable, redis.RedisError, OSError):
                    await asyncio.sleep(0.2)
            seen: Counter = Counter()

            async def all_in():
                try:
                    async for result in client.results(timeout_s=0.5):
                        assert result.status == "completed", result
                        seen[result.job_id] += 1
                except (RedisUnavailable, redis.RedisError, OSError):
                    pass
                return set(seen) >= set(before) | set(after)

            await wait_until(all_in, timeout_s=90, what="results of the jobs from before and after the failover")
            await all_in()  # a late second result would arrive now
        pool.check_alive()
        assert new != old
        assert set(seen) == set(before) | set(after) and set(seen.values()) == {1}, seen
    finally:
        await watcher.aclose()
