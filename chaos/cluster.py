"""A whole rollstream deployment on one machine whose parts can be killed and restarted:
embedded Redis (AOF), worker pools for several "nodes", built-in model servers registered
with the balancer, and the HTTP API, each a real process. Soak runs and chaos tests drive it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from chaos.diskfull import SmallDisk
from rollstream.llm.balancer import add_backend
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.pipeline.keys import Keys
from rollstream.sandboxes import Reaper, live_supervisors
from rollstream.workers.pool import WorkerPool

log = logging.getLogger(__name__)

# Faults are injected every few seconds, so failure detection must be quicker than the
# production defaults (which favour not mistaking a slow worker for a dead one).
FAST_TIMEOUTS = {
    "visibility_timeout_s": 3.0,
    "heartbeat_interval_s": 0.5,
    "worker_ttl_s": 3.0,
    "max_deliveries": 5,
    "shutdown_grace_s": 5.0,
    "read_block_ms": 200,
    "lease_ttl_s": 6.0,
}


@dataclass
class ClusterConfig:
    data_dir: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    processes_per_stage: int = 1
    concurrency: int = 64
    model_dir: Path | None = None  # set to run LLM tasks (arith) through model servers
    model_servers: int = 1
    api: bool = True
    namespace: str = "soak"
    api_token: str = "soak-token"
    timeouts: dict[str, float] = field(default_factory=lambda: dict(FAST_TIMEOUTS))
    # Redis's data folder on a tmpfs of this many MiB (root only), so that a fault can fill
    # its disk for real (full-disk); None keeps it in data_dir/redis.
    redis_disk_mb: int | None = None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ModelServer:
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LocalCluster:
    """Start with ``await cluster.start()``; ``await cluster.stop()`` leaves nothing running.
    Dead worker processes of a node that was not cancelled are restarted by
    ``restart_dead_workers`` (the job of systemd, compose or Slurm's requeue in production)."""

    def __init__(self, config: ClusterConfig):
        self.cfg = config
        self.redis_disk = SmallDisk(config.data_dir / "redis-disk", config.redis_disk_mb) \
            if config.redis_disk_mb else None
        self.redis = self._redis()
        self.keys = Keys(config.namespace)
        self.pools: dict[str, WorkerPool] = {}
        self.cancelled_nodes: set[str] = set()
        self.servers: list[ModelServer] = []
        self.api_port = _free_port()
        self.api_proc: subprocess.Popen | None = None
        self.restarts = 0
        self.workers_lost = 0  # workers that died during a fault that must kill none (full-disk)

    # -- addresses -----------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def sandbox_root(self, node: str) -> Path:
        return self.cfg.data_dir / "sandboxes" / node

    def settings_env(self, node: str) -> dict[str, str]:
        env = {f"ROLLSTREAM_{k.upper()}": str(v) for k, v in self.cfg.timeouts.items()}
        env["ROLLSTREAM_SANDBOX_ROOT"] = str(self.sandbox_root(node))
        if self.cfg.model_dir:
            env["ROLLSTREAM_MODEL_DIR"] = str(self.cfg.model_dir)
        return env

    # -- lifecycle -----------------------------------------------------------------
    def _redis(self) -> EmbeddedRedis:
        # With a small disk, the socket stays in data_dir/redis and the AOF goes to the disk
        # (a later --dir wins).
        extra = ["--dir", str(self.redis_disk.path)] if self.redis_disk else []
        return EmbeddedRedis(self.cfg.data_dir / "redis", appendonly=True, extra_args=extra)

    async def start(self) -> LocalCluster:
        if self.redis_disk:
            self.redis_disk.mount()
        self.redis.start()
        for node in self.cfg.nodes:
            pool = WorkerPool(redis_url=self.redis_url, namespace=self.cfg.namespace, node=node,
                              data_dir=self.cfg.data_dir / "workers" / node, env=self.settings_env(node),
                              log_dir=self.cfg.data_dir / "logs" / node)
            pool.start_all(processes=self.cfg.processes_per_stage, concurrency=self.cfg.concurrency)
            self.pools[node] = pool
        if self.cfg.model_dir:
            for _ in range(self.cfg.model_servers):
                self.servers.append(await asyncio.to_thread(self._start_model_server, _free_port()))
            r = async_redis(self.redis_url)
            for server in self.servers:
                await add_backend(r, server.url, self.cfg.namespace)
            await r.aclose()
        if self.cfg.api:
            self.start_api()
            await self.wait_api()
        await self.wait_workers(len(self.cfg.nodes) * 3 * self.cfg.processes_per_stage)
        return self

    async def stop(self) -> None:
        if self.api_proc:
            self.api_proc.terminate()
        for pool in self.pools.values():
            await asyncio.to_thread(pool.stop, 20)
        for server in self.servers:
            _terminate(server.proc)
        if self.api_proc:
            _terminate(self.api_proc)
        self.redis.stop()
        if self.redis_disk:
            self.redis_disk.free()
            self.redis_disk.unmount()

    async def wait_workers(self, n: int, timeout_s: float = 60) -> None:
        r = async_redis(self.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while await r.zcard(self.keys.workers) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fewer than {n} workers registered after {timeout_s}s; see "
                                       f"{self.cfg.data_dir / 'logs'}")
                await asyncio.sleep(0.1)
        finally:
            await r.aclose()

    # -- parts that faults act on --------------------------------------------------
    def workers(self, stage: str | None = None, node: str | None = None) -> list[subprocess.Popen]:
        return [p for n, pool in self.pools.items() if node in (None, n)
                for s, p in pool.alive() if stage in (None, s)]

    def dead_workers(self) -> list[subprocess.Popen]:
        """Exited worker processes of nodes still in service (not yet restarted)."""
        return [p for node, pool in self.pools.items() if node not in self.cancelled_nodes
                for _stage, p in pool.procs if p.poll() is not None]

    def restart_dead_workers(self) -> int:
        """Start a replacement for every exited worker of a node still in service."""
        started = 0
        for node, pool in self.pools.items():
            if node in self.cancelled_nodes:
                continue
            for stage, proc in list(pool.procs):
                if proc.poll() is not None:
                    pool.procs.remove((stage, proc))
                    pool.start(stage, concurrency=self.cfg.concurrency)
                    started += 1
        self.restarts += started
        return started

    def cancel_node(self, node: str) -> int:
        """What ``scancel`` of a node's worker array does, without the grace: every worker of
        the node SIGKILLed and not restarted."""
        self.cancelled_nodes.add(node)
        procs = self.workers(node=node)
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        # Slurm kills the whole job cgroup: the node's fork server, supervisors and sandboxes too.
        root = str(self.sandbox_root(node))
        doomed = []
        for proc in psutil.process_iter(["cwd", "cmdline"]):
            try:
                if (proc.info.get("cwd") or "").startswith(root) or any(root in a for a in proc.info["cmdline"] or []):
                    doomed += [proc, *proc.children(recursive=True)]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        for proc in doomed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(doomed, timeout=5)
        return len(procs)

    def reap_cancelled_nodes(self) -> list[str]:
        """What a cancelled node's reaper does when workers start there again: tear down what
        its killed sandboxes left on the host (tmpfs mounts, cgroups, folders). On a real
        cluster a node that died takes these with it; one whose array task was cancelled keeps
        them until its next workers start."""
        reaped = []
        for node in self.cancelled_nodes:
            reaped += Reaper(str(self.sandbox_root(node))).reap(lambda _sandbox, _owner: False)
        return reaped

    def supervisors(self) -> list[psutil.Process]:
        """Live sandbox supervisors under this cluster's sandbox roots."""
        return live_supervisors(self.cfg.data_dir / "sandboxes")

    def restart_redis(self) -> None:
        """A clean restart (SIGTERM flushes the AOF), on the same socket."""
        self.redis.stop()
        self.redis = self._redis()
        self.redis.start()

    def _start_model_server(self, port: int) -> ModelServer:
        from rollstream.llm.server import start_server_process  # imports torch: only clusters with a model pay

        proc, _url = start_server_process(self.cfg.model_dir, port=port, device="cpu")
        return ModelServer(port=port, proc=proc)

    def kill_model_server(self, index: int = 0) -> ModelServer:
        server = self.servers[index]
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        return server

    async def restart_model_server(self, index: int = 0) -> None:
        """Same port, so the balancer's entry for it comes back once health checks pass."""
        port = self.servers[index].port
        self.servers[index] = await asyncio.to_thread(self._start_model_server, port)

    def start_api(self) -> None:
        env = {**os.environ, "REDIS_URL": self.redis_url, "ROLLSTREAM_NAMESPACE": self.cfg.namespace,
               "ROLLSTREAM_API_TOKEN": self.cfg.api_token, "ROLLSTREAM_DATA_DIR": str(self.cfg.data_dir / "api")}
        log_path = self.cfg.data_dir / "logs" / "api.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self.api_proc = subprocess.Popen([sys.executable, "-m", "rollstream", "api", "--host", "127.0.0.1",
                                              "--port", str(self.api_port)], env=env, stdout=out,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    async def wait_api(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                try:
                    if (await http.get(self.api_url + "/health", timeout=1)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"the API did not answer within {timeout_s}s; see {self.cfg.data_dir / 'logs' / 'api.log'}")

    async def restart_api(self) -> None:
        if self.api_proc:
            self.api_proc.kill()
            self.api_proc.wait()
        self.start_api()
        await self.wait_api()

    def processes(self) -> dict[str, int]:
        """Name → pid of every long-lived process, for memory sampling."""
        out = {f"{node}:{stage}:{i}": p.pid for node, pool in self.pools.items()
               for i, (stage, p) in enumerate(pool.procs) if p.poll() is None}
        if self.redis.proc and self.redis.proc.poll() is None:
            out["redis"] = self.redis.proc.pid
        if self.api_proc and self.api_proc.poll() is None:
            out["api"] = self.api_proc.pid
        for i, server in enumerate(self.servers):
            if server.proc.poll() is None:
                out[f"model-server:{i}"] = server.proc.pid
        return out


def _terminate(proc: subprocess.Popen, timeout_s: float = 15) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
