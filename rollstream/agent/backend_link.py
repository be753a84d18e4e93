"""The door's link to the backends: the same vLLM-API client as every rollout turn
(``llm.client.VLLMClient``: request body, response parsing, error mapping), with its HTTP/1.1
exchange done on pooled keep-alive asyncio connections instead of httpx, which spends ~1 ms
of CPU per request (bench/README.md, proxy.py) — a tenth of that here. Plain http:// only;
any other URL goes through the parent's httpx path."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import httpx

from rollstream.llm.inference_client import DEFAULT_TIMEOUT_S, BackendError, VLLMClient, raise_for_error_status

_MAX_IDLE = 64  # idle connections kept per backend


class _Stale(Exception):
    """A pooled connection the server had closed: the request is sent again on a new one."""


class PooledVLLMClient(VLLMClient):
    def __init__(self, model: str | None = None, api_key: str | None = None) -> None:
        super().__init__(model=model, api_key=api_key)
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._auth = f"authorization: Bearer {api_key}\r\n".encode() if api_key else b""

    async def _request(self, method: str, url: str, base_url: str, timeout_s: float | None, **kw) -> dict:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            return await super()._request(method, url, base_url, timeout_s, **kw)
        total = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        body = json.dumps(kw["json"]).encode() if "json" in kw else b""
        target = (parts.hostname, parts.port or 80)
        head = (f"{method} {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\n"
                f"host: {parts.netloc}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n").encode()
        request = head + self._auth + b"\r\n" + body
        try:
            try:
                status, data = await asyncio.wait_for(self._exchange(target, request, reuse=True), total)
            except _Stale:
                status, data = await asyncio.wait_for(self._exchange(target, request, reuse=False), total)
        except asyncio.TimeoutError:
            raise BackendError(base_url, f"{self.kind} request timed out after {total:.1f}s") from None
        except (OSError, asyncio.IncompleteReadError, ValueError, _Stale) as exc:
            raise BackendError(base_url, f"{self.kind} unreachable: {type(exc).__name__}: {exc}") from exc
        if status >= 400:  # mapped as the parent maps them, from a response as httpx would give it
            raise_for_error_status(self.kind, base_url, httpx.Response(status, content=data))
        try:
            return json.loads(data)
        except ValueError as exc:
            raise BackendError(base_url, f"{self.kind} returned non-JSON body: {data[:200]!r}") from exc

    async def _exchange(self, target: tuple[str, int], request: bytes, reuse: bool) -> tuple[int, bytes]:
        idle = self._idle.setdefault(target, [])
        reused = reuse and bool(idle)
        reader, writer = idle.pop() if reused else await asyncio.open_connection(*target)
        try:
            try:
                writer.write(request)
                await writer.drain()
                status_line = await reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if reused:  # closed by the server while idle: nothing was answered
                    raise _Stale() from exc
                raise
            status = int(status_line.split(b" ", 2)[1])
            headers = {}
            for line in (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n"):
                name, _, value = line.partition(b":")
                if value:
                    headers[name.strip().lower()] = value.strip().lower()
            if b"content-length" in headers:
                data = await reader.readexactly(int(headers[b"content-length"]))
            elif headers.get(b"transfer-encoding") == b"chunked":
                chunks = []
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    chunks.append(await reader.readexactly(size))
                    await reader.readexactly(2)
                await reader.readuntil(b"\r\n")
                data = b"".join(chunks)
            else:
                data, headers[b"connection"] = await reader.read(), b"close"
        except BaseException:
            writer.close()
            raise
        if headers.get(b"connection") == b"close" or len(idle) >= _MAX_IDLE:
            writer.close()
        else:
            idle.append((reader, writer))
        return status, data

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for _reader, writer in idle:
                writer.close()
        self._idle.clear()
        await super().aclose()
