"""Generation paused around a weight sync, against a real redis-server: no turn starts while
paused (acquire waits, whichever process asks), the pause returns only once the turns in flight
have finished, and a pause nobody ends expires by itself."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from rollstream.llm.balancer import Balancer, generation_paused


async def test_no_turn_starts_while_generation_is_paused_and_all_start_on_resume(balancer: Balancer):
    await balancer.register("http://b0:8000")
    await balancer.pause("weight sync v1")
    waiting = [asyncio.create_task(balancer.acquire(f"job-{i}")) for i in range(8)]
    await asyncio.sleep(0.5)
    assert not any(task.done() for task in waiting)
    assert await balancer.in_flight() == {"http://b0:8000": 0}
    assert (await balancer.paused())["reason"] == "weight sync v1"
    assert await balancer.resume()
    leases = await asyncio.wait_for(asyncio.gather(*waiting), timeout=10)
    assert {lease.backend for lease in leases} == {"http://b0:8000"}
    assert await balancer.in_flight() == {"http://b0:8000": 8}


async def test_a_pause_returns_only_once_the_turns_in_flight_have_finished(balancer: Balancer):
    await balancer.register("http://b0:8000")
    held = [await balancer.acquire(f"job-{i}") for i in range(3)]

    async def finish_turns_later():
        await asyncio.sleep(0.6)
        await balancer.release(*held)

    finisher = asyncio.create_task(finish_turns_later())
    drained_s = await balancer.pause("weight sync v2", drain_timeout_s=30)
    assert finisher.done() and drained_s >= 0.5
    assert await balancer.in_flight() == {"http://b0:8000": 0}
    await balancer.resume()


async def test_a_pause_whose_turns_never_finish_times_out_and_resumes(balancer: Balancer):
    await balancer.register("http://b0:8000")
    await balancer.acquire("stuck-job")
    with pytest.raises(TimeoutError, match="1 model turns still in flight"):
        await balancer.pause("weight sync v3", drain_timeout_s=0.3)
    assert await balancer.paused() is None
    assert (await asyncio.wait_for(balancer.acquire("next-job"), timeout=5)).backend == "http://b0:8000"


async def test_a_pause_nobody_ends_expires_by_itself(balancer: Balancer):
    await balancer.register("http://b0:8000")
    await balancer.pause("a trainer that will die", ttl_s=0.5)
    lease = await asyncio.wait_for(balancer.acquire("job"), timeout=10)
    assert lease.backend == "http://b0:8000"


async def test_another_process_waits_for_a_pause_made_elsewhere(redis_url: str, namespace: str):
    trainer = Balancer(Redis.from_url(redis_url), namespace=namespace)
    worker = Balancer(Redis.from_url(redis_url), namespace=namespace, worker_id="run-worker")
    try:
        await trainer.register("http://b0:8000")
        async with generation_paused(trainer.redis, namespace, "weight sync v4"):
            turn = asyncio.create_task(worker.acquire("job"))
            await asyncio.sleep(0.3)
            assert not turn.done()
        assert (await asyncio.wait_for(turn, timeout=5)).backend == "http://b0:8000"
    finally:
        await trainer.redis.aclose()
        await worker.redis.aclose()
