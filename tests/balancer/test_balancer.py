"""The Lua balancer against a real redis-server: min-heap, stickiness, group affinity within
the slack, releases, concurrency, dead workers' leases and ejected backends."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from redis.asyncio import Redis

from rollstream.llm.balancer import (
    Balancer,
    HealthChecker,
    NoBackendAvailable,
    add_backend,
    list_backends,
    normalize_url,
    remove_backend,
)

BACKENDS = ["http://b0:8000", "http://b1:8000", "http://b2:8000", "http://b3:8000"]


async def _register(balancer: Balancer, urls=BACKENDS) -> None:
    for url in urls:
        await balancer.register(url)


def test_a_backend_has_one_spelling_and_a_url_without_a_host_is_refused():
    assert normalize_url(" http://h:8000/ ") == normalize_url("h:8000") == "http://h:8000"
    assert normalize_url("https://h/v1//") == "https://h/v1"
    for hostless in ("http:///", "http://", "///"):
        with pytest.raises(ValueError, match="names no host"):
            normalize_url(hostless)


async def test_acquire_picks_least_loaded_backend(balancer: Balancer):
    await _register(balancer)
    for i in range(12):
        before = await balancer.in_flight()
        lease = await balancer.acquire(f"job{i}")
        assert before[lease.backend] == min(before.values())
        assert lease.reason == "least_loaded"
    assert set((await balancer.in_flight()).values()) == {3}


async def test_job_keeps_its_backend_across_turns_even_when_busier(balancer: Balancer):
    await _register(balancer)
    first = await balancer.acquire("job", "g")
    await balancer.release(first)
    # Load the job's backend more than the others between its turns.
    others = [await balancer.acquire(f"other{i}") for i in range(3)]
    extra = await balancer.acquire("job2", "g")
    assert extra.backend == first.backend
    second = await balancer.acquire("job")
    assert second.backend == first.backend and second.reason == "job"
    await balancer.release(second, extra, *others)


async def test_group_prefers_its_backend_while_within_slack(balancer: Balancer):
    await _register(balancer)
    leases = [await balancer.acquire(f"job{i}", "group") for i in range(4)]
    home = leases[0].backend
    # slack 2: loads 1, 2, 3 on the group's backend keep it within min (0) + 2 ...
    assert [lease.backend for lease in leases[:3]] == [home] * 3
    assert [lease.reason for lease in leases[:3]] == ["least_loaded", "group", "group"]
    # ... then load 3 > 0 + 2 sends the fourth job to the least loaded backend.
    assert leases[3].backend != home and leases[3].reason == "least_loaded"
    loads = await balancer.in_flight()
    assert max(loads.values()) - min(loads.values()) <= balancer.group_affinity_slack + 1


async def test_zero_slack_spreads_a_group_like_least_loaded(redis_client: Redis, namespace: str):
    balancer = Balancer(redis_client, namespace=namespace, group_affinity_slack=0)
    await _register(balancer)
    leases = [await balancer.acquire(f"job{i}", "group") for i in range(4)]
    assert len({lease.backend for lease in leases}) == 4


async def test_release_brings_counts_back_and_counts_once(balancer: Balancer):
    await _register(balancer)
    leases = [await balancer.acquire(f"job{i}", f"g{i % 2}") for i in range(10)]
    assert sum((await balancer.in_flight()).values()) == 10
    assert await balancer.release(*leases) == 10
    assert await balancer.release(*leases) == 0  # a second release is a no-op
    assert set((await balancer.in_flight()).values()) == {0}


async def test_200_concurrent_jobs_over_4_backends_leave_every_count_at_zero(
    redis_url: str, namespace: str
):
    # Several clients (connection pools) like several run workers.
    clients = [Redis.from_url(redis_url) for _ in range(4)]
    balancers = [Balancer(c, namespace=namespace, worker_id=f"w{i}") for i, c in enumerate(clients)]
    await _register(balancers[0])
    peak: dict[str, int] = {}

    async def job(i: int) -> None:
        balancer = balancers[i % len(balancers)]
        for _turn in range(3):
            lease = await balancer.acquire(f"job{i}", f"group{i // 8}")
            await asyncio.sleep(0)
            await balancer.release(lease)
        await balancer.forget_job(f"job{i}")

    async def watch() -> None:
        for _ in range(20):
            for url, n in (await balancers[0].in_flight()).items():
                peak[url] = max(peak.get(url, 0), n)
            await asyncio.sleep(0)

    await asyncio.gather(watch(), *(job(i) for i in range(200)))
    loads = await balancers[0].in_flight()
    assert loads == {url: 0 for url in BACKENDS}
    assert await clients[0].zcard(balancers[0].keys.leases) == 0
    for client in clients:
        await client.aclose()


async def test_sigkilled_worker_leases_expire_and_counts_return(
    redis_url: str, redis_client: Redis, namespace: str
):
    balancer = Balancer(redis_client, namespace=namespace)
    await _register(balancer)
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from redis.asyncio import Redis
        from rollstream.llm.balancer import Balancer

        async def main():
            b = Balancer(Redis.from_url({redis_url!r}), namespace={namespace!r}, lease_ttl_s=1.0)
            for i in range(6):
                await b.acquire(f"dying{{i}}", "g")
            print("holding", flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "holding"
        assert sum((await balancer.in_flight()).values()) == 6
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.kill()
        worker.wait()
    # Any process may reclaim; poll until the 1 s leases have expired (bounded wait).
    for _ in range(100):
        await balancer.reclaim_expired()
        if sum((await balancer.in_flight()).values()) == 0:
            break
        await asyncio.sleep(0.1)
    assert set((await balancer.in_flight()).values()) == {0}
    assert await redis_client.zcard(balancer.keys.leases) == 0


async def test_acquire_reclaims_expired_leases_on_the_way(balancer: Balancer):
    await _register(balancer, BACKENDS[:1])
    await balancer.acquire("ghost", lease_ttl_s=0.05)
    await asyncio.sleep(0.2)
    lease = await balancer.acquire("alive")
    assert (await balancer.in_flight())[lease.backend] == 1


async def test_renewed_lease_survives_reclaim(balancer: Balancer):
    await _register(balancer, BACKENDS[:1])
    lease = await balancer.acquire("job", lease_ttl_s=0.3)
    assert await balancer.renew([lease], lease_ttl_s=30) == 1
    await asyncio.sleep(0.5)
    assert await balancer.reclaim_expired() == 0
    assert await balancer.release(lease) == 1


async def test_marked_down_backend_is_skipped_and_readmitted(balancer: Balancer):
    await _register(balancer)
    first = await balancer.acquire("job", "g")
    assert await balancer.mark_down(first.backend)
    leases = [await balancer.acquire(f"j{i}", "g") for i in range(20)]
    assert first.backend not in {lease.backend for lease in leases}
    moved = await balancer.acquire("job", "g")  # the sticky job moves off its dead backend
    assert moved.backend != first.backend
    # A request still running on the ejected backend is released against it.
    rows = {r.url: r for r in await balancer.backends()}
    assert rows[first.backend].healthy is False and rows[first.backend].in_flight == 1
    await balancer.release(first)
    assert await balancer.mark_up(first.backend)
    rows = {r.url: r for r in await balancer.backends()}
    assert rows[first.backend].healthy and rows[first.backend].in_flight == 0


async def test_no_healthy_backend_raises_an_error_that_says_what_to_do(balancer: Balancer):
    with pytest.raises(NoBackendAvailable, match="backends add"):
        await balancer.acquire("job")
    await _register(balancer, BACKENDS[:1])
    await balancer.mark_down(BACKENDS[0])
    with pytest.raises(NoBackendAvailable):
        await balancer.acquire("job")


async def test_removed_backend_is_not_recreated_by_a_late_release(balancer: Balancer):
    await _register(balancer, BACKENDS[:2])
    lease = await balancer.acquire("job")
    assert await balancer.remove(lease.backend)
    assert await balancer.release(lease) == 1
    assert lease.backend not in await balancer.in_flight()


async def test_operator_functions_add_list_remove(redis_client: Redis, namespace: str):
    assert await add_backend(redis_client, "localhost:8000/", namespace, {"model": "tiny"})
    assert not await add_backend(redis_client, "http://localhost:8000", namespace)
    rows = await list_backends(redis_client, namespace)
    assert [(r.url, r.in_flight, r.healthy) for r in rows] == [("http://localhost:8000", 0, True)]
    assert rows[0].info["model"] == "tiny"
    assert await remove_backend(redis_client, "http://localhost:8000", namespace)
    assert await list_backends(redis_client, namespace) == []


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


async def test_health_checker_ejects_a_dead_backend_and_readmits_it(balancer: Balancer):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    await balancer.register(url)
    await balancer.register("http://127.0.0.1:9")  # nothing listens on the discard port
    checker = HealthChecker(balancer, timeout_s=1.0, failures_to_eject=2)
    try:
        assert await checker.check_once() == {url: True, "http://127.0.0.1:9": False}
        assert all(r.healthy for r in await balancer.backends())  # one failure is tolerated
        await checker.check_once()
        health = {r.url: r.healthy for r in await balancer.backends()}
        assert health == {url: True, "http://127.0.0.1:9": False}

        server.shutdown()
        server.server_close()
        await checker.check_once()
        await checker.check_once()
        assert not any(r.healthy for r in await balancer.backends())

        server = ThreadingHTTPServer(("127.0.0.1", int(url.rsplit(":", 1)[1])), _Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        await checker.check_once()
        health = {r.url: r.healthy for r in await balancer.backends()}
        assert health[url] is True
    finally:
        server.shutdown()
        server.server_close()
        await checker.aclose()


async def test_an_overflowing_group_prefers_the_backends_it_already_uses(balancer: Balancer):
    await _register(balancer)
    leases = [await balancer.acquire(f"job{i}", "group") for i in range(4)]
    home, overflow = leases[0].backend, leases[3].backend
    # Both now hold the group's prompt; the next job takes the less loaded of the two
    # (load 1, within 0 + slack) rather than an idle backend that has nothing cached.
    fifth = await balancer.acquire("job4", "group")
    assert fifth.backend == overflow and fifth.reason == "group"
    assert home != overflow


async def test_keep_alive_renews_the_leases_this_process_holds(redis_client: Redis, namespace: str):
    balancer = Balancer(redis_client, namespace=namespace, lease_ttl_s=0.5)
    await _register(balancer, BACKENDS[:1])
    lease = await balancer.acquire("long-turn")
    renewer = asyncio.create_task(balancer.keep_alive(interval_s=0.1))
    try:
        await asyncio.sleep(1.0)  # twice the ttl: only renewal keeps the lease alive
        assert await balancer.reclaim_expired() == 0
    finally:
        renewer.cancel()
    assert await balancer.release(lease) == 1
