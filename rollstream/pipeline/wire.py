"""A lean asyncio Redis connection for the pipeline's hot path (the stage wake-up read,
the hand-off script, the client's submit and result read): one socket, commands packed
and replies parsed by hiredis, replies matched to callers in order, so concurrent callers
pipeline on it for free. redis-py spends ~0.25 ms of Python per round trip here; this ~0.05.
Everything else (and TLS) stays on redis-py; errors are redis-py's exception types."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl as _ssl

import hiredis
import redis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.exceptions import NoScriptError

from rollstream.pipeline.connection import SOCKET_TIMEOUT_S


class FastRedis:
    """One connection to the Redis that ``client`` (redis-py) talks to; it connects on
    first use and again after a failure (all commands in flight on a lost connection fail
    with ``redis.ConnectionError``). Blocking commands hold it: give blocking reads their own."""

    def __init__(self, *, path: str | None = None, host: str = "localhost", port: int = 6379,
                 username: str | None = None, password: str | None = None, db: int = 0,
                 timeout_s: float = SOCKET_TIMEOUT_S):
        self.path, self.host, self.port = path, host, port
        self.username, self.password, self.db = username, password, db
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._read_task: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None
        self._scripts: dict[str, bytes] = {}

    @classmethod
    def from_client(cls, client: aioredis.Redis) -> "FastRedis | None":
        """A fast connection with ``client``'s address and credentials, or None where it
        cannot be had (TLS, or no hiredis packer): callers then keep using redis-py."""
        pool = client.connection_pool
        if not hasattr(hiredis, "pack_command") or issubclass(pool.connection_class, aioredis.SSLConnection):
            return None
        kw = pool.connection_kwargs
        return cls(path=kw.get("path"), host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)),
                   username=kw.get("username"), password=kw.get("password"), db=int(kw.get("db") or 0))

    # -- connection ------------------------------------------------------------------
    async def _connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is not None:
                return
            try:
                if self.path:
                    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), 10)
                else:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 10)
            except (OSError, asyncio.TimeoutError, _ssl.SSLError) as exc:
                raise redis.ConnectionError(f"cannot connect to Redis at {self.path or f'{self.host}:{self.port}'}: "
                                            f"{exc}") from exc
            self._reader, self._writer = reader, writer
            self._read_task = asyncio.get_running_loop().create_task(self._read_replies(reader, self._waiting))
            setup = []
            if self.password:
                setup.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
            if self.db:
                setup.append(("SELECT", self.db))
            for fut in [self._send(cmd) for cmd in setup]:
                reply = await fut
                if isinstance(reply, Exception):
                    self._drop(redis.AuthenticationError(str(reply)))
                    raise redis.AuthenticationError(f"Redis refused {reply}; check the URL's credentials")

    async def _read_replies(self, reader: asyncio.StreamReader, waiting: collections.deque) -> None:
        parser = hiredis.Reader(replyError=redis.ResponseError)
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    raise redis.ConnectionError("Redis closed the connection")
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    fut = waiting.popleft()
                    if not fut.done():  # a caller that gave up (was cancelled) drops its reply
                        fut.set_result(reply)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - every failure ends this connection
            error = exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(f"Redis connection lost: {exc}")
            self._drop(error)

    def _drop(self, error: Exception) -> None:
        """Forget the connection; everything in flight on it fails with ``error``."""
        writer, self._writer, self._reader = self._writer, None, None
        waiting, self._waiting = self._waiting, collections.deque()
        if self._read_task is not None and self._read_task is not asyncio.current_task():
            self._read_task.cancel()
        self._read_task = None
        if writer is not None:
            writer.close()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)

    def _send(self, args) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._writer.write(hiredis.pack_command(args))
        return fut

    async def close(self) -> None:
        self._drop(redis.ConnectionError("connection closed"))

    # -- commands ----------------------------------------------------------------------
    async def execute(self, *args, timeout_s: float | None = None):
        """One command; its reply as hiredis gives it (bytes, ints, lists)."""
        return (await self.execute_many([args], timeout_s=timeout_s))[0]

    async def execute_many(self, commands: list[tuple], *, timeout_s: float | None = None) -> list:
        """Several commands written at once (one round trip); raises the first error."""
        if self._writer is None:
            await self._connect()
        futs = [self._send(cmd) for cmd in commands]
        writer = self._writer
        timer = asyncio.get_running_loop().call_later(
            timeout_s or self.timeout_s, self._time_out, writer, futs[-1])
        try:
            replies = [await fut for fut in futs]
        except BaseException:
            for fut in futs:  # a lost connection fails them all, but only one was awaited
                fut.add_done_callback(_retrieve)
            raise
        finally:
            timer.cancel()
        for reply in replies:
            if isinstance(reply, Exception):
                raise _typed(reply)
        return replies

    def _time_out(self, writer, fut: asyncio.Future) -> None:
        if not fut.done() and writer is self._writer:
            self._drop(redis.TimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))

    async def evalsha(self, script: str, keys: list, args: list):
        """Run a Lua script by its SHA1, loading it the first time (and after a restart)."""
        sha = self._scripts.get(script)
        if sha is None:
            sha = self._scripts[script] = hashlib.sha1(script.encode()).hexdigest().encode()
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            if not isinstance(exc, NoScriptError):
                raise
            await self.execute("SCRIPT", "LOAD", script)
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)


    async def evalsha_many(self, script: str, calls: list[tuple[str, list]]) -> list:
        """The same one-key script for each (key, args), in one round trip."""
        sha = self._scripts.get(script)
        if sha is None:
            sha = self._scripts[script] = hashlib.sha1(script.encode()).hexdigest().encode()
        commands = [("EVALSHA", sha, 1, key, *args) for key, args in calls]
        try:
            return await self.execute_many(commands)
        except redis.ResponseError as exc:
            if not isinstance(exc, NoScriptError):
                raise
            await self.execute("SCRIPT", "LOAD", script)
            return await self.execute_many(commands)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _typed(error: Exception) -> Exception:
    """redis-py's exception class for an error reply (LOADING → BusyLoadingError, a kind of
    ConnectionError, so callers retry a Redis that is restarting; NOSCRIPT → NoScriptError)."""
    if type(error) is redis.ResponseError:
        return BaseParser.parse_error(str(error))
    return error


def stream_entries(reply) -> list[tuple[bytes, dict]]:
    """XREADGROUP/XREAD's raw reply as (id, {field: value}) per entry, across streams."""
    out = []
    for _stream, items in reply or []:
        for msg_id, flat in items:
            out.append((msg_id, dict(zip(flat[0::2], flat[1::2])) if flat else {}))
    return out
