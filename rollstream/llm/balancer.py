"""The LLM backend balancer: a Redis min-heap of inference servers scored by requests in
flight, changed only by the Lua scripts in llm/lua/balancer_*.lua. Run workers acquire
a backend per model turn; jobs stick to their backend and groups prefer a shared one."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, Field
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollstream.pipeline.connection import Outage, transient_problem
from rollstream.pipeline.keys import Keys

log = logging.getLogger(__name__)

LUA_DIR = Path(__file__).parent / "lua"
PAUSE_POLL_S = 0.05  # how often a paused process looks whether generation resumed


class NoBackendAvailable(RuntimeError):
    """Every registered backend is ejected, or none is registered."""


@dataclass(frozen=True)
class Lease:
    """One in-flight slot on a backend, held by one request of one job."""

    lease_id: str
    backend: str
    job_id: str
    reason: str  # why this backend: "job" (sticky), "group" (affinity) or "least_loaded"


class BackendStatus(BaseModel):
    """One row of `rollstream backends list`."""

    url: str
    in_flight: int
    healthy: bool
    info: dict = Field(default_factory=dict)


def _load_script(name: str) -> str:
    common = (LUA_DIR / "balancer_common.lua").read_text()
    return common + "\n" + (LUA_DIR / f"balancer_{name}.lua").read_text()


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def normalize_url(url: str) -> str:
    """One spelling per backend, so `add http://h:8000/` and `http://h:8000` are the same.
    Raises ValueError for a URL with no host (``http:///``)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if not rest.strip("/"):
        raise ValueError(f"backend URL {url!r} names no host; give one like http://10.0.0.5:8000")
    return f"{scheme}://{rest.rstrip('/')}"


class Balancer:
    """Acquire/release in-flight slots on LLM backends; every mutation is one Lua script.

    Typical use per model turn::

        lease = await balancer.acquire(job_id, group_id)
        try: ... generate on lease.backend ...
        finally: await balancer.release(lease)
    """

    def __init__(
        self,
        redis: Redis,
        namespace: str = "rs",
        group_affinity_slack: int = 2,
        lease_ttl_s: float = 60.0,
        affinity_ttl_s: int = 3600,
        reclaim_batch: int = 16,
        worker_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.keys = Keys(namespace)
        self.group_affinity_slack = group_affinity_slack
        self.lease_ttl_s = lease_ttl_s
        self.affinity_ttl_s = affinity_ttl_s
        self.reclaim_batch = reclaim_batch
        self.worker_id = worker_id or default_worker_id()
        self._held: dict[str, Lease] = {}
        self._resumed: asyncio.Future | None = None
        # The keys every lease script takes first, in the order the Lua scripts name them.
        self._lease_keys = [self.keys.backends, self.keys.backends_down, self.keys.leases, self.keys.lease_backends]
        self._scripts = {
            name: redis.register_script(_load_script(name))
            for name in ("acquire", "release", "renew", "reclaim", "register", "remove", "mark")
        }

    # -- backends -------------------------------------------------------------------------

    async def register(self, url: str, info: dict | None = None) -> bool:
        """Add a backend with no load; True when it was new (known ones keep their state)."""
        url = normalize_url(url)
        payload = json.dumps({"registered_at": time.time(), **(info or {})})
        k = self.keys
        added = await self._scripts["register"](
            keys=[k.backends, k.backends_down, k.backends_info],
            args=[url, payload, "1" if info else "0"],
        )
        log.info("backend registered", extra={"backend": url, "new": bool(added)})
        return bool(added)

    async def remove(self, url: str) -> bool:
        url = normalize_url(url)
        k = self.keys
        removed = await self._scripts["remove"](
            keys=[k.backends, k.backends_down, k.backends_info], args=[url]
        )
        return bool(removed)

    async def mark_down(self, url: str) -> bool:
        """Eject a backend: acquire skips it until mark_up (or the health checker) readmits."""
        url = normalize_url(url)
        moved = await self._scripts["mark"](
            keys=[self.keys.backends, self.keys.backends_down], args=[url]
        )
        if moved:
            log.warning("backend ejected", extra={"backend": url})
        return bool(moved)

    async def mark_up(self, url: str) -> bool:
        url = normalize_url(url)
        moved = await self._scripts["mark"](
            keys=[self.keys.backends_down, self.keys.backends], args=[url]
        )
        if moved:
            log.info("backend readmitted", extra={"backend": url})
        return bool(moved)

    async def backends(self) -> list[BackendStatus]:
        """All registered backends, healthy first, each with its in-flight count."""
        k = self.keys
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zrange(k.backends, 0, -1, withscores=True)
            pipe.zrange(k.backends_down, 0, -1, withscores=True)
            pipe.hgetall(k.backends_info)
            up, down, info = await pipe.execute()
        info = {_s(u): json.loads(_s(v)) for u, v in info.items()}
        rows = [BackendStatus(url=_s(u), in_flight=int(s), healthy=True) for u, s in up]
        rows += [BackendStatus(url=_s(u), in_flight=int(s), healthy=False) for u, s in down]
        for row in rows:
            row.info = info.get(row.url, {})
        return rows

    async def in_flight(self) -> dict[str, int]:
        return {b.url: b.in_flight for b in await self.backends()}

    # -- leases ---------------------------------------------------------------------------

    async def acquire(
        self,
        job_id: str,
        group_id: str | None = None,
        worker_id: str | None = None,
        lease_ttl_s: float | None = None,
    ) -> Lease:
        """Take one in-flight slot: the job's own backend if it is healthy, else its group's
        backend while within the slack, else the least loaded one."""
        k = self.keys
        ttl_ms = int((lease_ttl_s or self.lease_ttl_s) * 1000)
        while True:
            result = await self._scripts["acquire"](
                keys=[*self._lease_keys, k.lease_seq, k.job_backend(job_id),
                      k.group_backends(group_id) if group_id else "", k.generation_paused],
                args=[
                    worker_id or self.worker_id,
                    ttl_ms,
                    self.group_affinity_slack,
                    self.affinity_ttl_s,
                    self.reclaim_batch,
                ],
            )
            if not (result and _s(result[2]) == "paused"):
                break
            await self._until_resumed()
        if not result:
            raise NoBackendAvailable(
                f"no healthy LLM backend in {k.backends}; register one with "
                f"'rollstream backends add URL' (or start 'rollstream serve-model'), "
                f"or check why all are ejected in {k.backends_down}"
            )
        lease = Lease(_s(result[0]), _s(result[1]), job_id, _s(result[2]))
        self._held[lease.lease_id] = lease
        return lease

    async def _until_resumed(self) -> None:
        """Wait while generation is paused: one poll of the flag per process, however many
        turns wait (the flag expires by itself, so this never waits past its ttl)."""
        if self._resumed is None or self._resumed.done():
            self._resumed = asyncio.ensure_future(self._poll_resumed())
        await asyncio.shield(self._resumed)

    async def _poll_resumed(self) -> None:
        while await self.redis.exists(self.keys.generation_paused):
            await asyncio.sleep(PAUSE_POLL_S)

    async def pause(self, reason: str, *, ttl_s: float = 600.0, drain_timeout_s: float = 120.0) -> float:
        """Pause generation on every backend: no new turn starts (acquire waits), and this
        returns once the turns in flight have finished, with the seconds that took. The pause
        ends with resume(), or by itself after ttl_s. Raises TimeoutError, resuming first,
        when turns are still in flight after drain_timeout_s."""
        k = self.keys
        await self.redis.set(k.generation_paused, json.dumps({"reason": reason, "by": self.worker_id,
                                                              "at": time.time()}), px=max(1, int(ttl_s * 1000)))
        log.info("generation paused", extra={"reason": reason})
        started = time.monotonic()
        while True:
            await self.reclaim_expired()
            in_flight = sum((await self.in_flight()).values())
            if in_flight <= 0:
                return time.monotonic() - started
            if time.monotonic() - started > drain_timeout_s:
                await self.resume()
                raise TimeoutError(f"{in_flight} model turns still in flight {drain_timeout_s:.0f} s after pausing "
                                   f"generation ({reason}); generation resumed. A backend that hangs holds them: "
                                   "check 'rollstream backends list'")
            await asyncio.sleep(PAUSE_POLL_S)

    async def resume(self) -> bool:
        """End a pause; True when generation was paused."""
        resumed = bool(await self.redis.delete(self.keys.generation_paused))
        if resumed:
            log.info("generation resumed")
        return resumed

    async def paused(self) -> dict | None:
        """Who paused generation and why, while it is paused; else None."""
        raw = await self.redis.get(self.keys.generation_paused)
        return json.loads(_s(raw)) if raw else None

    async def release(self, *leases: Lease | str) -> int:
        """Give slots back; returns how many were still held (expired ones count 0)."""
        ids = [lease.lease_id if isinstance(lease, Lease) else lease for lease in leases]
        if not ids:
            return 0
        for lease_id in ids:
            self._held.pop(lease_id, None)
        # Releasing twice counts once, so a release that met a restarting Redis is retried
        # for a while; past that, the lease expires and keep_alive's reclaim gives it back.
        pause, deadline = 0.1, time.monotonic() + self.lease_ttl_s / 2
        while True:
            try:
                return int(await self._scripts["release"](keys=self._lease_keys, args=ids))
            except (RedisConnectionError, RedisTimeoutError):
                if time.monotonic() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)

    async def renew(
        self, leases: Iterable[Lease | str] | None = None, lease_ttl_s: float | None = None
    ) -> int:
        """Extend leases (default: all this process holds); returns how many are still live."""
        if leases is None:
            leases = list(self._held)
        ids = [lease.lease_id if isinstance(lease, Lease) else lease for lease in leases]
        if not ids:
            return 0
        ttl_ms = int((lease_ttl_s or self.lease_ttl_s) * 1000)
        return int(await self._scripts["renew"](keys=self._lease_keys, args=[ttl_ms, *ids]))

    async def reclaim_expired(self, limit: int = 10_000) -> int:
        """Give back the slots of leases whose worker died; safe to run from anywhere."""
        return int(await self._scripts["reclaim"](keys=self._lease_keys, args=[limit]))

    async def forget_job(self, job_id: str) -> None:
        """Drop a finished job's stickiness so its key does not linger until the ttl."""
        await self.redis.delete(self.keys.job_backend(job_id))

    async def keep_alive(self, interval_s: float | None = None) -> None:
        """Run forever: renew this process's leases and reclaim dead workers' ones."""
        interval_s = interval_s or self.lease_ttl_s / 3
        outage = Outage("lease keep-alive")
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.renew()
                await self.reclaim_expired()
                outage.recovered()
            except Exception as exc:  # a Redis blip must not kill the renewer; the next round retries
                if transient_problem(exc):
                    outage.failed(exc)  # logged once (a full disk under Redis lasts)
                else:
                    log.exception("lease keep-alive failed; retrying in %.1fs", interval_s)


class HealthChecker:
    """Ejects backends whose GET /health fails and readmits them when it answers again."""

    def __init__(
        self,
        balancer: Balancer,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        failures_to_eject: int = 2,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.balancer = balancer
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures_to_eject = failures_to_eject
        self._http = http or httpx.AsyncClient()
        self._failures: dict[str, int] = {}

    async def _healthy(self, url: str) -> bool:
        try:
            response = await self._http.get(f"{url}/health", timeout=self.timeout_s)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def check_once(self) -> dict[str, bool]:
        """Probe every backend once; returns url -> answered /health."""
        rows = await self.balancer.backends()
        results = await asyncio.gather(*(self._healthy(r.url) for r in rows))
        for row, ok in zip(rows, results):
            if ok:
                self._failures.pop(row.url, None)
                if not row.healthy:
                    await self.balancer.mark_up(row.url)
            else:
                self._failures[row.url] = self._failures.get(row.url, 0) + 1
                if row.healthy and self._failures[row.url] >= self.failures_to_eject:
                    await self.balancer.mark_down(row.url)
        return {row.url: ok for row, ok in zip(rows, results)}

    async def run(self) -> None:
        outage = Outage("backend health checks")
        while True:
            try:
                await self.check_once()
                outage.recovered()
            except Exception as exc:  # keep probing through Redis blips
                if transient_problem(exc):
                    outage.failed(exc)
                else:
                    log.exception("health check round failed")
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        await self._http.aclose()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- operator functions behind `rollstream backends add|list|remove` -----------------------


async def add_backend(redis: Redis, url: str, namespace: str = "rs", info: dict | None = None) -> bool:
    return await Balancer(redis, namespace=namespace).register(url, info)


async def list_backends(redis: Redis, namespace: str = "rs") -> list[BackendStatus]:
    return await Balancer(redis, namespace=namespace).backends()


async def remove_backend(redis: Redis, url: str, namespace: str = "rs") -> bool:
    return await Balancer(redis, namespace=namespace).remove(url)


@asynccontextmanager
async def generation_paused(redis: Redis, namespace: str, reason: str, *, ttl_s: float = 600.0,
                            drain_timeout_s: float = 120.0) -> AsyncIterator[float]:
    """``async with generation_paused(r, ns, "weight sync v3") as drained_s:`` no model turn
    runs on any backend inside the block (those in flight finished before it starts), so a
    weight load never lands mid-turn and every turn's policy version is exact."""
    balancer = Balancer(redis, namespace=namespace)
    drained_s = await balancer.pause(reason, ttl_s=ttl_s, drain_timeout_s=drain_timeout_s)
    try:
        yield drained_s
    finally:
        await balancer.resume()
