"""Rollout nodes on hosts of their own, joined to a Redis host by a real network (namespaces,
veth, a bridge: netns.py; delay and loss on a cable: wire.py): the cluster that the partition
tests (tests/cluster/test_partitions.py), the vLLM inference-host test
(tests/real_vllm/test_vllm_on_cluster.py) and bench/vllm_host.py drive. Needs root."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from chaos.cluster import FAST_TIMEOUTS
from chaos.netns import Network
from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.messages import Result
from rollstream.workers.pool import WorkerPool

NODES = ("n1", "n2", "n3")
REDIS_PORT = 6379


class NetCluster:
    """A Redis host and rollout nodes (init, run and eval pools each), the driver (the caller)
    on the machine's own namespace."""

    def __init__(self, folder: Path, nodes: tuple[str, ...] = NODES) -> None:
        self.folder = folder
        os.chmod(folder, 0o711)  # sandboxes run under uids of their own, which must reach their workdirs
        self.net = Network()
        self.net.add_host("driver", driver=True)
        self.redis_host = self.net.add_host("redis")
        self.namespace = f"net{uuid.uuid4().hex[:6]}"
        self.redis_proc: subprocess.Popen | None = None
        self.pools: dict[str, WorkerPool] = {}
        self.nodes = nodes

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_host.address}:{REDIS_PORT}/0"

    def settings(self) -> Settings:
        return Settings(redis_url=self.redis_url, namespace=self.namespace, data_dir=self.folder / "driver",
                        **{k: v for k, v in FAST_TIMEOUTS.items()})

    async def start(self, extra_env: dict[str, str] | None = None) -> NetCluster:
        log = (self.folder / "redis.log").open("ab")
        self.redis_proc = subprocess.Popen(
            self.redis_host.command(["redis-server", "--bind", self.redis_host.address, "--port", str(REDIS_PORT),
                                     "--protected-mode", "no", "--save", "", "--appendonly", "no",
                                     "--dir", str(self.folder)]),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for name in self.nodes:
            host = self.net.add_host(name)
            env = {f"ROLLSTREAM_{k.upper()}": str(v) for k, v in FAST_TIMEOUTS.items()}
            env["ROLLSTREAM_SANDBOX_ROOT"] = str(self.folder / "sandboxes" / name)
            env.update(extra_env or {})
            pool = WorkerPool(redis_url=self.redis_url, namespace=self.namespace, node=name,
                              data_dir=self.folder / "workers" / name, env=env, log_dir=self.folder / "logs" / name,
                              program=host.command([sys.executable, "-m", "rollstream", "worker"]))
            pool.start_all(concurrency=32)
            self.pools[name] = pool
        async with AsyncClient(settings=self.settings(), submitter="driver") as client:
            for pool in self.pools.values():
                await pool.wait_registered(client.r, client.keys.workers, 3 * len(self.pools), timeout_s=120)
        return self

    def stop(self) -> None:
        for pool in self.pools.values():
            pool.stop(timeout_s=20)
        if self.redis_proc and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            self.redis_proc.wait(10)
        self.net.close()


async def collect_all(client: AsyncClient, job_ids: list[str], timeout_s: float) -> list[Result]:
    """The client's results until every one of `job_ids` has one (and whatever else came)."""
    results: list[Result] = []
    deadline = time.monotonic() + timeout_s
    wanted = set(job_ids)
    while not wanted.issubset({r.job_id for r in results}):
        assert time.monotonic() < deadline, f"{len(results)} of {len(job_ids)} results after {timeout_s} s"
        async for result in client.results(timeout_s=2.0):
            results.append(result)
    return results


def backends_of(result: Result) -> list[str | None]:
    """The backends a job's turns went to, in order (a trajectory names more than its last
    one only when it changed)."""
    traj = result.trajectory
    return list(traj.extra.get("backends") or [traj.backend]) if traj else []

