"""A weight sync pauses generation across the backends: arith rollouts run through the whole
pipeline against two built-in servers while the trainer publishes a new policy; no model turn
starts or runs while the servers load, both serve the new policy from the same moment, and every
turn's policy version is the one that produced it."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from rollstream.client import AsyncClient
from rollstream.llm.balancer import Balancer, add_backend
from rollstream.llm.server import served_model
from rollstream.tasks import arith
from rollstream.trainer.weight_sync import BuiltinServerBackend, WeightPublisher


class WatchedLoad(BuiltinServerBackend):
    """The real built-in server's load, with what the balancer says at its start and end."""

    def __init__(self, url: str, balancer: Balancer, seen: list):
        super().__init__(url)
        self.balancer, self.seen = balancer, seen

    async def _turns(self) -> tuple[int, int, bool]:
        started = int(await self.balancer.redis.get(self.balancer.keys.lease_seq) or 0)
        return started, sum((await self.balancer.in_flight()).values()), await self.balancer.paused() is not None

    async def load(self, client: httpx.AsyncClient, weights_dir: Path, policy_version: int) -> None:
        before = await self._turns()
        await super().load(client, weights_dir, policy_version)
        self.seen.append((before, await self._turns()))


async def test_a_weight_sync_pauses_every_backend_and_each_turn_keeps_its_exact_version(
        settings, worker_pool, arith_model_dir, sandbox_root, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(arith_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(arith_model_dir))
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    with contextlib.ExitStack() as servers:
        # Both servers start at once: each spends seconds importing torch and loading the model.
        with ThreadPoolExecutor(2) as starting:
            started = [starting.submit(servers.enter_context, served_model(arith_model_dir, device="cpu"))
                       for _ in range(2)]
        first, second = (future.result() for future in started)
        async with AsyncClient(settings=settings) as client:
            for url in (first, second):
                await add_backend(client.r, url, settings.namespace)
            balancer = Balancer(client.r, namespace=settings.namespace)
            seen: list = []
            publisher = WeightPublisher(tmp_path / "weights", [WatchedLoad(u, balancer, seen) for u in (first, second)],
                                        redis=client.r, namespace=settings.namespace)
            pool.start_all(concurrency=8)
            jobs = [arith.job(i) for i in arith.make_instances(24, seed=5)]
            job_ids = [str(j) for j in await client.submit_many(jobs)]
            while int(await client.r.get(balancer.keys.lease_seq) or 0) < 6:  # turns are under way
                await asyncio.sleep(0.05)
            await publisher.publish(model, tokenizer, policy_version=1)
            assert await balancer.paused() is None  # resumed
            results = await client.collect(len(job_ids), timeout_s=300)

    assert sorted(r.job_id for r in results) == sorted(job_ids)
    assert all(r.status == "completed" for r in results), [r.error for r in results if not r.ok]
    # While each server loaded: generation paused, nothing in flight, and no turn started.
    assert len(seen) == 2
    for (seq_before, in_flight_before, paused_before), (seq_after, in_flight_after, paused_after) in seen:
        assert paused_before and paused_after and in_flight_before == in_flight_after == 0
        assert seq_before == seq_after
    # Every turn ran whole under one policy: versions never go back within a job, and a job's
    # turns after the sync are all the new policy's.
    versions = [r.trajectory.extra.get("policy_versions") or [r.trajectory.policy_version] for r in results]
    assert all(v == sorted(v) and set(v) <= {0, 1} for v in versions)
    assert any(1 in v for v in versions) and any(0 in v for v in versions)
