"""LLM rollouts through the whole system: Redis streams, init/run/eval worker processes,
bubblewrap sandboxes with a real bash, the built-in server, the Lua balancer."""

from __future__ import annotations

import asyncio

import httpx

from rollstream.client import AsyncClient
from rollstream.llm.balancer import add_backend, list_backends
from rollstream.sandboxes import live_supervisors
from rollstream.tasks import arith


async def test_arith_groups_roll_out_with_tools_in_sandboxes_and_token_exact_trajectories(
        settings, worker_pool, arith_model_dir, arith_server, sandbox_root, tmp_path):
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        pool.start_all(concurrency=8)
        instances = arith.make_instances(3, seed=7)
        for inst in instances:
            await client.submit_group(arith.job(inst), 4)
        results = await client.collect(12, timeout_s=240)
        backends = await list_backends(client.r, settings.namespace)
    async with httpx.AsyncClient() as http:
        version = (await http.get(f"{arith_server}/v1/policy_version")).json()

    assert all(r.status == "completed" for r in results), [r.error for r in results if not r.ok]
    for r in results:
        t = r.trajectory
        assert t.prompt_ids and len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
        assert all(lp <= 0.0 for lp in t.logprobs)
        assert t.backend == arith_server and r.reward in (0.0, 1.0)
        assert t.policy_version == version.get("policy_version", 0)
    # The warmed-up model calls the bash tool: the observations came from a real sandbox.
    bash_calls = [c for r in results for c in r.trajectory.tool_calls if c.name == "bash"]
    assert bash_calls and any(c.ok for c in bash_calls)
    assert any(0 in r.trajectory.loss_mask for r in results)
    assert all(b.in_flight == 0 for b in backends)
    # Every sandbox was destroyed by eval: no supervisor process is left.
    await asyncio.sleep(0.5)
    assert live_supervisors(sandbox_root) == []
