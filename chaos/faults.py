"""The faults a soak run injects while load is running, each a real kill or restart of a
real process. Every fault returns a line saying what it did, for the report."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Awaitable, Callable

import psutil

from chaos.cluster import LocalCluster
from chaos.diskfull import aof_write_failing
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.status import snapshot

Fault = Callable[[LocalCluster, random.Random], Awaitable[str]]


def _kill_worker(stage: str) -> Fault:
    async def fault(cluster: LocalCluster, rng: random.Random) -> str:
        candidates = [p for node in cluster.cfg.nodes if node not in cluster.cancelled_nodes
                      for p in cluster.workers(stage, node)]
        if not candidates:
            return f"no live {stage} worker to kill"
        victim = rng.choice(candidates)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait)
        return f"SIGKILL {stage} worker pid {victim.pid}"
    return fault


async def kill_supervisors(cluster: LocalCluster, rng: random.Random) -> str:
    """SIGKILL up to two live sandbox supervisors (the sandboxes of jobs in flight)."""
    for _ in range(100):  # wait for a sandbox to exist
        found = cluster.supervisors()
        if found:
            break
        await asyncio.sleep(0.1)
    else:
        return "no live sandbox supervisor to kill"
    victims = rng.sample(found, min(2, len(found)))
    killed = 0
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        except psutil.NoSuchProcess:
            pass  # its job finished (sandbox torn down) since the listing
    return f"SIGKILL {killed} sandbox supervisor(s)"


async def restart_redis(cluster: LocalCluster, rng: random.Random) -> str:
    await asyncio.to_thread(cluster.restart_redis)
    return "redis-server restarted (SIGTERM, AOF reload)"


async def kill_backend(cluster: LocalCluster, rng: random.Random, down_s: float = 3.0) -> str:
    if not cluster.servers:
        return "no inference backend to kill"
    index = rng.randrange(len(cluster.servers))
    cluster.kill_model_server(index)
    await asyncio.sleep(down_s)
    await cluster.restart_model_server(index)
    return f"model server {index} SIGKILLed, restarted {down_s:.0f} s later on the same port"


async def full_disk(cluster: LocalCluster, rng: random.Random, full_s: float = 5.0) -> str:
    """Fill Redis's disk to the last byte: it refuses every write (MISCONF) until space comes
    back. Workers must wait it out, none lost; the space is freed ``full_s`` after Redis first
    refused, and every job must still end with one result."""
    disk = cluster.redis_disk
    if disk is None:
        return "no small disk under Redis (ClusterConfig.redis_disk_mb): nothing filled"
    before = cluster.restarts + len(cluster.dead_workers())
    r = async_redis(cluster.redis_url)
    try:
        in_flight = sum(s.pending + (s.lag or 0) for s in (await snapshot(r, cluster.keys)).streams)
    finally:
        await r.aclose()
    filled = await asyncio.to_thread(disk.fill)
    deadline = asyncio.get_running_loop().time() + 30
    while not await asyncio.to_thread(aof_write_failing, cluster.redis_url):
        if asyncio.get_running_loop().time() > deadline:
            disk.free()
            return f"filled {filled >> 20} MiB, but Redis never failed a write in 30 s; freed"
        await asyncio.sleep(0.1)
    await asyncio.sleep(full_s)
    lost = cluster.restarts + len(cluster.dead_workers()) - before
    disk.free()
    while await asyncio.to_thread(aof_write_failing, cluster.redis_url):
        await asyncio.sleep(0.1)
    cluster.workers_lost += lost
    return (f"Redis's disk filled ({filled >> 20} MiB filler) with {in_flight} jobs queued or at work: "
            f"MISCONF for {full_s:.0f} s, then freed; {lost} workers lost meanwhile")


async def restart_api(cluster: LocalCluster, rng: random.Random) -> str:
    await cluster.restart_api()
    return "API process SIGKILLed and restarted"


async def cancel_node(cluster: LocalCluster, rng: random.Random) -> str:
    node = cluster.cfg.nodes[-1]
    n = await asyncio.to_thread(cluster.cancel_node, node)
    return f"node {node}: {n} workers and its sandboxes SIGKILLed, not restarted"


FAULTS: dict[str, Fault] = {
    "kill-init": _kill_worker("init"),
    "kill-run": _kill_worker("run"),
    "kill-eval": _kill_worker("eval"),
    "kill-supervisor": kill_supervisors,
    "restart-redis": restart_redis,
    "kill-backend": kill_backend,
    "restart-api": restart_api,
    "full-disk": full_disk,
    "cancel-node": cancel_node,  # last: the node stays down
}
