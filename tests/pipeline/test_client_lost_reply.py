"""The client's results read when a reply is lost with its connection: Redis has already
moved the entries into this consumer's pending list, so the next read must take them from
there. A proxy between client and redis-server drops the connection instead of passing on
the reply that carries the results (what a Redis restart or a network cut can do)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from rollstream.client import AsyncClient
from rollstream.messages import Result, new_id
from rollstream.pipeline.codec import pack
from rollstream.pipeline.keys import RESULTS_GROUP


class ReplyDroppingProxy:
    """Forwards a unix-socket Redis connection; when armed, the next reply that carries a
    result payload is swallowed and both sides of that connection are closed."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.path = str(Path(tempfile.mkdtemp(prefix="rs-px-", dir="/tmp")) / "proxy.sock")
        self.armed = False
        self.dropped = 0
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> ReplyDroppingProxy:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_unix_connection(self.upstream)

        async def pump(reader, writer, replies: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if replies and self.armed and b"completed" in data:
                        self.armed = False
                        self.dropped += 1
                        break
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            for w in (client_w, server_w):
                w.close()

        await asyncio.gather(pump(client_r, server_w, False), pump(server_r, client_w, True))


async def _deliver(r: aioredis.Redis, client: AsyncClient, n: int) -> list[str]:
    ids = []
    for _ in range(n):  # job ids differ: a client drops a second result of a job it has seen
        result = Result(job_id=new_id(), submitter=client.submitter, task="echo", status="completed", reward=1.0)
        await r.xadd(client.keys.results(client.submitter), {"data": pack(result)})
        ids.append(result.job_id)
    return ids


async def test_results_in_a_lost_reply_are_read_again_exactly_once(settings):
    upstream = settings.redis_url.removeprefix("unix://")
    async with ReplyDroppingProxy(upstream) as proxy:
        direct = aioredis.from_url(settings.redis_url)
        client = AsyncClient(f"unix://{proxy.path}", settings=settings, submitter="lossy")
        try:
            got: list[str] = []
            await client._ensure_results_group()
            first = await _deliver(direct, client, 2)
            got += [r.job_id async for r in client.results(timeout_s=2, max_results=2)]
            assert got == first

            second = await _deliver(direct, client, 3)
            proxy.armed = True
            with pytest.raises(redis.ConnectionError) as failure:
                async for result in client.results(timeout_s=2):
                    got.append(result.job_id)
            assert proxy.dropped == 1, f"the proxy never saw the reply to drop ({failure.value!r})"
            # Redis delivered them into the lost reply: they are pending with this consumer
            pending = await direct.xpending(client.keys.results(client.submitter), RESULTS_GROUP)
            assert pending["pending"] == 3

            async for result in client.results(timeout_s=1):
                got.append(result.job_id)
            assert got == first + second  # each exactly once, in order
            client_keys = client.keys
            await client.close()
            client = None
            stream = client_keys.results("lossy")
            pending = await direct.xpending(stream, RESULTS_GROUP)
            assert pending["pending"] == 0 and await direct.xlen(stream) == 0
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            await direct.aclose()
