"""A Redis that fails over, made of real processes on loopback: a primary, two replicas of it
and three Debian redis-sentinel daemons watching them (down after 1 s), in a tmp folder.
Two replicas, so that the primary promoted after
a failover still has one to confirm writes (replica_acks=1)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as redis_sync

SERVICE = "rs-primary"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ping(port: int, what: str, proc: subprocess.Popen, log: Path) -> None:
    client = redis_sync.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            client.ping()
            return
        except (redis_sync.ConnectionError, redis_sync.TimeoutError):
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer on 127.0.0.1:{port} within 30 s: {log.read_text()[-2000:]}")


@dataclass
class SentinelRedis:
    """The topology; ``url`` is the redis+sentinel:// URL clients and workers are given."""

    folder: Path
    data_ports: list[int]
    sentinel_ports: list[int]
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    service: str = SERVICE

    @property
    def url(self) -> str:
        members = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{members}/{SERVICE}/0"

    def _start(self, port: int, argv: list[str], what: str) -> None:
        log = self.folder / f"{port}.log"
        self.procs[port] = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        _wait_ping(port, what, self.procs[port], log)

    def start(self) -> SentinelRedis:
        primary = self.data_ports[0]
        for port in self.data_ports:
            folder = self.folder / str(port)
            folder.mkdir()
            argv = [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind",
                    "127.0.0.1", "--dir", str(folder), "--save", "", "--appendonly", "yes",
                    "--appendfsync", "everysec", "--maxclients", "10000", "--repl-diskless-sync-delay", "0"]
            if port != primary:
                argv += ["--replicaof", "127.0.0.1", str(primary)]
            self._start(port, argv, f"redis-server :{port}")
        for port in self.sentinel_ports:
            conf = self.folder / f"sentinel-{port}.conf"  # a Sentinel rewrites its own config file
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            self._start(port, [shutil.which("redis-sentinel") or "/usr/bin/redis-sentinel", str(conf)],
                        f"redis-sentinel :{port}")
        self.wait_for_replicas()
        return self

    def primary_port(self) -> int:
        """The primary's port as the Sentinels name it now."""
        s = redis_sync.Redis(host="127.0.0.1", port=self.sentinel_ports[0], socket_timeout=2)
        _host, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def wait_for_replicas(self, timeout_s: float = 30.0) -> None:
        """Until the primary has its replicas online and every Sentinel knows them and the others."""
        deadline = time.monotonic() + timeout_s
        primary = redis_sync.Redis(host="127.0.0.1", port=self.data_ports[0], socket_timeout=2)
        replicas = len(self.data_ports) - 1
        while time.monotonic() < deadline:
            info = primary.info("replication")
            # Synced ("online"), not merely connected: a replica still waiting for its first sync
            # has no data, and a Sentinel may promote it.
            online = sum(info.get(f"slave{i}", {}).get("state") == "online" for i in range(replicas))
            if online == replicas and self._sentinels_see_replicas(replicas):
                return
            time.sleep(0.1)
        raise RuntimeError("the replicas did not come online under the Sentinels within "
                           f"{timeout_s:.0f} s; logs in {self.folder}")

    def _sentinels_see_replicas(self, count: int) -> bool:
        for port in self.sentinel_ports:
            replicas = redis_sync.Redis(host="127.0.0.1", port=port, socket_timeout=2).sentinel_slaves(SERVICE)
            if sum(not r["is_sdown"] for r in replicas) < count:
                return False
            masters = redis_sync.Redis(host="127.0.0.1", port=port, socket_timeout=2).sentinel_masters()
            if masters[SERVICE]["num-other-sentinels"] < len(self.sentinel_ports) - 1:
                return False
        return True

    def kill_primary(self) -> int:
        port = self.primary_port()
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(10)
        return port

    async def wait_failover(self, old_port: int, timeout_s: float = 60.0) -> int:
        """Until every Sentinel names a new primary that answers as one; its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            named = [int(redis_sync.Redis(host="127.0.0.1", port=p, socket_timeout=2)
                         .execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])
                     for p in self.sentinel_ports]
            if len(set(named)) == 1 and named[0] != old_port:
                role = redis_sync.Redis(host="127.0.0.1", port=named[0], socket_timeout=2).info("replication")["role"]
                if role == "master":
                    return named[0]
            await asyncio.sleep(0.2)
        raise AssertionError(f"no failover within {timeout_s:.0f} s; logs in {self.folder}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def sentinel_redis(tmp_path):
    """A primary, its two replicas and three Sentinels, all real processes on loopback ports."""
    folder = tmp_path / "sentinel"
    folder.mkdir()
    topology = SentinelRedis(folder, [_free_port() for _ in range(3)], [_free_port() for _ in range(3)])
    try:
        yield topology.start()
    finally:
        topology.stop()
