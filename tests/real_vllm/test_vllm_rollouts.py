"""Agent rollouts through VLLMClient against a real vLLM: tool calls run, the trajectory holds
vLLM's own ids and logprobs (loss mask 1) and the template's observation tokens (mask 0),
and the logprobs are the model's (transformers recomputation); finish reasons and vLLM's
context limits end turns and episodes as rollstream documents."""

from __future__ import annotations

import asyncio

import pytest
from agent.conftest import RecordingClient
from agent.test_agent_loop import generated_segments

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.episode import run_agent
from rollstream.agent.tools import submit_tool_schema
from rollstream.episode_settings import AgentSettings
from rollstream.llm import ContextLengthError, SamplingParams, VLLMClient
from rollstream.llm.session import LLMSession
from rollstream.tasks import arith

from .refs import arith_tools, recompute_logprobs, trajectory_logprob_error
from .vllm_process import MAX_MODEL_LEN

SETTINGS = AgentSettings(max_turns=3, max_tokens_per_turn=48, max_context_tokens=MAX_MODEL_LEN)


def renderer(tokenizer) -> ChatRenderer:
    """The chat template as the agent renders it for the arith task (bash + submit)."""
    return ChatRenderer(tokenizer, [arith.BASH_SCHEMA, submit_tool_schema("submit")])


async def test_agent_episodes_on_vllm_call_tools_and_keep_vllms_ids_masks_and_logprobs(
        vllm_url, tokenizer, reference_model):
    instances = arith.make_instances(4, seed=11)
    clients = [RecordingClient() for _ in instances]
    settings = [SETTINGS.model_copy(update={"sampling": SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i)})
                for i in range(len(instances))]
    # Concurrent episodes: vLLM batches them, which must not change any of them.
    trajectories = await asyncio.gather(*[
        run_agent(arith.prompt(inst), arith_tools(), LLMSession(client, f"job-{i}", backend_url=vllm_url), s, tokenizer)
        for i, (inst, client, s) in enumerate(zip(instances, clients, settings))])

    for traj, client in zip(trajectories, clients):
        assert traj.finish_reason in ("stop", "max_turns"), traj.extra
        assert traj.backend == vllm_url
        # Every masked-in token is vLLM's, in order; observations are masked out with logprob 0.
        assert generated_segments(traj) == [g.token_ids for g in client.generations]
        learnt = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
        assert learnt == [lp for g in client.generations for lp in g.logprobs]
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if not m)
        assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
        # vLLM's logprobs are the model's own (fp32 transformers, one forward pass).
        assert trajectory_logprob_error(reference_model, traj) < 1e-3
        await client.aclose()
    # The warmed-up model calls bash; its output came back as an observation.
    bash_calls = [c for t in trajectories for c in t.tool_calls if c.name == "bash"]
    assert bash_calls and all(c.ok for c in bash_calls)
    assert all(0 in t.loss_mask for t in trajectories if any(c.name == "bash" for c in t.tool_calls))
    observation = [tok for tok, m in zip(trajectories[0].response_ids, trajectories[0].loss_mask) if not m]
    assert "<tool_response>" in tokenizer.decode(observation, skip_special_tokens=False)


async def test_turns_end_with_vllms_finish_reasons(vllm_url, tokenizer, reference_model):
    client = VLLMClient()
    prompt = renderer(tokenizer).prompt_ids(arith.prompt({"a": 3, "op": "+", "b": 4}))
    free = await client.generate(vllm_url, prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    recomputed = recompute_logprobs(reference_model, prompt, free.token_ids)
    assert max(abs(a - b) for a, b in zip(free.logprobs, recomputed)) < 1e-3

    stop_id = free.token_ids[5]
    stopped = await client.generate(vllm_url, prompt,
                                    SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))
    cut = free.token_ids.index(stop_id) + 1
    assert stopped.token_ids == free.token_ids[:cut]  # the stop id itself is returned
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id

    text = tokenizer.decode(free.token_ids)
    stop = next(w for w in ("bash", "command", "echo", "tool_call") if w in text)
    by_string = await client.generate(vllm_url, prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    assert stop not in by_string.text and text.startswith(by_string.text)
    assert by_string.token_ids == free.token_ids[: len(by_string.token_ids)]

    # The model's own end of turn (<|im_end|>, its EOS) ends a turn without being asked.
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    natural = await client.generate(vllm_url, prompt, SamplingParams(temperature=0, max_tokens=200))
    if eos in free.token_ids or natural.finish_reason == "stop":
        assert natural.finish_reason == "stop" and natural.token_ids[-1] == eos
    await client.aclose()


async def test_vllm_context_limits_are_context_errors_and_clamped_turns(vllm_url, tokenizer):
    client = VLLMClient()
    with pytest.raises(ContextLengthError) as too_long:
        await client.generate(vllm_url, [5] * (MAX_MODEL_LEN + 10), SamplingParams(max_tokens=4))
    assert not too_long.value.retryable and too_long.value.status_code == 400
    # A prompt that fills the context exactly leaves no room: vLLM says "max_tokens ... got 0".
    with pytest.raises(ContextLengthError):
        await client.generate(vllm_url, [5] * MAX_MODEL_LEN, SamplingParams(max_tokens=4))
    # Prompt + max_tokens past the context: vLLM generates only what fits (finish 'length').
    clamped = await client.generate(vllm_url, [5] * (MAX_MODEL_LEN - 3), SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(clamped.token_ids) == 3 and clamped.finish_reason == "length"
    assert clamped.prompt_tokens == MAX_MODEL_LEN - 3
    await client.aclose()


def prompt_of_length(tokenizer, length: int) -> list[dict]:
    """Arith messages padded so that the agent's rendered prompt is `length` tokens long."""
    chat = renderer(tokenizer)

    def messages(words: int, digits: int) -> list[dict]:
        # Single digits are one token each (Qwen's pre-tokenizer splits them): the fine adjustment.
        return [{"role": "system", "content": arith.SYSTEM + " seven" * words + " " + "7" * digits},
                {"role": "user", "content": arith.question(2, "+", 2)}]

    words = 0
    while len(chat.prompt_ids(messages(words + 1, 0))) < length:
        words += 1
    for digits in range(64):
        n = len(chat.prompt_ids(messages(words, digits)))
        if n == length:
            return messages(words, digits)
    raise AssertionError(f"could not pad the prompt to {length} tokens")


async def test_an_episode_outgrowing_vllms_context_ends_with_context_not_error(vllm_url, tokenizer):
    """The agent allows more context than vLLM serves: vLLM clamps the turn to the room left
    (finish 'length'), the episode goes on, and the turn vLLM then refuses ends it as 'context'."""
    client = RecordingClient()
    messages = prompt_of_length(tokenizer, MAX_MODEL_LEN - 6)
    settings = AgentSettings(max_turns=5, max_tokens_per_turn=48, max_context_tokens=4 * MAX_MODEL_LEN,
                             sampling=SamplingParams(temperature=0.0))
    traj = await run_agent(messages, arith_tools(), LLMSession(client, "job-long", backend_url=vllm_url), settings,
                           tokenizer)
    assert traj.finish_reason == "context", (traj.finish_reason, traj.extra)
    assert [len(g.token_ids) for g in client.generations] == [6]
    assert client.generations[0].finish_reason == "length"
    await client.aclose()
