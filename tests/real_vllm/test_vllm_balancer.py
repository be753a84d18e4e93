"""The Redis balancer with a real vLLM and the built-in server side by side: episodes spread
over both, each trajectory exact whichever served it; vLLM SIGKILLed mid-batch: its turns
finish on the built-in server, and stopping it leaves no EngineCore behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from redis.asyncio import Redis

from rollstream.agent.episode import run_agent
from rollstream.episode_settings import AgentSettings
from rollstream.llm import SamplingParams, VLLMClient
from rollstream.llm.balancer import Balancer
from rollstream.llm.session import LLMSession
from rollstream.tasks import arith

from .refs import arith_tools, trajectory_logprob_error
from .vllm_process import MAX_MODEL_LEN


def settings(seed: int) -> AgentSettings:
    return AgentSettings(max_turns=3, max_tokens_per_turn=48, max_context_tokens=MAX_MODEL_LEN,
                         sampling=SamplingParams(temperature=1.0, seed=seed))


async def balanced(redis_url, namespace, *urls) -> tuple[Redis, Balancer]:
    redis = Redis.from_url(redis_url)
    balancer = Balancer(redis, namespace=namespace)
    for url in urls:
        await balancer.register(url)
    return redis, balancer


async def test_episodes_spread_over_vllm_and_the_builtin_server_with_exact_trajectories(
        vllm_url, builtin_url, redis_url, namespace, tokenizer, reference_model):
    redis, balancer = await balanced(redis_url, namespace, vllm_url, builtin_url)
    client = VLLMClient()  # one pooled client for every backend, as in a run worker
    instances = arith.make_instances(6, seed=21)
    sessions = [LLMSession(client, f"job-{i}", group_id=f"group-{i}", balancer=balancer) for i in range(len(instances))]
    trajectories = await asyncio.gather(*[
        run_agent(arith.prompt(inst), arith_tools(), session, settings(i), tokenizer)
        for i, (inst, session) in enumerate(zip(instances, sessions))])
    assert {t.backend for t in trajectories} == {vllm_url, builtin_url}
    for traj, session in zip(trajectories, sessions):
        assert traj.finish_reason in ("stop", "max_turns"), traj.extra
        assert session.backends_used == [traj.backend], "a job keeps its backend across turns"
        assert trajectory_logprob_error(reference_model, traj) < 1e-3
    assert all(b.in_flight == 0 for b in await balancer.backends())
    await client.aclose()
    await redis.aclose()


@pytest.mark.kills_vllm
async def test_vllm_sigkilled_mid_batch_turns_finish_elsewhere_and_its_engine_is_cleaned_up(
        vllm_server, builtin_url, redis_url, namespace, tokenizer, reference_model):
    vllm_url = vllm_server.url
    redis, balancer = await balanced(redis_url, namespace, vllm_url, builtin_url)
    client = VLLMClient()
    instances = arith.make_instances(8, seed=33)
    sessions = [LLMSession(client, f"job-{i}", group_id=f"group-{i}", balancer=balancer) for i in range(len(instances))]
    # Long turns (the model does not end them), so that requests are in flight when vLLM dies.
    long_turns = [settings(i).model_copy(update={"max_tokens_per_turn": 200, "sampling": SamplingParams(
        temperature=1.0, seed=i, ignore_eos=True, stop_token_ids=[])}) for i in range(len(instances))]
    batch = asyncio.gather(*[
        run_agent(arith.prompt(inst), arith_tools(), session, s, tokenizer)
        for inst, session, s in zip(instances, sessions, long_turns)])
    deadline = time.monotonic() + 120
    while (await balancer.in_flight()).get(vllm_url, 0) < 2:
        assert time.monotonic() < deadline, "no request reached vLLM"
        await asyncio.sleep(0.05)
    engine = vllm_server.engine_pids()
    assert engine, "vLLM runs its engine in processes of its own"
    os.kill(vllm_server.proc.pid, signal.SIGKILL)

    trajectories = await batch
    moved = [s for s in sessions if s.backends_used == [vllm_url, builtin_url]]
    assert moved and all(s.failures for s in moved), [s.backends_used for s in sessions]
    for traj in trajectories:
        assert traj.finish_reason in ("stop", "max_turns"), traj.extra
        assert trajectory_logprob_error(reference_model, traj) < 1e-3
    assert [b.url for b in await balancer.backends() if not b.healthy] == [vllm_url]

    # The API server is gone, its EngineCore and worker are not (vLLM 0.32): stopping the
    # process group must leave nothing behind.
    vllm_server.proc.wait(timeout=30)
    vllm_server.stop()
    assert vllm_server.group_pids() == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{vllm_url}/health", timeout=2)
    await client.aclose()
    await redis.aclose()
