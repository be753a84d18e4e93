"""A soak run: load through the Python client and the HTTP API at once, in phases, one fault
injected in each phase while its jobs are in flight, and after each phase the verdict
(nothing lost, nothing doubled, failures and dead letters with reasons) and the leak probes."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from chaos.cluster import LocalCluster
from chaos.faults import FAULTS
from chaos.ledger import Ledger, Verdict, read_dead_letters
from chaos.load import HttpLoad, PythonLoad, arith_jobs, echo_jobs
from chaos.probes import Leaks, MemorySampler, leaks, prefix_cache_mib
from rollstream.config import Settings
from rollstream.pipeline.connection import async_redis

log = logging.getLogger(__name__)


@dataclass
class PhaseReport:
    fault: str
    action: str
    echo_jobs: int
    llm_jobs: int
    verdict: Verdict
    leaks: Leaks
    elapsed_s: float
    client_retries: int
    workers_lost: int = 0  # died under a fault that must kill none (full-disk)

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.leaks.ok and self.workers_lost == 0


@dataclass
class SoakReport:
    phases: list[PhaseReport] = field(default_factory=list)
    memory: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    worker_restarts: int = 0
    # MiB each model server's prefix cache held at the end: bounded by the cache's budget
    # (1 GiB by default). With the working memory of the first batches, that is what a model
    # server's memory grows by (bench/README.md).
    prefix_cache_mib: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.phases)


def _interleave(a: list[dict], b: list[dict], rng: random.Random) -> list[dict]:
    jobs = a + b
    rng.shuffle(jobs)
    return jobs


async def _keep_workers_alive(cluster: LocalCluster, stop: asyncio.Event) -> None:
    while not stop.is_set():
        cluster.restart_dead_workers()
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def run_phase(cluster: LocalCluster, fault: str, *, echo_n: int, llm_n: int, rng: random.Random,
                    timeout_s: float) -> PhaseReport:
    """``echo_n`` echo and ``llm_n`` arith jobs, half through each door; ``fault`` ("none" for a
    baseline) is injected once a tenth of the phase's results are in. Dead workers of nodes in
    service are restarted meanwhile, as a process supervisor would."""
    t0 = time.monotonic()
    settings = Settings(redis_url=cluster.redis_url, namespace=cluster.cfg.namespace,
                        data_dir=cluster.cfg.data_dir / "client")
    ledger = Ledger()
    tag = f"{fault}-{rng.randrange(10**6)}"
    py = PythonLoad(settings, ledger, submitter=f"soak-py-{tag}", chunk=100)
    http = HttpLoad(cluster.api_url, cluster.cfg.api_token, ledger, submitter=f"soak-http-{tag}", chunk=100)
    half_e, half_l = echo_n // 2, llm_n // 2
    py_jobs = _interleave(echo_jobs(half_e, f"py-{tag}"),
                          arith_jobs(half_l, f"py-{tag}", seed=rng.randrange(10**6)), rng)
    http_jobs = _interleave(echo_jobs(echo_n - half_e, f"http-{tag}"),
                            arith_jobs(llm_n - half_l, f"http-{tag}", seed=rng.randrange(10**6)), rng)
    deadline = time.monotonic() + timeout_s
    stop = asyncio.Event()
    keeper = asyncio.create_task(_keep_workers_alive(cluster, stop))
    # Paced over a few seconds so that the fault finds work in every stage.
    loads = [asyncio.create_task(py.run(py_jobs, deadline=deadline, pace_s=0.1)),
             asyncio.create_task(http.run(http_jobs, deadline=deadline, pace_s=0.1))]
    action = "none"
    lost_before = cluster.workers_lost
    if fault != "none":
        total = echo_n + llm_n
        while sum(1 for n in ledger.received.values() if n) < max(1, total // 10) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        action = await FAULTS[fault](cluster, rng)
        log.info("fault %s: %s", fault, action)
    try:
        await asyncio.gather(*loads)
    finally:
        stop.set()
        await keeper
    if fault == "cancel-node":
        reaped = await asyncio.to_thread(cluster.reap_cancelled_nodes)
        action += f"; its {len(reaped)} dead sandboxes reaped as on the node's next start"
    r = async_redis(cluster.redis_url)
    try:
        verdict = ledger.verdict(await read_dead_letters(r, cluster.keys), cluster.cfg.timeouts["max_deliveries"])
        found = await leaks(cluster, r)
    finally:
        await r.aclose()
    return PhaseReport(fault=fault, action=action, echo_jobs=echo_n, llm_jobs=llm_n, verdict=verdict, leaks=found,
                       elapsed_s=time.monotonic() - t0, client_retries=py.retries + http.retries,
                       workers_lost=cluster.workers_lost - lost_before)


async def run_soak(cluster: LocalCluster, faults: list[str], *, echo_total: int, llm_total: int,
                   seed: int = 0, phase_timeout_s: float = 600.0) -> SoakReport:
    """One phase per fault (plus a baseline first), the load split evenly over the phases."""
    phases = ["none", *faults]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; choose from {sorted(FAULTS)}")
    rng = random.Random(seed)
    report = SoakReport()
    stop = asyncio.Event()
    sampler = MemorySampler()
    background = [asyncio.create_task(sampler.run(cluster, stop))]
    try:
        for i, fault in enumerate(phases):
            echo_n = echo_total // len(phases) + (1 if i < echo_total % len(phases) else 0)
            llm_n = llm_total // len(phases) + (1 if i < llm_total % len(phases) else 0)
            phase = await run_phase(cluster, fault, echo_n=echo_n, llm_n=llm_n, rng=rng, timeout_s=phase_timeout_s)
            log.info("phase %s: %s; failures %s; early dead letters %s; %s", fault, phase.verdict.summary(),
                     dict(phase.verdict.failure_reasons), phase.verdict.dead_letters_early[:5], phase.leaks)
            report.phases.append(phase)
    finally:
        stop.set()
        await asyncio.gather(*background, return_exceptions=True)
    report.memory = sampler.growth()
    report.worker_restarts = cluster.restarts
    report.prefix_cache_mib = await prefix_cache_mib(cluster)
    return report
