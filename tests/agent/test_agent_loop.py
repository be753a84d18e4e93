"""The agent loop against real built-in servers and a tiny model trained to call tools:
token-exact trajectories, loss masks, malformed calls, limits, and a backend killed mid-run."""

from __future__ import annotations

import asyncio
import os
import signal

import torch
from redis.asyncio import Redis

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.episode import run_agent
from rollstream.agent.tools import FunctionToolBox
from rollstream.episode_settings import AgentSettings
from rollstream.llm.balancer import Balancer
from rollstream.llm.inference_client import SamplingParams
from rollstream.llm.session import LLMSession

from .scripted_model import ADD_QUESTION, BROKEN_QUESTION, CALCULATOR, TOOLS, prompt, scripts

GREEDY = AgentSettings(max_turns=4, max_tokens_per_turn=64, sampling=SamplingParams(temperature=0.0))


@torch.inference_mode()
def recompute_logprobs(model, ids: list[int], start: int) -> list[float]:
    """log-softmax of fp32 logits for ids[start:], from one forward pass over all ids."""
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids))]


def generated_segments(traj) -> list[list[int]]:
    segments, current = [], []
    for token, mask in zip(traj.response_ids, traj.loss_mask):
        if mask:
            current.append(token)
        elif current:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    return segments


def assert_token_exact(traj, client, model) -> None:
    # Every masked-in token is the server's, in order; nothing else is masked in.
    assert generated_segments(traj) == [g.token_ids for g in client.generations]
    served = [lp for g in client.generations for lp in g.logprobs]
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m] == served
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)
    # And the model itself agrees with those logprobs on the trajectory's own ids.
    ids = traj.prompt_ids + traj.response_ids
    recomputed = recompute_logprobs(model, ids, len(traj.prompt_ids))
    diffs = [abs(a - b) for a, b, m in zip(recomputed, traj.logprobs, traj.loss_mask) if m]
    assert max(diffs) < 1e-4


async def test_tool_episode_keeps_server_ids_and_masks_observations(
    model_server, client, calculator, tokenizer, reference_model
):
    llm = LLMSession(client, "job-add", backend_url=model_server)
    traj = await run_agent(prompt(ADD_QUESTION), calculator, llm, GREEDY, tokenizer)

    assert traj.finish_reason == "stop" and traj.extra["answer"] == "42"
    assert [(c.name, c.arguments, c.ok) for c in traj.tool_calls] == [
        ("calculator", {"expression": "12 + 30"}, True),
        ("submit", {"answer": "42"}, True),
    ]
    assert traj.tool_calls[0].duration_ms > 0
    assert traj.num_turns == 2 and traj.backend == model_server
    assert_token_exact(traj, client, reference_model)
    # Observation tokens (mask 0) are exactly what the chat template adds for the tool turn.
    observation = [t for t, m in zip(traj.response_ids, traj.loss_mask) if not m]
    expected = tokenizer.decode(observation, skip_special_tokens=False)
    assert expected == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # The whole context reads as the template's rendering of the conversation.
    renderer = ChatRenderer(tokenizer, TOOLS)
    text = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert text + "\n" == renderer.render(scripts()[0], add_generation_prompt=False)
    assert set(traj.timings_s) >= {"llm_s", "tools_s", "total_s"}


async def test_sampled_episode_is_token_exact(model_server, client, calculator, tokenizer, reference_model):
    # Temperature 1 on a prompt the model never saw: arbitrary text, often no tool call.
    settings = AgentSettings(
        max_turns=3, max_tokens_per_turn=24, sampling=SamplingParams(temperature=1.0, seed=7)
    )
    llm = LLMSession(client, "job-sampled", backend_url=model_server)
    traj = await run_agent(prompt("Tell me a story about a fox."), calculator, llm, settings, tokenizer)

    assert traj.finish_reason in ("stop", "max_turns")
    assert len(client.generations) == traj.num_turns >= 1
    assert_token_exact(traj, client, reference_model)
    assert traj.num_generated_tokens == sum(len(g.token_ids) for g in client.generations)


async def test_malformed_tool_call_gets_an_error_observation(
    model_server, client, calculator, tokenizer, reference_model
):
    llm = LLMSession(client, "job-broken", backend_url=model_server)
    traj = await run_agent(prompt(BROKEN_QUESTION), calculator, llm, GREEDY, tokenizer)

    first = traj.tool_calls[0]
    assert first.name == "<malformed>" and not first.ok and "not valid JSON" in first.error
    tool_messages = [m for m in traj.messages if m.role == "tool"]
    assert tool_messages[0].content.startswith("Error: could not parse tool call")
    assert traj.finish_reason == "stop" and traj.extra["answer"] == "42"
    assert_token_exact(traj, client, reference_model)


async def test_turn_limit_ends_with_max_turns(model_server, client, tokenizer):
    looping = FunctionToolBox().add(CALCULATOR, lambda expression: "42")
    settings = GREEDY.model_copy(update={"max_turns": 1})
    llm = LLMSession(client, "job-turns", backend_url=model_server)
    traj = await run_agent(prompt(ADD_QUESTION), looping, llm, settings, tokenizer)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 1


async def test_context_limit_ends_with_context(model_server, client, calculator, tokenizer):
    llm = LLMSession(client, "job-context", backend_url=model_server)
    prompt_len = len(ChatRenderer(tokenizer, TOOLS).prompt_ids(prompt(ADD_QUESTION)))
    settings = GREEDY.model_copy(update={"max_context_tokens": prompt_len + 30})
    traj = await run_agent(prompt(ADD_QUESTION), calculator, llm, settings, tokenizer)
    assert traj.finish_reason == "context"
    assert len(traj.prompt_ids) + len(traj.response_ids) <= prompt_len + 30


async def test_cancel_flag_ends_the_episode_between_turns(model_server, client, calculator, tokenizer):
    checks = 0

    async def cancelled() -> bool:
        nonlocal checks
        checks += 1
        return checks > 1  # cancelled after the first turn started

    llm = LLMSession(client, "job-cancel", backend_url=model_server)
    traj = await run_agent(prompt(ADD_QUESTION), calculator, llm, GREEDY, tokenizer, cancelled)
    assert traj.finish_reason == "cancelled" and traj.num_turns == 1


async def test_slow_tool_ends_with_timeout(model_server, client, tokenizer):
    async def slow(expression: str) -> str:
        await asyncio.sleep(30)
        return "42"

    tools = FunctionToolBox().add(CALCULATOR, slow)
    settings = GREEDY.model_copy(update={"max_wall_time_s": 2.0})
    llm = LLMSession(client, "job-slow", backend_url=model_server)
    traj = await run_agent(prompt(ADD_QUESTION), tools, llm, settings, tokenizer)
    assert traj.finish_reason == "timeout"
    assert traj.tool_calls[0].error == "timeout"


async def test_no_backend_ends_with_error(redis_url, client, calculator, tokenizer):
    redis = Redis.from_url(redis_url)
    balancer = Balancer(redis, namespace=f"empty{os.getpid()}")
    llm = LLMSession(client, "job-none", balancer=balancer, backend_wait_s=1.0)  # the wait is tested elsewhere
    traj = await run_agent(prompt(ADD_QUESTION), calculator, llm, GREEDY, tokenizer)
    assert traj.finish_reason == "error" and "backends add" in traj.extra["finish_detail"]
    await redis.aclose()


async def test_backend_killed_mid_run_the_job_finishes_on_another(
    two_servers, redis_url, client, tokenizer, reference_model
):
    redis = Redis.from_url(redis_url)
    balancer = Balancer(redis, namespace=f"kill{os.getpid()}")
    processes = {}
    for proc, url in two_servers:
        await balancer.register(url)
        processes[url] = proc
    llm = LLMSession(client, "job-kill", group_id="g", balancer=balancer)
    killed = []

    def calculate_then_kill(expression: str) -> str:
        # Between the job's turns: its backend dies (SIGKILL, no goodbye).
        victim = llm.backend
        os.killpg(processes[victim].pid, signal.SIGKILL)
        processes[victim].wait()
        killed.append(victim)
        return "42"

    tools = FunctionToolBox().add(CALCULATOR, calculate_then_kill)
    traj = await run_agent(prompt(ADD_QUESTION), tools, llm, GREEDY, tokenizer)

    assert traj.finish_reason == "stop" and traj.extra["answer"] == "42"
    assert traj.extra["backends"][0] == killed[0] and traj.backend != killed[0]
    assert "backend_failures" in traj.extra
    assert_token_exact(traj, client, reference_model)
    rows = {r.url: r for r in await balancer.backends()}
    assert rows[killed[0]].healthy is False
    assert all(r.in_flight == 0 for r in rows.values())
    await redis.aclose()


async def test_turn_cut_at_max_tokens_is_closed_by_observation_tokens(
    model_server, client, calculator, tokenizer, reference_model
):
    # 5 tokens cut the scripted tool call in half: no <|im_end|> from the model, so the
    # observation (mask 0) must start by closing the turn, and the half call is malformed.
    settings = GREEDY.model_copy(update={"max_tokens_per_turn": 5, "max_turns": 2})
    llm = LLMSession(client, "job-cut", backend_url=model_server)
    traj = await run_agent(prompt(ADD_QUESTION), calculator, llm, settings, tokenizer)

    first = client.generations[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 5
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert first.token_ids[-1] != end_of_turn
    assert traj.response_ids[5] == end_of_turn and traj.loss_mask[5] == 0
    assert traj.tool_calls[0].name == "<malformed>" and "not closed" in traj.tool_calls[0].error
    assert traj.finish_reason == "max_turns"
    assert_token_exact(traj, client, reference_model)
