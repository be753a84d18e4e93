"""Connecting to Redis: URLs with passwords, ACL users, TLS (rediss://) and unix sockets,
async and sync clients, and an error that says what to do when nobody answers."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

try:
    import hiredis
except ImportError:  # redis[hiredis] brings it; without it commands are packed in Python
    hiredis = None

from rollstream.errors import RedisUnavailable

_HINT = "start one with 'rollstream redis', or set REDIS_URL (e.g. redis://:password@host:6379/0)"


def redacted(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
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

    class FastPacking(cls):  # type: ignore[misc, valid-type]
        def pack_command(self, *args):
            first = args[0]
            if isinstance(first, str) and " " in first:
                args = (*first.split(), *args[1:])
            elif isinstance(first, bytes) and b" " in first:
                args = (*first.split(), *args[1:])
            return [hiredis.pack_command(args)]

    FastPacking.__name__ = cls.__name__
    return FastPacking


def async_redis(url: str, *, max_connections: int = 512) -> aioredis.Redis:
    """An asyncio client for ``url``; commands pool their connections."""
    client = aioredis.Redis.from_url(url, max_connections=max_connections, health_check_interval=30,
                                     socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=10)
    if hiredis is not None and hasattr(hiredis, "pack_command"):
        pool = client.connection_pool
        pool.connection_class = _with_c_packer(pool.connection_class)
    return client


def sync_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, health_check_interval=30, socket_timeout=SOCKET_TIMEOUT_S,
                                socket_connect_timeout=10)


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
