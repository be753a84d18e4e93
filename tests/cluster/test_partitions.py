"""Rollout nodes on hosts of their own, joined to a Redis host by a real network (namespaces,
veth, a bridge: chaos/net_cluster.py): a node cut off from Redis mid-load has its jobs rescued by the
others exactly once, and when its cable is back its late work is dropped; a trainer cut off
finds its results waiting when it returns. An inference host cut off mid-turn:
tests/real_vllm/test_vllm_on_cluster.py (the session's vLLM on this cluster's network). Nothing
here is addressed but these hosts."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from chaos.cluster import FAST_TIMEOUTS
from chaos.net_cluster import NODES, REDIS_PORT, NetCluster, collect_all
from rollstream.client import AsyncClient
from rollstream.pipeline.keys import Keys


@pytest.fixture(scope="module")
def shared_net_cluster():
    """One cluster for the module's tests (its nine worker processes take a quarter of a minute to
    start on two cores): processes only, nothing bound to an event loop, so each test's loop drives it."""
    folder = Path(tempfile.mkdtemp(prefix="rs-net-", dir="/tmp"))
    cluster = NetCluster(folder)
    try:
        yield asyncio.run(cluster.start())
    finally:
        cluster.stop()
        subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.fixture
def net_cluster(shared_net_cluster):
    """The shared cluster, every cable back in and plain after the test (each test uses a submitter
    of its own)."""
    yield shared_net_cluster
    for name in shared_net_cluster.net.hosts:
        shared_net_cluster.net.heal(name)
        shared_net_cluster.net.shape(name)


async def _running_on(client: AsyncClient, job_ids: list[str], node: str) -> list[str]:
    states = await asyncio.gather(*(client.status(j) for j in job_ids))
    return [j for j, st in zip(job_ids, states) if st and st.node == node and st.stage == "run"
            and st.status == "running"]


@pytest.mark.slow
async def test_a_node_cut_off_from_redis_mid_load_has_its_jobs_rescued_once_and_its_late_work_dropped(net_cluster):
    cluster = net_cluster
    async with AsyncClient(settings=cluster.settings(), submitter="trainer") as client:
        jobs = [{"task": "echo", "instance": {"prompt": f"p{i}", "run_s": 3.0}} for i in range(48)]
        job_ids = [str(s) for s in await client.submit_many(jobs)]
        # Which node's init takes which job is the nodes' race: cut the one running the most.
        deadline = time.monotonic() + 120
        while True:
            running = {node: await _running_on(client, job_ids, node) for node in NODES}
            cut, victims = max(running.items(), key=lambda item: len(item[1]))
            if victims:
                break
            assert time.monotonic() < deadline, "no job reached a run stage"
            await asyncio.sleep(0.1)
        cluster.net.cut(cut)  # mid-load: the node holds running jobs it cannot report
        cut_at = time.monotonic()
        # The others notice its silence (worker_ttl_s) and move its jobs back to init; keep it
        # away long enough that they finish them elsewhere before it returns.
        rescued_states = None
        while time.monotonic() - cut_at < 60:
            states = await asyncio.gather(*(client.status(j) for j in victims))
            if all(st and st.node != cut for st in states):
                rescued_states = states
                break
            await asyncio.sleep(0.2)
        assert rescued_states is not None, f"{cut}'s jobs were not rescued while it was cut off"
        cluster.net.heal(cut)
        healed_at = time.monotonic()
        results = await collect_all(client, job_ids, timeout_s=240)
        # The cut node finishes what it held (3 s of run each) and tries to hand it on once its cable
        # is back: give its late copies that long from the heal to arrive, if anything let them through
        # (collecting the others' results already took part of it).
        await asyncio.sleep(max(0.0, healed_at + FAST_TIMEOUTS["visibility_timeout_s"] + 6 - time.monotonic()))
        results += [r async for r in client.results(timeout_s=2.0)]

    per_job = Counter(r.job_id for r in results)
    assert set(per_job) == set(job_ids) and set(per_job.values()) == {1}, per_job.most_common(3)
    assert {r.status for r in results} == {"completed"}
    by_id = {r.job_id: r for r in results}
    assert all(by_id[j].attempts >= 2 for j in victims)  # redone elsewhere, never the cut node's late copy
    # The cut node is back and serving: its workers heart-beat again.
    async with AsyncClient(settings=cluster.settings(), submitter="trainer") as client:
        more = [str(s) for s in await client.submit_many(
            [{"task": "echo", "instance": {"prompt": f"after{i}"}} for i in range(12)])]
        after = await collect_all(client, more, timeout_s=120)
    assert {r.status for r in after} == {"completed"} and len(after) == 12


@pytest.mark.slow
async def test_a_trainer_cut_off_over_a_slow_lossy_network_finds_every_result_waiting_when_it_returns(net_cluster):
    cluster = net_cluster
    # Every node's cable delays what it sends and loses some of it (netem, or the userspace wire
    # where the kernel has none): hand-offs, heartbeats and results cross it, retransmitted by TCP.
    for node in NODES:
        cluster.net.shape(node, delay_ms=20, jitter_ms=5, loss_percent=2)
    async with AsyncClient(settings=cluster.settings(), submitter="away-trainer") as client:
        job_ids = [str(s) for s in await client.submit_many(
            [{"task": "echo", "instance": {"prompt": f"t{i}", "run_s": 0.5}} for i in range(30)])]
    cluster.net.cut("driver")  # the trainer's host: the nodes go on without it
    # Away until every result waits in its stream, as the Redis host itself sees it (the driver cannot).
    waiting = cluster.redis_host.command(["redis-cli", "-h", cluster.redis_host.address, "-p", str(REDIS_PORT),
                                          "XLEN", Keys(cluster.namespace).results("away-trainer")])
    deadline = time.monotonic() + 120
    while (count := subprocess.run(waiting, capture_output=True, text=True).stdout.strip()) != str(len(job_ids)):
        assert time.monotonic() < deadline, f"{count!r} of {len(job_ids)} results waiting after 120 s"
        await asyncio.sleep(0.2)
    cluster.net.heal("driver")
    async with AsyncClient(settings=cluster.settings(), submitter="away-trainer") as client:
        results = await collect_all(client, job_ids, timeout_s=120)
    assert sorted(r.job_id for r in results) == sorted(job_ids)
    assert {r.status for r in results} == {"completed"}

