"""Connecting to Redis: URLs with passwords, ACL users, TLS (rediss://), unix sockets and
Sentinel (redis+sentinel://, see sentinel.py), async and sync clients, and an error that
says what to do when nobody answers."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import redis
import redis.asyncio as aioredis

try:
    import hiredis
except ImportError:  # redis[hiredis] brings it; without it commands are packed in Python
    hiredis = None  # type: ignore[assignment]  # the module, or None where it is not installed

from rollstream.errors import RedisRefusesWrites, RedisUnavailable
from rollstream.pipeline import sentinel

log = logging.getLogger(__name__)

_HINT = ("start one with 'rollstream redis', or set REDIS_URL (e.g. redis://:password@host:6379/0, or "
         "redis+sentinel://:password@sentinel1:26379,sentinel2:26379/SERVICE/0 for a primary behind Sentinel)")


def redacted(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    url = re.sub(r"(sentinel_password=)[^&]*", r"\1***", url)
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


# Blocking reads (XREADGROUP BLOCK) are always issued in slices shorter than this, so a
# read that outlives it means Redis is hung, not that the stream is quiet.
SOCKET_TIMEOUT_S = 30.0
MAX_BLOCK_MS = 5000


def _with_c_packer(cls: type) -> type:
    """The connection class with hiredis's C command packer. redis-py's asyncio
    connections pack every command in Python, which is most of the client's CPU per
    stage hand-off (a script call has a dozen arguments)."""

    class FastPacking(cls):
        def pack_command(self, *args):
            first = args[0]
            if isinstance(first, str) and " " in first or isinstance(first, bytes) and b" " in first:
                args = (*first.split(), *args[1:])
            return [hiredis.pack_command(args)]

    FastPacking.__name__ = cls.__name__
    return FastPacking


def async_redis(url: str, *, max_connections: int = 512) -> aioredis.Redis:
    """An asyncio client for ``url``; commands pool their connections. Behind Sentinel, each
    new connection goes to the primary the Sentinels name then."""
    options: dict[str, Any] = {"max_connections": max_connections, "health_check_interval": 30,
               "socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": 10}
    if sentinel.is_sentinel_url(url):
        client = sentinel.async_primary(url, **options)
    else:
        client = aioredis.Redis.from_url(url, **options)
    if hiredis is not None and hasattr(hiredis, "pack_command"):
        pool = client.connection_pool
        pool.connection_class = _with_c_packer(pool.connection_class)
    return client


def sync_redis(url: str) -> redis.Redis:
    options = {"health_check_interval": 30, "socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": 10}
    if sentinel.is_sentinel_url(url):
        return sentinel.sync_primary(url, **options)
    return redis.Redis.from_url(url, **options)


async def check_async(r: aioredis.Redis, url: str) -> None:
    try:
        await r.ping()
    except (redis.ConnectionError, OSError) as exc:
        raise RedisUnavailable(f"no Redis at {redacted(url)} ({exc}); {_HINT}") from exc
    except redis.AuthenticationError as exc:
        raise RedisUnavailable(f"Redis at {redacted(url)} refused the credentials ({exc}); "
                               "put the password in the URL: redis://user:password@host:port") from exc


def check_sync(r: redis.Redis, url: str) -> None:
    try:
        r.ping()
    except redis.AuthenticationError as exc:
        raise RedisUnavailable(f"Redis at {redacted(url)} refused the credentials ({exc}); "
                               "put the password in the URL: redis://user:password@host:port") from exc
    except (redis.ConnectionError, OSError) as exc:
        raise RedisUnavailable(f"no Redis at {redacted(url)} ({exc}); {_HINT}") from exc


def raise_if_cancelled() -> None:
    """Call after each blocking read in a loop. redis-py's asyncio client (8.1 here, on
    Python 3.11) can swallow a task's cancellation that lands during a blocking read
    (XREAD/XREADGROUP BLOCK): the read returns its empty reply as if nothing happened and
    the task, though ``cancelling()``, reads on, so whoever awaits it (a test stopping
    in-process workers, ``asyncio.wait_for``) hangs. Raising here restores the cancel."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


# What Redis answers while it cannot take writes for a while, and what the operator can do.
# Each passes by itself once the cause is gone: workers wait them out, clients are told.
_REFUSALS = {
    "MISCONF": "Redis cannot persist and refuses writes (its disk is full or unwritable); free space "
               "where its AOF/RDB lives (its --dir); writes resume by themselves",
    "READONLY": "Redis is a read-only replica; point REDIS_URL at the primary (or wait for a failover)",
    "OOM": "Redis is at its maxmemory and refuses writes; raise maxmemory, or drain results and dead letters",
    "LOADING": "Redis is loading its dataset into memory after a restart; wait",
    "MASTERDOWN": "Redis's primary is down; wait for it or for a failover",
    "NOREPLICAS": "Redis has too few replicas to accept writes; wait for them",
    "BUSY": "Redis is running a slow script; wait",
    "UNBLOCKED": "Redis changed role (primary to replica, or back) under a blocked read; wait",
}


# The error code at the start of a reply, or where redis-py's pipelines quote it
# ("Command # 1 (ZADD ...) of pipeline caused error: ('MISCONF ...')").
_CODE = re.compile(r"(?:^|caused error: \(?'?)([A-Z]+) ")


def refused_write(exc: BaseException) -> str | None:
    """The code (MISCONF, READONLY, OOM, LOADING, ...) of a Redis refusal that passes by itself,
    or None. A refused command did not run: sending it again is safe."""
    if isinstance(exc, redis.BusyLoadingError):
        return "LOADING"
    # redis-py raises these two as their own classes, the code cut from the message.
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return "READONLY"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "OOM"
    if isinstance(exc, redis.ResponseError):
        found = _CODE.search(str(exc))
        return found.group(1) if found and found.group(1) in _REFUSALS else None
    return None


def transient_problem(exc: BaseException) -> str | None:
    """In words, what is wrong with Redis if ``exc`` is a failure that passes by waiting (a
    refusal, a lost connection, a timeout); None for any other error."""
    code = refused_write(exc)
    if code:
        text = str(exc)
        return f"{_REFUSALS[code]} ({text if code in text else f'{code} {text}'})"
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return f"Redis unreachable ({type(exc).__name__}: {exc})"
    return None


def raise_refusal(exc: BaseException, url: str) -> None:
    """Re-raise a refusal as ``RedisRefusesWrites`` that says what to do (other errors: nothing)."""
    if refused_write(exc):
        raise RedisRefusesWrites(f"Redis at {redacted(url)}: {transient_problem(exc)}") from exc


class Outage:
    """A worker's view of a Redis that fails for a while: the first failure of each kind is
    logged, the recovery once, nothing in between; ``delay_s`` backs off to ``max_delay_s``."""

    def __init__(self, who: str, *, first_delay_s: float = 0.2, max_delay_s: float = 2.0):
        self.who = who
        self.first_delay_s, self.max_delay_s = first_delay_s, max_delay_s
        self.problem: str | None = None
        self.since: float | None = None
        self.ended_at: float | None = None
        self.delay_s = first_delay_s

    def within(self, seconds: float) -> bool:
        """True during an outage and for ``seconds`` after it ended."""
        return self.since is not None or (self.ended_at is not None and time.monotonic() - self.ended_at < seconds)

    def failed(self, exc: BaseException) -> float:
        """Note a transient failure; returns how long to wait before trying again."""
        problem = transient_problem(exc) or f"{type(exc).__name__}: {exc}"
        kind = problem.split(" (", 1)[0]
        if self.since is None:
            self.since = time.monotonic()
            self.delay_s = self.first_delay_s
        else:
            self.delay_s = min(self.delay_s * 2, self.max_delay_s)
        if self.problem is None or self.problem.split(" (", 1)[0] != kind:
            log.warning("%s: %s; waiting it out", self.who, problem)
        self.problem = problem
        return self.delay_s

    def recovered(self) -> None:
        if self.since is not None:
            log.warning("%s: Redis answers again after %.1f s; carrying on", self.who, time.monotonic() - self.since)
            self.problem, self.since, self.delay_s = None, None, self.first_delay_s
            self.ended_at = time.monotonic()
