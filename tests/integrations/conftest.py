"""A harness that makes several exact segments in one job, installed as an operator installs one
(a package on the workers' path with a ``rollstream.harnesses`` entry point): it asks once, then
compacts its history into a summary and asks again, as coding CLIs do when their context fills,
so each job's trajectory has two segments. The TRL and verl tests train on such jobs."""

from __future__ import annotations

import textwrap

import pytest

COMPACTING_HARNESS = textwrap.dedent('''
    """A harness that compacts its history between its two calls."""
    from openai import AsyncOpenAI


    async def compacting(ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        try:
            first = await client.chat.completions.create(model=ctx.model, messages=ctx.messages)
            said = (first.choices[0].message.content or "")[:120]
            # The history is rewritten (a summary replaces it): the door starts a new segment.
            summary = [*[m for m in ctx.messages if m["role"] == "system"],
                       {"role": "user", "content": "Summary of the work so far: " + said + "\\nGive the answer."}]
            second = await client.chat.completions.create(model=ctx.model, messages=summary)
            return second.choices[0].message.content or ""
        finally:
            await client.close()
''')



@pytest.fixture
def compacting_agent() -> dict:
    """A job's ``agent`` settings that run the ``compacting`` harness on the arith model."""
    return {"harness": "compacting", "max_turns": 3, "max_tokens_per_turn": 32, "max_context_tokens": 1024}


@pytest.fixture
def compacting_pool(worker_pool, arith_model_dir, sandbox_root, tmp_path):
    """Worker pools (not started) that can run the ``compacting`` harness."""
    site = tmp_path / "site"
    info = site / "rs_compacting_harness-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "rs_compacting_harness.py").write_text(COMPACTING_HARNESS)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rs-compacting-harness\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rollstream.harnesses]\ncompacting = rs_compacting_harness:compacting\n")
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    pool.env["PYTHONPATH"] = str(site)
    return pool
