"""How a streamed /v1/completions answer reaches the door: the tokens of the events that arrived in
one read are passed on in one callback (one delta to the harness, not one per token), those of
later reads as they arrive, and tokens that came before a failed event are passed on before the
failure is raised."""

from __future__ import annotations

import json

import pytest

from rollstream.llm.inference_client import BackendError, StreamAssembly, feed_stream


def _event(ids: list[int], finish: str | None = None) -> bytes:
    chunk = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids, "finish_reason": finish,
                          "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _reads(*reads: bytes):
    for data in reads:
        yield data


async def _passed_on(*reads: bytes) -> tuple[list[list[int]], StreamAssembly]:
    got: list[list[int]] = []

    async def on_tokens(ids: list[int], logprobs: list[float]) -> None:
        assert len(ids) == len(logprobs)
        got.append(ids)

    assembly = StreamAssembly("http://backend")
    await feed_stream(assembly, _reads(*reads), on_tokens)
    return got, assembly


async def test_events_that_arrive_together_are_passed_on_together_and_later_ones_as_they_come():
    burst = _event([1]) + _event([2, 3]) + _event([4])
    # A read may end inside an event: its tokens wait for the rest of it.
    last = _event([6], "stop") + b"data: [DONE]\n\n"
    got, assembly = await _passed_on(burst + _event([5])[:9], _event([5])[9:], last)
    assert got == [[1, 2, 3, 4], [5], [6]]
    assert assembly.generation().token_ids == [1, 2, 3, 4, 5, 6]


async def test_tokens_before_a_failed_event_in_the_same_read_are_passed_on_before_the_failure():
    failed = b'data: {"error": {"message": "engine died"}}\n\n'
    got: list[list[int]] = []

    async def on_tokens(ids: list[int], logprobs: list[float]) -> None:
        got.append(ids)

    with pytest.raises(BackendError, match="engine died"):
        await feed_stream(StreamAssembly("http://backend"), _reads(_event([7, 8]) + failed), on_tokens)
    assert got == [[7, 8]]  # passed on before the failure, as the door had sent them
