"""A harness's own conduct is the agent's, never the service's, through the whole pipeline with
real workers: a harness that calls past its job's budget (the openai SDK with its default
retries) gets one permanent refusal, not a rate limit to retry, and its job ends once, scored,
failure "agent"; a harness that waits on its model longer than its sandbox's idle timeout still
finds its sandbox (the run stage keeps it alive), where it used to be reaped, the job counted
an infrastructure failure and restarted. The harnesses are installed as an operator installs
one: a package on the workers' path with a ``rollstream.harnesses`` entry point."""

from __future__ import annotations

import textwrap

import pytest

from rollstream.client import AsyncClient
from rollstream.llm.balancer import add_backend
from rollstream.tasks import arith

HARNESSES = textwrap.dedent('''
    """Harnesses of tests/harness/test_harness_limits_in_the_pipeline.py."""
    import asyncio

    from openai import AsyncOpenAI


    async def over_budget(ctx):
        """Calls the door once more than the job allows, as an SDK user would (default retries)."""
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        try:
            for _ in range(ctx.settings.max_turns + 1):
                await client.chat.completions.create(model=ctx.model, messages=ctx.messages, tools=ctx.tools)
        finally:
            await client.close()


    async def thinks_long(ctx):
        """Waits (as on a slow model) longer than the sandbox's idle timeout, then uses the sandbox."""
        await asyncio.sleep(float(ctx.instance["think_s"]))
        return await ctx.call_tool("bash", {"command": "echo still-here"})
''')


@pytest.fixture
def harness_path(tmp_path):
    """A folder holding an installed harness package (module + dist-info with its entry points)."""
    folder = tmp_path / "site"
    (folder / "rs_limit_harnesses-1.0.dist-info").mkdir(parents=True)
    (folder / "rs_limit_harnesses.py").write_text(HARNESSES)
    (folder / "rs_limit_harnesses-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rs-limit-harnesses\nVersion: 1.0\n")
    (folder / "rs_limit_harnesses-1.0.dist-info" / "entry_points.txt").write_text(
        "[rollstream.harnesses]\nover-budget = rs_limit_harnesses:over_budget\n"
        "thinks-long = rs_limit_harnesses:thinks_long\n")
    return str(folder)


@pytest.fixture
def pool(worker_pool, arith_model_dir, sandbox_root, harness_path):
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    pool.env["PYTHONPATH"] = harness_path
    pool.start_all(concurrency=4)
    return pool


async def test_a_harness_calling_past_its_budget_is_refused_once_and_its_job_is_scored_as_the_agents(
        settings, pool, arith_server):
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        job_id = await client.submit(arith.job({"a": 2, "op": "+", "b": 3},
                                               agent={**arith.SMALL_MODEL_AGENT, "harness": "over-budget",
                                                      "max_turns": 2}))
        [result] = await client.collect(1, timeout_s=240)
        state = await client.status(job_id)
    assert result.status == "completed" and result.failure == "agent", result.error
    assert result.reward is not None and "reason" in result.trajectory.extra["eval"]  # scored
    assert result.attempts == 1 and state.attempts <= 1 and state.status == "completed"  # never restarted
    traj = result.trajectory
    assert traj.finish_reason == "max_turns"
    # Two calls served, then one refusal the SDK did not retry.
    assert len(traj.extra["calls"]) == 2
    assert traj.extra["door"] == {"requests": 3, "refused": 1}


async def test_a_harness_idle_longer_than_its_sandboxs_idle_timeout_keeps_its_sandbox(settings, pool, arith_server):
    idle_timeout_s = 2.0
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        sandbox = {"limits": {"idle_timeout_s": idle_timeout_s}}
        # A first job warms the workers, so the second's stage hops are as quick as in service.
        await client.submit(arith.job({"a": 1, "op": "+", "b": 1, "think_s": 0},
                                      agent={"harness": "thinks-long"}, sandbox=sandbox))
        [warm] = await client.collect(1, timeout_s=240)
        job_id = await client.submit(arith.job({"a": 1, "op": "+", "b": 2, "think_s": 4 * idle_timeout_s},
                                               agent={"harness": "thinks-long"}, sandbox=sandbox))
        [result] = await client.collect(1, timeout_s=240)
        state = await client.status(job_id)
    assert warm.status == "completed", warm.error
    assert result.status == "completed", result.error
    assert result.attempts == 1 and state.attempts <= 1
    traj = result.trajectory
    assert traj.extra["answer"].strip() == "still-here"
    assert [(call.name, call.ok) for call in traj.tool_calls] == [("bash", True)]
