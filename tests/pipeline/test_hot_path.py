"""What the lean per-job path must still guarantee: a finished job's latencies reach the
histograms within a flush period of its result (no hand-off carries them), a job long at
work is marked "running" while short ones keep their timings without the mark, echo leaves
no work folder behind, init's back-pressure holds the node's sandbox limit while jobs come and
go, and the lean connection fails every caller when Redis drops it."""

from __future__ import annotations

import asyncio

import redis

from rollstream.client import AsyncClient
from rollstream.pipeline import histograms
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.pipeline.wire import FastRedis
from rollstream.sandbox_spec import SandboxSpec
from rollstream.tasks.echo import EchoTask
from rollstream.tasks.registry import register_task

from .conftest import serve_all, stop_all


async def _stage_counts(client: AsyncClient) -> dict[str, float | None]:
    return {stage: (await histograms.read(client.r, client.keys.stage_histogram(stage))).get("count")
            for stage in ("init", "run", "eval")}


async def test_histograms_count_every_result_within_a_flush_and_echo_leaves_no_workdir(settings):
    tasks = await serve_all(settings)
    try:
        async with AsyncClient(settings=settings) as client:
            await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}"}} for i in range(30)])
            results = await client.collect(30, timeout_s=30)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3 * histograms.FLUSH_S + 2  # a flush period, with room for a slow machine
            while (counts := await _stage_counts(client)) != {"init": 30.0, "run": 30.0, "eval": 30.0}:
                if loop.time() > deadline:
                    break
                await asyncio.sleep(0.05)
            buckets = await histograms.read(client.r, client.keys.stage_histogram("run"))
    finally:
        await stop_all(tasks)
    assert all(r.status == "completed" for r in results)
    assert counts == {"init": 30.0, "run": 30.0, "eval": 30.0}
    assert sum(v for k, v in buckets.items() if k not in ("sum", "count")) == 30
    assert abs(buckets["sum"] - sum(r.timings_s["run_s"] for r in results)) < 1e-6
    assert list((settings.data_dir / "work").iterdir()) == []


async def test_observations_gathered_at_shutdown_are_flushed(settings):
    """A worker stopped right after its last job adds that job's latencies on the way out."""
    tasks = await serve_all(settings)
    try:
        async with AsyncClient(settings=settings) as client:
            await client.submit({"task": "echo", "instance": {"prompt": "last"}})
            await client.collect(1, timeout_s=30)
    finally:
        await stop_all(tasks)
    async with AsyncClient(settings=settings) as client:
        assert await _stage_counts(client) == {"init": 1.0, "run": 1.0, "eval": 1.0}


async def test_a_job_long_at_work_is_marked_running_and_every_stage_keeps_its_timings(settings, wait_for_state):
    tasks = await serve_all(settings)
    try:
        async with AsyncClient(settings=settings) as client:
            slow = await client.submit({"task": "echo", "instance": {"prompt": "s", "run_s": 1.0}})
            running = await wait_for_state(client, slow, lambda s: s.stage == "run" and s.status == "running",
                                           timeout_s=10)
            fast = await client.submit({"task": "echo", "instance": {"prompt": "f"}})
            results = {r.job_id: r for r in await client.collect(2, timeout_s=30)}
            states = {job_id: await client.status(job_id) for job_id in (slow, fast)}
    finally:
        await stop_all(tasks)
    assert running.worker and running.node == settings.node
    for job_id, state in states.items():
        assert (state.stage, state.status) == ("done", "completed"), job_id
        assert {"init_started_at", "run_started_at", "eval_started_at"} <= set(state.timings), job_id
        assert state.worker  # the last stage's worker, written by its hand-off
        assert {"init_s", "run_s", "eval_s"} <= set(results[job_id].timings_s)


@register_task
class _SandboxedEcho(EchoTask):
    """Echo whose jobs hold a sandbox (the cheapest: the unisolated local backend) from init
    to eval, so that init's back-pressure on the node's live-sandbox set applies."""

    name = "test-sandboxed-echo"

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(backend="local", allow_unisolated=True)


async def test_init_back_pressure_holds_the_node_sandbox_limit(settings, sandbox_root):
    limited = settings.model_copy(update={"max_sandboxes_per_node": 3, "sandbox_root": sandbox_root})
    tasks = await serve_all(limited, concurrency=16)
    peak = 0
    try:
        async with AsyncClient(settings=limited) as client:
            key = client.keys.node_sandboxes(limited.node)
            await client.submit_many([{"task": "test-sandboxed-echo", "instance": {"prompt": f"p{i}", "run_s": 0.3}}
                                      for i in range(9)])
            collected = asyncio.create_task(client.collect(9, timeout_s=60))
            while not collected.done():
                peak = max(peak, await client.r.scard(key))
                await asyncio.sleep(0.01)
            results = collected.result()
            left = await client.r.scard(key)
    finally:
        await stop_all(tasks)
    assert all(r.status == "completed" for r in results)
    assert 1 <= peak <= 3 and left == 0


async def test_the_lean_connection_fails_every_waiting_caller_when_redis_drops_it(redis_url, namespace):
    r = async_redis(redis_url)
    fast = FastRedis.from_client(r)
    try:
        assert await fast.execute("PING") == b"PONG"
        waiting = [asyncio.create_task(fast.execute("BLPOP", f"{namespace}:never", 5)) for _ in range(3)]
        await asyncio.sleep(0.1)
        await r.client_kill_filter(skipme=False, _type="normal")
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(o, redis.ConnectionError) for o in outcomes)
        # The loss was noticed (every caller failed), so the next call connects afresh.
        assert await fast.execute("PING") == b"PONG"
    finally:
        await fast.close()
        await r.aclose()


async def test_the_lean_connection_gives_up_on_a_redis_that_does_not_answer(redis_url, namespace):
    r = async_redis(redis_url)
    fast = FastRedis.from_client(r)
    fast.timeout_s = 0.3
    try:
        assert await fast.execute("PING") == b"PONG"
        try:
            await fast.execute("BLPOP", f"{namespace}:never", 5)  # longer than the timeout
            raise AssertionError("a reply past the timeout was waited for")
        except redis.TimeoutError:
            pass
        assert await fast.execute("PING") == b"PONG"  # on a fresh connection
        # A long timeout given per call covers a blocking command.
        assert await fast.execute("BLPOP", f"{namespace}:never", 0.5, timeout_s=5) is None
    finally:
        await fast.close()
        await r.aclose()



async def _reads_processed(r) -> int:
    return int((await r.info("stats"))["total_reads_processed"])


async def test_corked_commands_from_several_tasks_reach_redis_in_one_read(tmp_path, namespace):
    """A worker's hand-off and its next read travel together: what is sent while the
    connection is corked goes out in one write when it is uncorked."""
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:  # no other client reads
        await _three_commands_in_one_read(server.url, namespace)


async def _three_commands_in_one_read(url: str, namespace: str) -> None:
    r = async_redis(url)
    fast = FastRedis.from_client(r)
    try:
        assert await fast.execute("PING") == b"PONG"  # connected
        before = await _reads_processed(r)
        fast.cork()
        first = asyncio.create_task(fast.execute("INCR", f"{namespace}:corked"))
        second = asyncio.create_task(fast.execute("INCR", f"{namespace}:corked"))
        await asyncio.sleep(0)  # both tasks queue their command on the corked connection
        last = await fast.execute("INCR", f"{namespace}:corked", uncork=True)
        assert sorted([await first, await second, last]) == [1, 2, 3]
        # Redis read the three commands at once (the second INFO is one read more).
        assert await _reads_processed(r) - before == 2
    finally:
        await fast.close()
        await r.aclose()


async def test_a_reply_awaited_while_corked_still_comes(redis_url):
    """Nothing waits on a cork left in place: what it holds goes out on the loop's next turn."""
    r = async_redis(redis_url)
    fast = FastRedis.from_client(r)
    try:
        fast.cork()
        assert await asyncio.wait_for(fast.execute("PING"), 5) == b"PONG"  # connects, then sends
        fast.cork()
        assert await asyncio.wait_for(fast.execute("PING"), 5) == b"PONG"
    finally:
        await fast.close()
        await r.aclose()


async def test_hand_offs_after_a_script_flush_do_not_wait_behind_a_blocking_read(settings):
    """Redis forgets its scripts when it restarts. A hand-off sent on the reader connection
    then gets NOSCRIPT after the worker's next (blocking) read was queued behind it: the
    script is loaded and re-run on the hand-off's own connection, not behind that read
    (with reads blocking 30 s here, waiting behind one would run past the collect timeout)."""
    patient = settings.model_copy(update={"read_block_ms": 30_000})
    tasks = await serve_all(patient)
    try:
        async with AsyncClient(settings=patient) as client:
            await client.submit({"task": "echo", "instance": {"prompt": "first"}})
            await client.collect(1, timeout_s=20)
            for i in range(3):
                await client.r.script_flush()
                await client.submit({"task": "echo", "instance": {"prompt": f"after flush {i}"}})
                [result] = await client.collect(1, timeout_s=10)
                assert result.status == "completed" and result.reward == 1.0
    finally:
        await stop_all(tasks)
