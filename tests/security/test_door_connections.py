"""Issue 32, finding 9: a local process without a job's key holds the door's worker. The door
read up to 32 MiB of body before it looked at the key, waited forever on a slow body, and kept
every connection it was given. Now the key is checked from the request's head before any body
is read, a head and a body each have a read timeout, connections are capped (the longest idle
makes room for a new one) and so are a door's concurrent requests. Each test is the attack,
made with raw sockets from outside, as a process on the host would make it."""

from __future__ import annotations

import asyncio
import socket

import pytest
from openai import AsyncOpenAI

from rollstream.agent.gateway import Gateway
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import VLLMClient
from rollstream.llm.session import LLMSession

# Bounds on how long the attacker waits for an answer: an answer never comes on a door
# that has the hole, so the test fails at this bound instead of hanging.
ANSWER_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)


def _open_door(gateway: Gateway, tokenizer, backend_url: str = "http://127.0.0.1:9"):
    session = LLMSession(VLLMClient(), "job-door", backend_url=backend_url, max_backend_attempts=1)
    return gateway.open("job-door", session, tokenizer, AgentSettings())


async def _connect(gateway: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(gateway.host, gateway.port)


async def _answer(reader: asyncio.StreamReader) -> bytes:
    """Everything the door sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)


def _head(length: int, key: str | None = None) -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: door\r\ncontent-type: application/json\r\n{auth}"
            f"content-length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("key", [None, "rs-not-a-jobs-key"])
async def test_a_head_without_the_key_announcing_a_huge_body_is_refused_401_before_any_body_is_sent(
        tokenizer, key):
    gateway = await Gateway().start()
    _open_door(gateway, tokenizer)
    try:
        reader, writer = await _connect(gateway)
        writer.write(_head(32 * 1024 * 1024, key))  # the largest body the door admits; none of it is sent
        await writer.drain()
        answer = await _answer(reader)
        writer.close()
    finally:
        await gateway.aclose()
    assert answer.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in answer
    assert b"connection: close" in answer.lower()


@pytest.mark.parametrize("header", ["", "x-api-key: rs-not-a-jobs-key\r\n", "x-api-key: \r\n"])
async def test_the_anthropic_endpoint_refuses_a_missing_or_wrong_x_api_key_401_before_any_body_is_sent(
        tokenizer, header):
    gateway = await Gateway().start()
    _open_door(gateway, tokenizer)
    try:
        reader, writer = await _connect(gateway)
        writer.write((f"POST /v1/messages HTTP/1.1\r\nhost: door\r\n{header}content-length: {32 * 1024 * 1024}"
                      "\r\n\r\n").encode())
        await writer.drain()
        answer = await _answer(reader)
        writer.close()
    finally:
        await gateway.aclose()
    assert answer.startswith(b"HTTP/1.1 401 ") and b'"authentication_error"' in answer  # in Anthropic's form


async def test_a_body_sent_too_slowly_is_cut_and_its_connection_closed(tokenizer):
    gateway = await Gateway(read_timeout_s=0.5).start()
    door = _open_door(gateway, tokenizer)
    try:
        reader, writer = await _connect(gateway)
        writer.write(_head(1000, door.key) + b'{"messages": [')  # then nothing more
        await writer.drain()
        answer = await _answer(reader)
        writer.close()
        # A head that never ends (slowloris on the head itself) is cut the same way.
        reader, writer = await _connect(gateway)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: door\r\n")
        await writer.drain()
        head_answer = await _answer(reader)
        writer.close()
    finally:
        await gateway.aclose()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
    assert head_answer == b""  # closed without a word: it never said what it wanted
    assert not door.recorder.calls


async def test_many_idle_connections_do_not_keep_a_job_from_its_door(tokenizer):
    gateway = await Gateway(max_connections=8).start()
    door = _open_door(gateway, tokenizer)
    idle = [await _connect(gateway) for _ in range(64)]
    await asyncio.sleep(0)  # let the door see them all (each is accepted, then idle)
    client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0)
    try:
        models = await asyncio.wait_for(client.models.list(), ANSWER_WITHIN_S)
        open_now = len(gateway.connections)
        closed = 0
        for reader, writer in idle:
            try:
                if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                    closed += 1
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass  # still open: one of the newest, within the cap
            writer.close()
    finally:
        await client.close()
        await gateway.aclose()
    assert [m.id for m in models.data] == ["rollstream"]
    assert open_now <= 8
    assert closed >= 64 - 8 + 1  # the job's own connection took the place of one more


async def test_one_door_serves_a_bounded_number_of_requests_at_once(tokenizer):
    # A backend that accepts connections and never answers: each call to it waits.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    gateway = await Gateway(max_requests_per_door=2).start()
    door = _open_door(gateway, tokenizer, backend_url=f"http://127.0.0.1:{silent.getsockname()[1]}")
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    held = []
    try:
        for _ in range(2):
            reader, writer = await _connect(gateway)
            writer.write(_head(len(body), door.key) + body)
            await writer.drain()
            held.append((reader, writer))
        while door.in_flight < 2:
            await asyncio.sleep(0.01)
        reader, writer = await _connect(gateway)
        writer.write(_head(len(body), door.key) + body)
        await writer.drain()
        answer = await _answer(reader)
        writer.close()
    finally:
        for _reader, held_writer in held:
            held_writer.close()
        await gateway.aclose()
        silent.close()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_requests" in answer
