"""The agent loop of the run stage: model turn, tool calls, observation, repeat, until the
model submits or a limit ends the episode. Produces the token-level Trajectory: generated
ids and logprobs exactly as the server returned them, observation tokens with loss mask 0."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.parsing import MalformedToolCall, ToolCall, malformed_call_observation, parse_tool_calls
from rollstream.agent.tools import ToolBox, ToolOutput, call_with_timeout, schema_name, submit_tool_schema
from rollstream.episode_settings import AgentSettings
from rollstream.llm.balancer import NoBackendAvailable
from rollstream.llm.inference_client import BackendError, ContextLengthError
from rollstream.llm.session import LLMSession
from rollstream.trajectory import FinishReason, Message, ToolCallRecord, Trajectory

log = logging.getLogger(__name__)


class _EpisodeEnd(Exception):
    def __init__(self, reason: FinishReason, detail: str | None = None) -> None:
        self.reason = reason
        self.detail = detail


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep head and tail of a long observation: errors tend to be at the end, context at the start."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class _Episode:
    """State of one rollout; run_agent below is its only user."""

    def __init__(self, prompt_messages, tools, llm, settings, tokenizer, cancelled) -> None:
        self.tools: ToolBox = tools
        self.llm: LLMSession = llm
        self.settings: AgentSettings = settings
        self.tokenizer = tokenizer
        self.cancelled = cancelled
        self.started = time.monotonic()
        schemas = list(tools.schemas())
        names = {schema_name(s) for s in schemas}
        if settings.add_finish_tool and not names & set(settings.finish_tool_names):
            schemas.append(submit_tool_schema(settings.finish_tool_names[0]))
        self.chat = ChatRenderer(tokenizer, schemas, settings.end_of_turn_token, settings.chat_template_kwargs)
        self.history: list[dict] = [dict(m) for m in prompt_messages]
        self.traj = Trajectory(messages=[_message(m) for m in prompt_messages])
        self.timings = {"llm_s": 0.0, "tools_s": 0.0, "template_s": 0.0}
        self.versions: list[int] = []

    # -- limits ---------------------------------------------------------------------------

    def time_left_s(self) -> float:
        return self.settings.max_wall_time_s - (time.monotonic() - self.started)

    async def check_limits(self) -> None:
        if self.cancelled is not None and await self.cancelled():
            raise _EpisodeEnd("cancelled")
        if self.time_left_s() <= 0:
            raise _EpisodeEnd("timeout", f"wall time {self.settings.max_wall_time_s:.0f}s used up")

    def context_left(self) -> int:
        return self.settings.max_context_tokens - len(self.traj.prompt_ids) - len(self.traj.response_ids)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> Trajectory:
        t0 = time.monotonic()
        self.traj.prompt_ids = self.chat.prompt_ids(self.history)
        self.timings["template_s"] += time.monotonic() - t0
        try:
            if self.context_left() <= 0:
                raise _EpisodeEnd("context", f"the prompt alone has {len(self.traj.prompt_ids)} tokens")
            while True:
                if self.traj.num_turns >= self.settings.max_turns:
                    raise _EpisodeEnd("max_turns")
                await self.check_limits()
                await self.turn()
        except _EpisodeEnd as end:
            self.traj.finish_reason = end.reason
            if end.detail:
                self.traj.extra["finish_detail"] = end.detail
        return self.finish()

    async def turn(self) -> None:
        budget = self.context_left()
        if budget <= 0:
            raise _EpisodeEnd("context")
        max_tokens = min(self.settings.max_tokens_per_turn, budget)
        # Stop at the end of the assistant turn even where the model's eos is another token.
        stop_ids = sorted(set(self.settings.sampling.stop_token_ids or []) | {self.chat.end_of_turn_id})
        params = self.settings.sampling.model_copy(update={"max_tokens": max_tokens, "stop_token_ids": stop_ids})
        ids = self.traj.prompt_ids + self.traj.response_ids
        t0 = time.monotonic()
        try:
            gen = await asyncio.wait_for(self.llm.generate(ids, params), self.time_left_s())
        except TimeoutError:
            raise _EpisodeEnd("timeout", "wall time ran out during a model turn") from None
        except ContextLengthError as exc:
            raise _EpisodeEnd("context", exc.reason) from None
        except (BackendError, NoBackendAvailable) as exc:
            raise _EpisodeEnd("error", str(exc)) from None
        finally:
            self.timings["llm_s"] += time.monotonic() - t0
        if len(gen.token_ids) != len(gen.logprobs):
            raise _EpisodeEnd("error", f"backend returned {len(gen.token_ids)} ids but {len(gen.logprobs)} logprobs")

        # The server's ids and logprobs, unchanged: these are what the trainer learns from.
        self.traj.response_ids.extend(gen.token_ids)
        self.traj.loss_mask.extend([1] * len(gen.token_ids))
        self.traj.logprobs.extend(gen.logprobs)
        self.traj.num_turns += 1
        if gen.policy_version is not None:
            self.versions.append(gen.policy_version)

        ended_turn = bool(gen.token_ids) and gen.token_ids[-1] == self.chat.end_of_turn_id
        # Decoded only to find tool calls; the text is never tokenized again.
        text = self.tokenizer.decode(gen.token_ids[:-1] if ended_turn else gen.token_ids, skip_special_tokens=False)
        parsed = parse_tool_calls(text)
        calls = [c for c in parsed.calls if isinstance(c, ToolCall)]
        assistant = {"role": "assistant", "content": parsed.content if calls else text}
        if calls:
            assistant["tool_calls"] = [c.as_message() for c in calls]
        self.history.append(assistant)
        self.traj.messages.append(_message(assistant, raw_text=text))

        if not parsed.calls:
            if ended_turn or gen.finish_reason == "stop":
                raise _EpisodeEnd("stop")  # the model answered without a tool: its choice
            if max_tokens < self.settings.max_tokens_per_turn:
                raise _EpisodeEnd("context", "the context filled up during a model turn")
            # No tool call to answer: the note goes in a user turn.
            observations: list[dict] = [{"role": "user", "content": _cut_turn_message(max_tokens)}]
        else:
            answered = await self.run_calls(parsed.calls)
            if answered is None:
                raise _EpisodeEnd("stop")
            observations = answered
        await self.append_observations(observations, ended_turn)

    async def run_calls(self, calls: list[ToolCall | MalformedToolCall]) -> list[dict] | None:
        """Run the turn's calls in order; None when one of them is the finish tool."""
        messages: list[dict] = []
        for call in calls:
            if isinstance(call, MalformedToolCall):
                self.traj.tool_calls.append(
                    ToolCallRecord(name="<malformed>", ok=False, error=call.error, arguments={"raw": call.raw[:500]})
                )
                messages.append(_tool_message("error", malformed_call_observation(call)))
                continue
            if call.name in self.settings.finish_tool_names:
                self.traj.extra["answer"] = call.arguments.get("answer", call.arguments)
                self.traj.tool_calls.append(ToolCallRecord(name=call.name, arguments=call.arguments))
                return None
            await self.check_limits()
            t0 = time.monotonic()
            timeout = min(self.settings.tool_timeout_s, max(self.time_left_s(), 0.001))
            output: ToolOutput = await call_with_timeout(self.tools, call.name, call.arguments, timeout)
            if output.sandbox_lost:  # not the agent's doing: the job is retried in a fresh sandbox
                raise _EpisodeEnd("error", f"the sandbox was lost during a {call.name} call: {output.error}")
            elapsed = time.monotonic() - t0
            self.timings["tools_s"] += elapsed
            self.traj.tool_calls.append(
                ToolCallRecord(
                    name=call.name,
                    arguments=call.arguments,
                    ok=output.ok,
                    duration_ms=elapsed * 1000,
                    error=output.error,
                )
            )
            text = truncate_middle(output.text, self.settings.max_observation_chars) or "(no output)"
            messages.append(_tool_message(call.name, text))
        return messages

    async def append_observations(self, observations: list[dict], ended_turn: bool) -> None:
        t0 = time.monotonic()
        obs_ids = self.chat.observation_ids(self.history, observations, ended_turn)
        self.timings["template_s"] += time.monotonic() - t0
        if len(obs_ids) > self.context_left():
            # The observation would not fit: end here rather than cut tokens mid-message.
            raise _EpisodeEnd("context", f"a {len(obs_ids)}-token observation does not fit the context")
        self.history.extend(observations)
        self.traj.messages.extend(_message(m) for m in observations)
        self.traj.response_ids.extend(obs_ids)
        self.traj.loss_mask.extend([0] * len(obs_ids))
        self.traj.logprobs.extend([0.0] * len(obs_ids))

    def finish(self) -> Trajectory:
        traj = self.traj
        traj.backend = self.llm.backend
        traj.policy_version = min(self.versions) if self.versions else 0
        if len(set(self.versions)) > 1:
            traj.extra["policy_versions"] = self.versions
        if len(self.llm.backends_used) > 1:
            traj.extra["backends"] = list(self.llm.backends_used)
        if self.llm.failures:
            traj.extra["backend_failures"] = list(self.llm.failures)
        traj.response_text = self.tokenizer.decode(traj.response_ids, skip_special_tokens=False)
        traj.timings_s.update({k: round(v, 6) for k, v in self.timings.items()})
        traj.timings_s["total_s"] = round(time.monotonic() - self.started, 6)
        return traj


def _cut_turn_message(max_tokens: int) -> str:
    return (
        f"Error: your message was cut at {max_tokens} tokens without a complete tool call. "
        "Be shorter, and call a tool or submit your answer."
    )


def _tool_message(name: str, text: str) -> dict:
    return {"role": "tool", "name": name, "content": text}


def _message(message: dict, raw_text: str | None = None) -> Message:
    content = message.get("content")
    if raw_text is not None:
        content = raw_text
    elif not isinstance(content, str):
        content = json.dumps(content) if content is not None else ""
    return Message(
        role=message["role"], content=content, tool_calls=message.get("tool_calls"), name=message.get("name")
    )


async def run_agent(
    prompt_messages: list[dict],
    tools: ToolBox,
    llm: LLMSession,
    settings: AgentSettings,
    tokenizer: Any,
    cancelled: Callable[[], Awaitable[bool]] | None = None,
) -> Trajectory:
    """Run one episode and return its trajectory. Never raises for the model's or a tool's
    mistakes, nor for failing backends: those end in an error observation or a finish
    reason (stop, max_turns, context, timeout, cancelled, error)."""
    episode = _Episode(prompt_messages, tools, llm, settings, tokenizer, cancelled)
    try:
        return await episode.run()
    finally:
        await llm.close()
