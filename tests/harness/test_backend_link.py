"""The door's pooled HTTP link to backends: keep-alive connections reused, one the server
closed while idle is replaced without the call failing, chunked bodies read, and HTTP errors
mapped as the httpx client maps them. Against a real (small) HTTP server on a socket."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollstream.llm.backend_link import PooledVLLMClient
from rollstream.llm.inference_client import BackendError, ContextLengthError, SamplingParams

COMPLETION = {"choices": [{"text": "hi", "token_ids": [5, 6], "finish_reason": "stop",
                           "logprobs": {"token_logprobs": [-0.1, -0.2]}}], "usage": {"prompt_tokens": 3}}


@pytest.fixture
async def backend():
    """Answers /v1/completions by the prompt's first id: 1 = a completion (then closes the
    connection without saying so), 2 = chunked, 3 = a context error, 4 = HTTP 503."""
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        first = json.loads(await reader.readexactly(length))["prompt"][0]
        body = json.dumps(COMPLETION).encode()
        if first == 2:
            half = len(body) // 2
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))
        else:
            status, body = {1: (200, body), 3: (400, b'{"error": {"message": "maximum context length is 8"}}'),
                            4: (503, b'{"error": "overloaded"}')}[first]
            writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()
        writer.close()  # as a server whose keep-alive ran out: the client's pooled connection is stale

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections
    server.close()


async def test_calls_survive_stale_connections_and_errors_map_as_for_httpx(backend):
    url, connections = backend
    client = PooledVLLMClient(model="m")
    params = SamplingParams(max_tokens=2)
    try:
        for first in (1, 1, 2, 1):  # each after the server closed the previous connection
            gen = await client.generate(url, [first, 9, 9], params)
            assert gen.token_ids == [5, 6] and gen.logprobs == [-0.1, -0.2]
        with pytest.raises(ContextLengthError):
            await client.generate(url, [3], params)
        with pytest.raises(BackendError) as failed:
            await client.generate(url, [4], params)
        assert failed.value.retryable and failed.value.status_code == 503
    finally:
        await client.aclose()
    assert len(connections) == 6
