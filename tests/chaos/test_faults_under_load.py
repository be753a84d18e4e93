"""Faults injected while load runs through the Python client and the HTTP API at once: each
phase's jobs all yield exactly one result, failures and dead letters carry their reasons and
come only from exhausted retries, and no sandbox, process, mount, sandbox-set entry or
backend lease is left behind. One deployment serves every phase, in order; the node
cancellation comes last because that node stays down. ``python bench/soak.py`` runs the
same phases at full scale."""

from __future__ import annotations

import asyncio
import random

import pytest

from chaos.cluster import ClusterConfig, LocalCluster
from chaos.diskfull import cannot_mount
from chaos.faults import FAULTS
from chaos.soak import run_phase

PHASES = ["none", *FAULTS]  # FAULTS ends with cancel-node
ECHO_PER_PHASE, LLM_PER_PHASE = 300, 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, arith_model_dir):
    """Processes only (nothing bound to an event loop), so each test's loop can drive it."""
    # Redis on a small tmpfs where one can be mounted (root), so the full-disk phase fills it for real.
    cfg = ClusterConfig(data_dir=tmp_path_factory.mktemp("chaos"), concurrency=32, model_dir=arith_model_dir,
                        redis_disk_mb=64 if cannot_mount() is None else None)
    deployment = LocalCluster(cfg)
    asyncio.run(deployment.start())
    yield deployment
    asyncio.run(deployment.stop())


@pytest.fixture(scope="module")
def rng():
    return random.Random(7)


@pytest.mark.parametrize("fault", PHASES)
async def test_nothing_lost_doubled_or_leaked_under_fault(cluster, rng, fault):
    phase = await run_phase(cluster, fault, echo_n=ECHO_PER_PHASE, llm_n=LLM_PER_PHASE, rng=rng, timeout_s=240)
    v = phase.verdict
    assert v.submitted == ECHO_PER_PHASE + LLM_PER_PHASE
    assert not v.lost, f"{fault} ({phase.action}): {len(v.lost)} jobs never got a result: {v.lost[:5]}"
    assert not v.doubled and not v.unexpected, f"{fault}: doubled {v.doubled[:5]}"
    assert not v.reasonless_failures, f"{fault}: failed without a reason: {v.reasonless_failures[:5]}"
    assert not v.dead_letters_unexplained and not v.dead_letters_early, \
        f"{fault}: dead letters before retries ran out: {v.dead_letters_early[:5]}"
    assert phase.leaks.ok, f"{fault}: left behind {phase.leaks}"
    assert phase.workers_lost == 0, f"{fault} ({phase.action})"
