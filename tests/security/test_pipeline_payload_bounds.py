"""Hole 6 at the Python client and the init stream: nesting deeper than MAX_NESTING, integers
outside 64 bits and NaN/infinite numbers are refused at submit with an error that says where;
a message added by hand that breaks them is dead-lettered (its submitter gets a failed result)
and no worker dies. And result delivery: an entry of a results stream that cannot be read is
dead-lettered and the results behind it still arrive."""

from __future__ import annotations

import json

import msgpack
import pytest

from rollstream.client import AsyncClient, Client
from rollstream.errors import InvalidJob
from rollstream.messages import MAX_NESTING, DeadLetter, Result
from rollstream.pipeline.codec import pack, unpack
from rollstream.pipeline.keys import Keys

from .pipeline_workers import alive, stage_tasks


def nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


# (field, value, what the error must say)
OVER_BOUNDS = [
    ("metadata", nested(MAX_NESTING + 1), "metadata.a.a"),
    ("metadata", nested(300), "nests deeper"),
    ("metadata", {"n": 2**64}, "metadata.n: 18446744073709551616 is outside the 64-bit"),
    ("metadata", {"n": 2**63}, "outside the 64-bit"),
    ("metadata", {"n": -(2**63) - 1}, "outside the 64-bit"),
    ("metadata", {"n": 10**400}, "outside the 64-bit"),
    ("metadata", {"x": [1.0, float("nan")]}, "metadata.x[1]: nan is not a finite number"),
    ("instance", {"prompt": "p", "eval_s": float("inf")}, "instance.eval_s: inf"),
    ("agent", {"chat_template_kwargs": {"k": [[[[float("-inf")]]]]}}, "agent.chat_template_kwargs.k[0][0][0][0]"),
]


async def test_the_async_client_refuses_payloads_over_the_bounds_saying_where(settings):
    async with AsyncClient(settings=settings, submitter="alice") as client:
        for field, value, says in OVER_BOUNDS:
            job = {"task": "echo", "instance": {"prompt": "p"}, field: value}
            with pytest.raises(InvalidJob, match=None) as refused:
                await client.submit(job)
            assert says in str(refused.value), (field, str(refused.value))
        for bad in (float("nan"), float("inf")):
            with pytest.raises(InvalidJob, match="timeout_s"):
                await client.submit({"task": "echo", "instance": {"prompt": "p"}, "timeout_s": bad})
        # At the bound exactly, it travels.
        await client.submit({"task": "echo", "instance": {"prompt": "p"}, "metadata": nested(MAX_NESTING - 1),
                             "agent": {"chat_template_kwargs": {"n": 2**63 - 1, "m": -(2**63), "f": 1e308}}})
        assert await client.r.xlen(Keys(settings.namespace).init_stream) == 1


def test_the_sync_client_refuses_payloads_over_the_bounds(settings):
    with Client(settings=settings, submitter="bob") as client:
        for field, value, says in OVER_BOUNDS:
            with pytest.raises(InvalidJob) as refused:
                client.submit({"task": "echo", "instance": {"prompt": "p"}, field: value})
            assert says in str(refused.value)


async def test_raw_messages_over_the_bounds_are_dead_lettered_and_workers_live_on(settings):
    keys = Keys(settings.namespace)
    texts = {
        "deep": json.dumps({"metadata": nested(300)}),
        "deeper-than-json": '{"metadata": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "huge-int": f'{{"metadata": {{"n": {2**70}}}}}',
        "nan": '{"metadata": {"x": NaN}}',
        "inf-timeout": '{"timeout_s": Infinity}',
    }
    async with AsyncClient(settings=settings, submitter="alice") as client:
        await client._ensure_results_group()
        for name, extra in texts.items():
            head = json.dumps({"task": "echo", "instance": {"prompt": "x"}, "job_id": name, "submitter": "alice"})
            await client.r.xadd(keys.init_stream, {"json": head[:-1] + ", " + extra[1:]})
        # Over the bounds in msgpack too (a message packed by hand, not by the client).
        await client.r.xadd(keys.init_stream, {"data": msgpack.packb(
            {"task": "echo", "instance": {"prompt": "x"}, "job_id": "deep-msgpack", "submitter": "alice",
             "metadata": nested(200)})})
        # An envelope (not a bare job) whose own fields no codec can carry on to the next stage.
        for name, field in (("huge-attempt", "attempt"), ("huge-state", "state")):
            job = json.dumps({"task": "echo", "instance": {"prompt": "x"}, "job_id": name, "submitter": "alice"})
            value = 2**70 if field == "attempt" else f'{{"n": {2**70}}}'
            await client.r.xadd(keys.init_stream, {"json": f'{{"{field}": {value}, "job": {job}}}'})
        await client.r.xadd(keys.init_stream, {"json": json.dumps(
            {"task": "echo", "instance": {"prompt": "hi"}, "job_id": "good", "submitter": "alice"})})
        async with stage_tasks(settings) as tasks:
            results = {r.job_id: r for r in await client.collect(len(texts) + 3, timeout_s=30)}
            assert alive(tasks) == []
        dead = [unpack(DeadLetter, f[b"data"]) for _id, f in await client.r.xrange(keys.dead)]
    assert results.pop("good").status == "completed"
    # The one that JSON itself cannot parse has no readable submitter: a dead letter only.
    assert set(results) == set(texts) - {"deeper-than-json"} | {"deep-msgpack", "huge-attempt", "huge-state"}
    assert all(r.status == "failed" and r.failure == "job" for r in results.values()), results
    assert "nests deeper" in results["deep"].error and "64-bit" in results["huge-int"].error
    assert "not a finite number" in results["nan"].error and "attempt" in results["huge-attempt"].error
    assert "cannot be carried on" in results["huge-state"].error
    assert len(dead) == len(texts) + 3


async def poison_results(r, keys: Keys, submitter: str, *, for_json: bool = False) -> list[str]:
    """Entries a reader cannot deliver, between good results; returns the good job ids.
    ``for_json``: with one that only JSON cannot carry (nesting past its depth limit)."""
    stream = keys.results(submitter)
    good = []
    poisons = [b"\xc1 not msgpack", msgpack.packb([1, 2]), msgpack.packb({"status": "??"})]
    if for_json:
        poisons.append(msgpack.packb({"job_id": "deep", "status": "completed", "metadata": nested(300)}))
    for i, poison in enumerate(poisons):
        await r.xadd(stream, {"data": poison})
        result = Result(job_id=f"good-{i}", submitter=submitter, task="echo", status="completed", reward=1.0)
        await r.xadd(stream, {"data": pack(result)})
        good.append(result.job_id)
    await r.xadd(stream, {"other": b"no data field"})
    return good


async def test_a_poison_result_is_dead_lettered_and_the_client_gets_the_rest(settings):
    keys = Keys(settings.namespace)
    async with AsyncClient(settings=settings, submitter="carol") as client:
        await client._ensure_results_group()
        good = await poison_results(client.r, keys, "carol")
        got = [r.job_id async for r in client.results(timeout_s=1)]
        assert got == good
        assert await client.r.xlen(keys.dead) == 4
        assert [r async for r in client.results(timeout_s=0.3)] == []
