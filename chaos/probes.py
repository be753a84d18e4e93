"""What a soak run checks once the load has drained: sandboxes and processes left behind,
balancer in-flight counts, sandbox bookkeeping in Redis, and the memory of every process
over the run (sampled, so growth can be told from a one-off peak), and what the model
servers' prefix caches hold at the end (most of their growth)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
import psutil
import redis.asyncio as aioredis

from chaos.cluster import LocalCluster
from rollstream.llm.balancer import list_backends

log = logging.getLogger(__name__)


@dataclass
class Leaks:
    supervisors: int
    bwrap_processes: int
    node_sandbox_entries: int
    backend_in_flight: dict[str, int]
    mounts: int = 0

    @property
    def ok(self) -> bool:
        return not (self.supervisors or self.bwrap_processes or self.node_sandbox_entries or self.mounts
                    or any(self.backend_in_flight.values()))


def _mounts_under(root: str) -> int:
    """Host mounts (e.g. a size-limited workdir) left under the sandbox root."""
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4].startswith(root))


def _bwrap_under(root: str) -> int:
    count = 0
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if proc.info["name"] == "bwrap" and proc.info["status"] != psutil.STATUS_ZOMBIE \
                    and any(root in arg for arg in proc.info["cmdline"] or []):
                count += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return count


async def leaks(cluster: LocalCluster, r: aioredis.Redis, settle_s: float = 30.0) -> Leaks:
    """Leaks after the run, waiting up to ``settle_s`` for reapers and lease expiry to do
    their work (a sandbox whose worker died is reaped on the reaper's next pass)."""
    root = str(cluster.cfg.data_dir / "sandboxes")
    deadline = time.monotonic() + settle_s
    while True:
        sets = 0
        for node in cluster.cfg.nodes:
            sets += await r.scard(cluster.keys.node_sandboxes(node))
        backends = {b.url: b.in_flight for b in await list_backends(r, cluster.cfg.namespace)}
        found = Leaks(supervisors=len(cluster.supervisors()), bwrap_processes=_bwrap_under(root),
                      node_sandbox_entries=sets, backend_in_flight=backends, mounts=_mounts_under(root))
        if found.ok or time.monotonic() > deadline:
            return found
        await asyncio.sleep(1.0)


@dataclass
class MemorySampler:
    """RSS of every named process, sampled every ``period_s``; restarted processes count as new."""

    period_s: float = 2.0
    samples: dict[str, list[float]] = field(default_factory=dict)

    async def run(self, cluster: LocalCluster, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for name, pid in cluster.processes().items():
                try:
                    rss = psutil.Process(pid).memory_info().rss / 2**20
                except psutil.NoSuchProcess:
                    continue
                self.samples.setdefault(f"{name}@{pid}", []).append(rss)
            try:
                await asyncio.wait_for(stop.wait(), self.period_s)
            except TimeoutError:
                pass

    def growth(self) -> dict[str, tuple[float, float, float]]:
        """Per kind of process (redis, api, model-server, init/run/eval workers): median over its
        processes of (RSS after warm-up, RSS at the end, peak), in MiB. Processes that lived for
        fewer than 4 samples (killed by a fault) are left out."""
        by_kind: dict[str, list[tuple[float, float, float]]] = {}
        for name, values in self.samples.items():
            if len(values) < 4:
                continue
            kind = name.split("@")[0]
            kind = kind.split(":")[1] if kind.count(":") == 2 else kind.split(":")[0]
            warm = values[len(values) // 4]
            by_kind.setdefault(kind, []).append((warm, values[-1], max(values)))
        out = {}
        for kind, rows in by_kind.items():
            rows.sort()
            out[kind] = rows[len(rows) // 2]
        return out


async def prefix_cache_mib(cluster: LocalCluster) -> list[float]:
    """MiB each live model server's prefix cache holds (its /v1/engine_stats)."""
    out = []
    async with httpx.AsyncClient(timeout=10.0) as http:
        for server in cluster.servers:
            try:
                stats = (await http.get(f"{server.url}/v1/engine_stats")).json()
            except httpx.HTTPError as exc:
                log.warning("engine stats of %s not read: %s", server.url, exc)
                continue
            out.append(round(stats["prefix_cache"]["bytes"] / 2**20, 1))
    return out
