"""A real third-party harness, unmodified, through the door and the whole pipeline: the
OpenAI Agents SDK (``openai-agents``) runs arith jobs and a SWE-style job with the small
built-in model, its tool calls run in each job's sandbox, eval scores what it did, and every
id of the result's trajectory is what the backend produced (asked again, greedily). The small
model does not solve the tasks: the test proves the plumbing."""

from __future__ import annotations

import pytest

pytest.importorskip("agents", reason="the harness extra: pip install rollstream[harness]")

from rollstream.client import AsyncClient  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.llm.inference_client import SamplingParams, VLLMClient  # noqa: E402
from rollstream.tasks import arith  # noqa: E402
from rollstream.tasks.swe import load_instances  # noqa: E402


async def test_openai_agents_sdk_runs_arith_and_swe_jobs_through_the_door_end_to_end(
        settings, worker_pool, arith_model_dir, arith_server, sandbox_root, tmp_path):
    pool = worker_pool(model_dir=arith_model_dir, sandbox_root=sandbox_root)
    pool.start_all(concurrency=4)
    greedy = {"temperature": 0.0, "max_tokens": 48}
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, arith_server, settings.namespace)
        job = arith.job({"a": 21, "op": "+", "b": 34}, sampling=greedy,
                        agent={**arith.SMALL_MODEL_AGENT, "harness": "openai-agents"})
        await client.submit_group(job, 2)
        swe = {**load_instances()[0], "repo_mirror": str(tmp_path / "swe-mirror")}
        await client.submit({"task": "swe", "instance": swe, "sampling": greedy,
                             "agent": {"harness": "openai-agents", "max_turns": 2, "max_tokens_per_turn": 48,
                                       "max_context_tokens": 2048}})
        results = await client.collect(3, timeout_s=300)
    assert sorted(r.task for r in results) == ["arith", "arith", "swe"]

    from transformers import AutoTokenizer

    end_of_turn = AutoTokenizer.from_pretrained(arith_model_dir).eos_token_id  # what the door stops on
    backend = VLLMClient()
    try:
        for result in results:
            assert result.status == "completed", result.error
            traj = result.trajectory
            assert traj.extra["harness"] == "openai-agents" and traj.extra["calls"] and traj.segments
            assert result.reward is not None and "reason" in traj.extra["eval"]
            assert traj.finish_reason in ("stop", "max_turns", "harness_error")
            if result.task == "arith":
                assert "answer" in traj.extra  # what the harness returned, as eval scored it
                assert all(call.name == "bash" for call in traj.tool_calls)  # they ran in the sandbox
            for call in traj.extra["calls"]:
                seg = traj.segments[call["segment"]]
                sequence = seg.prompt_ids + seg.response_ids
                prompt, start = sequence[:call["prompt_tokens"]], call["prompt_tokens"] - len(seg.prompt_ids)
                recorded = seg.response_ids[start:start + call["completion_tokens"]]
                assert recorded and seg.loss_mask[start:start + len(recorded)] == [1] * len(recorded)
                # The recording ends where the door's rules end a turn: at its first end-of-turn
                # token, or cut by the token budget.
                assert end_of_turn not in recorded[:-1]
                assert recorded[-1] == end_of_turn or call["finish_reason"] == "length"
                # Asked again greedily for exactly as many tokens, nothing stopping it early (EOS
                # ignored), the backend writes the same ids.
                again = await backend.generate(arith_server, prompt, SamplingParams(
                    temperature=0.0, max_tokens=len(recorded), ignore_eos=True))
                assert again.token_ids == recorded
    finally:
        await backend.aclose()
