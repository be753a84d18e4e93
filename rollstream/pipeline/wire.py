"""A lean asyncio Redis connection for the pipeline's hot path (the stage wake-up read,
the hand-off script, the client's submit and result read): one socket, commands packed
and replies parsed by hiredis, replies matched to callers in order, so concurrent callers
pipeline on it for free. redis-py spends ~0.25 ms of Python per round trip here; this ~0.03
(replies are matched in the protocol callback, and one watchdog timer serves a connection).
Everything else (and TLS) stays on redis-py; errors are redis-py's exception types."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl as _ssl
from collections.abc import Awaitable, Callable, Sequence

import hiredis
import redis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import NoScriptError, ReadOnlyError

from rollstream.pipeline.connection import SOCKET_TIMEOUT_S


class _Replies(asyncio.Protocol):
    """The socket's receiving side: parses replies as bytes arrive and hands each to the
    caller that waits for it, in order, right in ``data_received`` (no reader task, no
    StreamReader: one event-loop callback per arriving batch of replies)."""

    def __init__(self, on_lost: Callable[[_Replies, Exception], None]) -> None:
        self.parser = hiredis.Reader(replyError=redis.ResponseError)
        # (caller's future, loop time by which its reply is due), oldest first.
        self.waiting: collections.deque[tuple[asyncio.Future, float]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.held: list[bytes] = []  # commands written while the connection is corked
        self._on_lost = on_lost

    def release(self) -> None:
        """Write what was held, in one system call."""
        if self.held:
            data = b"".join(self.held)
            self.held.clear()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(data)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
            while (reply := self.parser.gets()) is not False:
                fut, _due = self.waiting.popleft()
                if not fut.done():  # a caller that gave up (was cancelled) drops its reply
                    fut.set_result(reply)
        except Exception as exc:  # noqa: BLE001 - a garbled stream ends this connection
            self._on_lost(self, redis.ConnectionError(f"Redis connection lost: {exc}"))

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(self, redis.ConnectionError(f"Redis closed the connection{f' ({exc})' if exc else ''}"))

    def fail_all(self, error: Exception) -> None:
        waiting, self.waiting = self.waiting, collections.deque()
        for fut, _due in waiting:
            if not fut.done():
                fut.set_exception(error)


class FastRedis:
    """One connection to the Redis that ``client`` (redis-py) talks to; it connects on
    first use and again after a failure (all commands in flight on a lost connection fail
    with ``redis.ConnectionError``). Blocking commands hold it: give blocking reads their own.
    ``primary``: asked for (host, port) at each connect (Redis behind Sentinel); a connection
    whose server answers READONLY (a primary demoted by a failover) is then dropped."""

    def __init__(self, *, path: str | None = None, host: str = "localhost", port: int = 6379,
                 username: str | None = None, password: str | None = None, db: int = 0,
                 timeout_s: float = SOCKET_TIMEOUT_S,
                 primary: Callable[[], Awaitable[tuple[str, int]]] | None = None):
        self.path, self.host, self.port = path, host, port
        self.primary = primary
        self.username, self.password, self.db = username, password, db
        self.timeout_s = timeout_s
        self._proto: _Replies | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._connecting: asyncio.Lock | None = None
        self._scripts: dict[str, bytes] = {}
        self._corked = False

    @classmethod
    def from_client(cls, client: aioredis.Redis) -> FastRedis | None:
        """A fast connection with ``client``'s address and credentials, or None where it
        cannot be had (TLS, or no hiredis packer): callers then keep using redis-py."""
        pool = client.connection_pool
        if not hasattr(hiredis, "pack_command") or issubclass(pool.connection_class, aioredis.SSLConnection):
            return None
        kw = pool.connection_kwargs
        primary = pool.get_master_address if isinstance(pool, SentinelConnectionPool) else None
        return cls(path=kw.get("path"), host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)),
                   username=kw.get("username"), password=kw.get("password"), db=int(kw.get("db") or 0),
                   primary=primary)

    # -- connection ------------------------------------------------------------------
    async def _connect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._proto is not None:
                return
            loop = asyncio.get_running_loop()
            proto = _Replies(self._lost)
            if self.primary is not None:  # raises MasterNotFoundError (a ConnectionError) mid-failover
                self.host, self.port = await self.primary()
            try:
                if self.path:
                    coro = loop.create_unix_connection(lambda: proto, self.path)
                else:
                    coro = loop.create_connection(lambda: proto, self.host, self.port)
                await asyncio.wait_for(coro, 10)
            except (TimeoutError, OSError, _ssl.SSLError) as exc:
                raise redis.ConnectionError(f"cannot connect to Redis at {self.path or f'{self.host}:{self.port}'}: "
                                            f"{exc}") from exc
            self._proto = proto
            setup: list[tuple[object, ...]] = []
            if self.password:
                setup.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
            if self.db:
                setup.append(("SELECT", self.db))
            due = loop.time() + self.timeout_s
            for fut in (self._send_all(setup, due) if setup else []):
                reply = await fut
                if isinstance(reply, Exception):
                    self._drop(redis.AuthenticationError(str(reply)))
                    raise redis.AuthenticationError(f"Redis refused {reply}; check the URL's credentials")

    def leave_unless(self, address: tuple[str, int]) -> None:
        """Drop the connection unless it goes to ``address`` (where the Sentinels say the primary
        is now): the next command connects there."""
        if self._proto is not None and self.primary is not None and (self.host, self.port) != tuple(address):
            self._drop(redis.ConnectionError(f"the Sentinels name another primary ({address[0]}:{address[1]})"))

    def _lost(self, proto: _Replies, error: Exception) -> None:
        if proto is self._proto:
            self._drop(error)
        else:  # an old connection's last word: fail what still waited on it
            proto.fail_all(error)

    def _drop(self, error: Exception) -> None:
        """Forget the connection; everything in flight on it fails with ``error``."""
        proto, self._proto = self._proto, None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if proto is None:
            return
        if proto.transport is not None:
            proto.transport.close()
        proto.fail_all(error)

    def _send_all(self, commands: list, due: float) -> list[asyncio.Future]:
        """Queue a reply future per command and write them all with one system call: each
        write wakes Redis, and a wake-up costs more than the commands themselves."""
        proto = self._proto
        # Callers connect first; _connect sets _proto once its transport is made, _drop unsets it.
        assert proto is not None and proto.transport is not None
        loop = asyncio.get_running_loop()
        futs = []
        for _ in commands:
            fut = loop.create_future()
            proto.waiting.append((fut, due))
            futs.append(fut)
        pack = hiredis.pack_command
        data = pack(commands[0]) if len(commands) == 1 else b"".join(pack(c) for c in commands)
        if self._corked:
            if not proto.held:  # at the latest with the next turn of the loop
                loop.call_soon(self.uncork)
            proto.held.append(data)
        else:
            proto.transport.write(data)
        return futs

    def cork(self) -> None:
        """Hold this connection's writes until ``uncork`` (or the loop's next turn, whichever
        comes first), so that commands sent one after another from different tasks (a job's
        hand-off, then the worker's next read) reach Redis in one write: one wake-up of Redis
        instead of one per command. Never await a reply while holding the cork yourself."""
        self._corked = True

    def uncork(self) -> None:
        self._corked = False
        if self._proto is not None:
            self._proto.release()

    async def close(self) -> None:
        self._drop(redis.ConnectionError("connection closed"))

    # -- commands ----------------------------------------------------------------------
    async def execute(self, *args, timeout_s: float | None = None, uncork: bool = False):
        """One command; its reply as hiredis gives it (bytes, ints, lists)."""
        return (await self.execute_many([args], timeout_s=timeout_s, uncork=uncork))[0]

    async def execute_many(self, commands: list[tuple], *, timeout_s: float | None = None,
                           uncork: bool = False) -> list:
        """Several commands written at once (one round trip); raises the first error.
        ``uncork``: then write them with what the cork held (see ``cork``)."""
        if self._proto is None:
            await self._connect()
        loop = asyncio.get_running_loop()
        due = loop.time() + (timeout_s or self.timeout_s)
        futs = self._send_all(commands, due)
        if uncork:
            self.uncork()
        if self._watchdog is None:
            self._watchdog = loop.call_at(due, self._watch)
        try:
            await futs[-1]  # replies come in order: once the last is in, all are
        except BaseException:
            for fut in futs:  # a lost connection fails them all, but only one was awaited
                fut.add_done_callback(_retrieve)
            raise
        replies = [fut.result() for fut in futs]
        for reply in replies:
            if isinstance(reply, Exception):
                error = _typed(reply)
                if self.primary is not None and isinstance(error, ReadOnlyError):
                    self._drop(redis.ConnectionError("the primary became a replica"))  # ask Sentinel again
                raise error
        return replies

    def _watch(self) -> None:
        """One timer per connection, not one per command (a timer costs more than a fast
        round trip): when it fires, a command past its due time means Redis stopped
        answering, and the connection is dropped; otherwise it waits for the earliest due."""
        self._watchdog = None
        proto = self._proto
        if proto is None or not proto.waiting:
            return
        loop = asyncio.get_running_loop()
        earliest = min(due for _fut, due in proto.waiting)
        if earliest <= loop.time():
            self._drop(redis.TimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))
        else:
            self._watchdog = loop.call_at(earliest, self._watch)

    def _sha(self, script: str) -> bytes:
        sha = self._scripts.get(script)
        if sha is None:
            sha = self._scripts[script] = hashlib.sha1(script.encode()).hexdigest().encode()
        return sha

    async def evalsha(self, script: str, keys: list, args: list, *, before: Sequence[tuple] = (), load: bool = True):
        """Run a Lua script by its SHA1, loading it the first time (and after a restart).
        ``before``: commands to send ahead of it in the same write (their replies are only
        checked for errors). ``load=False``: raise ``NoScriptError`` instead of loading it
        (on a connection that a blocking read may hold by then)."""
        call = ("EVALSHA", self._sha(script), len(keys), *keys, *args)
        try:
            return (await self.execute_many([*before, call]))[-1]
        except redis.ResponseError as exc:
            if not isinstance(exc, NoScriptError) or not load:
                raise
            await self.execute("SCRIPT", "LOAD", script)  # what came before it ran already
            return await self.execute(*call)


    async def evalsha_many(self, script: str, calls: list[tuple[str, list]]) -> list:
        """The same one-key script for each (key, args), in one round trip."""
        sha = self._sha(script)
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


# XREADGROUP's reply as redis-py parses it: (stream, [(entry id, {field: value}), ...]) per stream.
StreamReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


def stream_entries(reply) -> list[tuple[bytes, dict]]:
    """XREADGROUP/XREAD's raw reply as (id, {field: value}) per entry, across streams."""
    out = []
    for _stream, items in reply or []:
        for msg_id, flat in items:
            out.append((msg_id, dict(zip(flat[0::2], flat[1::2])) if flat else {}))
    return out
