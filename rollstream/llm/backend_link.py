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

from rollstream.llm.inference_client import (
    DEFAULT_TIMEOUT_S,
    BackendError,
    Generation,
    SamplingParams,
    StreamAssembly,
    TokensCallback,
    VLLMClient,
    feed_stream,
    raise_for_error_status,
)

_MAX_IDLE = 64  # idle connections kept per backend


class _Stale(Exception):
    """A pooled connection the server had closed: the request is sent again on a new one."""


class PooledVLLMClient(VLLMClient):
    def __init__(self, model: str | None = None, api_key: str | None = None) -> None:
        super().__init__(model=model, api_key=api_key)
        self._idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._auth = f"authorization: Bearer {api_key}\r\n".encode() if api_key else b""

    def _message(self, method: str, url: str, body: bytes) -> tuple[tuple[str, int], bytes] | None:
        """The target and bytes of a request to ``url``, or None where it is not plain http."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            return None
        head = (f"{method} {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\n"
                f"host: {parts.netloc}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n").encode()
        return (parts.hostname, parts.port or 80), head + self._auth + b"\r\n" + body

    async def _request(self, method: str, url: str, base_url: str, timeout_s: float | None, **kw) -> dict:
        body = json.dumps(kw["json"]).encode() if "json" in kw else b""
        message = self._message(method, url, body)
        if message is None:
            return await super()._request(method, url, base_url, timeout_s, **kw)
        target, request = message
        total = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(total):  # not wait_for: no task of its own per request
                try:
                    status, data = await self._exchange(target, request, reuse=True)
                except _Stale:
                    status, data = await self._exchange(target, request, reuse=False)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, _Stale) as exc:
            raise self._transport_error(base_url, total, exc) from exc
        if status >= 400:  # mapped as the parent maps them, from a response as httpx would give it
            raise_for_error_status(self.kind, base_url, httpx.Response(status, content=data))
        try:
            return json.loads(data)
        except ValueError as exc:
            raise BackendError(base_url, f"{self.kind} returned non-JSON body: {data[:200]!r}") from exc

    async def generate_stream(self, base_url: str, prompt_ids: list[int], params: SamplingParams,
                              on_tokens: TokensCallback, timeout_s: float | None = None) -> Generation:
        """The parent's streamed generation, read off a pooled connection as it arrives."""
        base_url = base_url.rstrip("/")
        model = await self._model_name(base_url, timeout_s)
        body = json.dumps(self.request_body(model, prompt_ids, params, stream=True)).encode()
        message = self._message("POST", f"{base_url}/v1/completions", body)
        if message is None:
            return await super().generate_stream(base_url, prompt_ids, params, on_tokens, timeout_s)
        target, request = message
        total = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        assembly = StreamAssembly(base_url)
        try:
            async with asyncio.timeout(total):
                try:
                    reader, writer, status, headers = await self._open(target, request, reuse=True)
                except _Stale:
                    reader, writer, status, headers = await self._open(target, request, reuse=False)
                try:
                    if status >= 400:
                        data = await self._body(reader, headers)
                        raise_for_error_status(self.kind, base_url, httpx.Response(status, content=data))
                    chunks = self._chunks(reader, headers)
                    await feed_stream(assembly, chunks, on_tokens)
                    async for _rest in chunks:  # the body's end after [DONE], so the connection can be reused
                        pass
                except BaseException:
                    writer.close()
                    raise
                self._keep(target, reader, writer, headers)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, _Stale) as exc:
            raise self._transport_error(base_url, total, exc) from exc
        return assembly.generation()

    async def _open(self, target: tuple[str, int], request: bytes, reuse: bool):
        """Send ``request`` on a pooled (or new) connection; its reader, writer, status and headers."""
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
        except BaseException:
            writer.close()
            raise
        return reader, writer, status, headers

    @staticmethod
    async def _chunks(reader: asyncio.StreamReader, headers: dict):
        """The body's bytes as they arrive: chunk by chunk, or as read until the server closes."""
        if headers.get(b"transfer-encoding") == b"chunked":
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                yield await reader.readexactly(size)
                await reader.readexactly(2)
            await reader.readuntil(b"\r\n")
            headers[b"x-read"] = b"1"
        elif b"content-length" in headers:
            yield await reader.readexactly(int(headers[b"content-length"]))
            headers[b"x-read"] = b"1"
        else:
            headers[b"connection"] = b"close"
            while data := await reader.read(65536):
                yield data

    async def _body(self, reader: asyncio.StreamReader, headers: dict) -> bytes:
        return b"".join([piece async for piece in self._chunks(reader, headers)])

    def _keep(self, target: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
              headers: dict) -> None:
        idle = self._idle.setdefault(target, [])
        if headers.get(b"connection") == b"close" or headers.get(b"x-read") is None or len(idle) >= _MAX_IDLE:
            writer.close()
        else:
            idle.append((reader, writer))

    async def _exchange(self, target: tuple[str, int], request: bytes, reuse: bool) -> tuple[int, bytes]:
        reader, writer, status, headers = await self._open(target, request, reuse)
        try:
            data = await self._body(reader, headers)
        except BaseException:
            writer.close()
            raise
        self._keep(target, reader, writer, headers)
        return status, data

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for _reader, writer in idle:
                writer.close()
        self._idle.clear()
        await super().aclose()
