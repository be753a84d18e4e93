"""Draining a node from each door: the CLI (``rollstream drain``), the HTTP API and SIGTERM (what
``scancel`` sends). The node takes no new init work, finishes or hands back what it holds
within the grace time, shows as draining and then leaves the live list; another node does the
rest, and every job ends exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter

import httpx

from rollstream.api.app import asgi
from rollstream.client import AsyncClient
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.drain import node_workers
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import snapshot

TOKEN = "drain-token"


def _echo(i: int, run_s: float) -> dict:
    return {"task": "echo", "instance": {"prompt": f"p{i}", "run_s": run_s}}


async def _states(client: AsyncClient, ids: list[str]):
    return [await client.status(j) for j in ids]


async def _nodes_of(client: AsyncClient, ids: list[str]) -> list[str | None]:
    return [s.node if s else None for s in await _states(client, ids)]


class DrainWatch:
    """Samples ``rollstream status`` (the snapshot) while a drain goes on: was a worker of
    ``node`` ever shown draining?"""

    def __init__(self, r, keys, node: str):
        self.r, self.keys, self.node = r, keys, node
        self.seen_draining = False
        self._done = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        # Ends by its flag: a cancel landing inside a redis-py call can be swallowed.
        while not self._done.is_set():
            st = await snapshot(self.r, self.keys)
            if any(w.draining and w.node == self.node for w in st.workers):
                self.seen_draining = True
            await asyncio.sleep(0.05)

    async def __aenter__(self) -> DrainWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc) -> None:
        self._done.set()
        await asyncio.wait_for(self._task, 30)


async def _start_n2(worker_pool, r, keys, wait_until):
    """A second node, n2, to take what n1 no longer does; returns once its three workers serve."""
    other = worker_pool(node="n2")
    other.start_all(concurrency=8)

    async def serving():
        other.check_alive()
        return len(await node_workers(r, keys, "n2", 60.0)) == 3

    await wait_until(serving, timeout_s=120, what="n2's workers registering")
    return other


def _once_each(results, ids) -> None:
    counts = Counter(r.job_id for r in results)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}, counts
    assert all(r.status == "completed" for r in results), [(r.job_id, r.status, r.error) for r in results]


async def test_cli_drain_finishes_the_nodes_jobs_and_takes_it_off_the_live_list(
        settings, worker_pool, cli_env, wait_until):
    r = async_redis(settings.redis_url)
    keys = Keys(settings.namespace)
    try:
        n1 = worker_pool(node="n1")
        n1.start_all(concurrency=8)
        await n1.wait_registered(r, keys.workers, 3)
        async with AsyncClient(settings=settings) as client:
            held = await client.submit_many([_echo(i, run_s=4.0) for i in range(4)])

            async def running():
                return all(s and s.stage == "run" and s.status == "running" for s in await _states(client, held))

            await wait_until(running, what="n1 running its jobs")
            async with DrainWatch(r, keys, "n1") as watch:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "rollstream", "drain", "n1", "--grace-s", "30", "--json",
                    env={**os.environ, **cli_env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

                async def init_left():  # n1's init stopped taking work (a read under way when it heard ends first)
                    return not await node_workers(r, keys, "n1", settings.worker_ttl_s, ("init",))

                await wait_until(init_left, timeout_s=60, what="n1's init worker leaving")
                await _start_n2(worker_pool, r, keys, wait_until)  # n1's run and eval still finish its jobs
                later = await client.submit_many([_echo(i, run_s=0.1) for i in range(4, 10)])
                out, err = await asyncio.wait_for(proc.communicate(), 90)
            assert proc.returncode == 0, err.decode()
            outcome = json.loads(out)
            results = await client.collect(10, timeout_s=60)
            late = [x async for x in client.results(timeout_s=1)]
            nodes = await _nodes_of(client, held + later)
        _once_each(results + late, held + later)
        assert outcome["node"] == "n1" and outcome["left"] and not outcome["still_live"]
        assert all(res.attempts == 1 for res in results if res.job_id in held)  # n1 finished what it held
        assert nodes[:4] == ["n1"] * 4 and set(nodes[4:]) == {"n2"}  # and took nothing new
        assert watch.seen_draining
        assert await node_workers(r, keys, "n1", settings.worker_ttl_s) == []
        assert await r.zscore(keys.nodes, "n1") is None
        assert all(code == 0 for code in [p.wait(10) for _s, p in n1.procs])
    finally:
        await r.aclose()


async def test_api_drain_hands_back_at_the_deadline_what_the_node_has_not_finished(
        settings, worker_pool, asgi_server, wait_until):
    r = async_redis(settings.redis_url)
    keys = Keys(settings.namespace)
    try:
        n1 = worker_pool(node="n1")
        n1.start_all(concurrency=8)
        await n1.wait_registered(r, keys.workers, 3)
        with asgi_server(asgi(settings, token=TOKEN)) as base:
            async with AsyncClient(settings=settings) as client, httpx.AsyncClient(base_url=base) as http:
                auth = {"Authorization": f"Bearer {TOKEN}"}
                assert (await http.post("/v1/nodes/n1/drain")).status_code == 401
                missing = await http.post("/v1/nodes/nowhere/drain", headers=auth)
                assert missing.status_code == 404 and "no live worker" in missing.json()["detail"]
                spec = (await http.get("/openapi.json", headers=auth)).json()
                assert "/v1/nodes/{node}/drain" in spec["paths"]

                slow = await client.submit_many([_echo(i, run_s=6.0) for i in range(3)])

                async def running():
                    return all(s and s.stage == "run" and s.status == "running" for s in await _states(client, slow))

                await wait_until(running, what="n1 running its jobs")
                async with DrainWatch(r, keys, "n1") as watch:
                    answer = await http.post("/v1/nodes/n1/drain", json={"grace_s": 0.5}, headers=auth)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["node"] == "n1" and len(answer.json()["workers"]) == 3

                    async def n1_gone():
                        return not await node_workers(r, keys, "n1", settings.worker_ttl_s)

                    await wait_until(n1_gone, timeout_s=60, what="n1's workers leaving")
                await _start_n2(worker_pool, r, keys, wait_until)  # the jobs wait for it on the init stream
                results = await client.collect(3, timeout_s=90)
                late = [x async for x in client.results(timeout_s=1)]
                nodes = await _nodes_of(client, slow)
        _once_each(results + late, slow)
        assert set(nodes) == {"n2"}  # handed back at the deadline, done on n2
        assert watch.seen_draining
        assert await r.zscore(keys.nodes, "n1") is None
        assert all(code == 0 for code in [p.wait(10) for _s, p in n1.procs])
    finally:
        await r.aclose()


async def test_sigterm_to_every_worker_of_a_node_finishes_what_it_holds_and_leaves_the_live_list(
        settings, worker_pool, wait_until):
    r = async_redis(settings.redis_url)
    keys = Keys(settings.namespace)
    try:
        n1 = worker_pool(node="n1", shutdown_grace_s=60.0)
        n1.start("init", concurrency=8)
        n1.start("run", concurrency=1)  # one job at work, the others queued on n1's run stream
        n1.start("eval", concurrency=8)
        await n1.wait_registered(r, keys.workers, 3)
        async with AsyncClient(settings=settings) as client:
            ids = await client.submit_many([_echo(i, run_s=1.0) for i in range(3)])

            async def one_running_two_queued():
                states = await _states(client, ids)
                return (sum(s.stage == "run" and s.status == "running" for s in states if s) == 1
                        and sum(s.stage == "run" and s.status == "queued" for s in states if s) == 2)

            await wait_until(one_running_two_queued, what="one job running on n1, two queued there")
            async with DrainWatch(r, keys, "n1") as watch:
                for _stage, proc in n1.procs:  # what scancel does: every process of the node at once
                    proc.send_signal(signal.SIGTERM)

                async def n1_gone():
                    return not await node_workers(r, keys, "n1", settings.worker_ttl_s)

                await wait_until(n1_gone, timeout_s=60, what="n1's workers leaving")
            # Off the list as its last worker left, not once its heartbeat is worker_ttl_s old.
            assert await r.zscore(keys.nodes, "n1") is None
            results = await client.collect(3, timeout_s=60)
            late = [x async for x in client.results(timeout_s=1)]
            nodes = await _nodes_of(client, ids)
        _once_each(results + late, ids)
        # Run served its queue while init stopped, eval stayed while run still handed it jobs:
        # every job finished where it was, none started over.
        assert nodes == ["n1"] * 3 and all(res.attempts == 1 for res in results)
        assert watch.seen_draining
        assert all(code == 0 for code in [p.wait(10) for _s, p in n1.procs])
    finally:
        await r.aclose()
