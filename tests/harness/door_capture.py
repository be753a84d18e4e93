"""What a harness sends, captured through rollstream's own door: a job's door on loopback whose
"model" answers a script of replies (the text the served model would emit, tool calls in the
template's <tool_call> form), while the harness, unmodified, runs on this host against it. Each
call's prompt is the door's own rendering of the harness's request (its system prompt, tools and
history), so the examples a scripted model learns are the very token ids the door sends the
backend when the same harness runs in a sandbox against the real model."""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rollstream.agent.gateway import Gateway
from rollstream.episode_settings import agent_settings
from rollstream.llm.inference_client import Generation
from rollstream.sampling import SamplingParams


@dataclass
class Captured:
    prompts: list[list[int]]  # each call's prompt ids, as the door rendered them
    replies: list[list[int]]  # the scripted answer's ids (ending with the end-of-turn token)
    requests: list[dict]  # the harness's request bodies, as sent
    output: str  # what the harness printed (stdout and stderr)
    exit_code: int


class ScriptedSession:
    """The door's LLM session, answering each call with the next scripted text."""

    def __init__(self, tokenizer, replies: list[str], end_of_turn: str) -> None:
        self.tokenizer, self.replies, self.end_of_turn = tokenizer, list(replies), end_of_turn
        self.backend = "scripted"
        self.prompts: list[list[int]] = []
        self.answers: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params) -> Generation:
        text = self.replies[len(self.prompts)] if len(self.prompts) < len(self.replies) else "(no more replies)"
        ids = self.tokenizer.encode(text + self.end_of_turn, add_special_tokens=False)
        self.prompts.append(list(prompt_ids))
        self.answers.append(ids)
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")

    async def close(self) -> None:
        pass


def capture(tokenizer, replies: list[str], argv: list[str], env: dict[str, str], cwd: Path,
            agent: dict | None = None, timeout_s: float = 300.0) -> Captured:
    """Run ``argv`` (``{door_url}``, ``{door_key}`` in it and in ``env`` filled in) against a
    door answering ``replies``; returns what the door saw."""
    return asyncio.run(_capture(tokenizer, replies, argv, env, cwd, agent or {}, timeout_s))


async def _capture(tokenizer, replies, argv, env, cwd, agent, timeout_s) -> Captured:
    settings = agent_settings({"max_turns": len(replies) + 2, "max_context_tokens": 1 << 20,
                               "max_tokens_per_turn": 4096, **agent}, SamplingParams(temperature=0.0))
    gateway = await Gateway().start()
    session = ScriptedSession(tokenizer, replies, settings.end_of_turn_token or "<|im_end|>")
    door = gateway.open("capture", session, tokenizer, settings)
    requests: list[dict] = []
    complete = door.complete

    async def recording(request: dict) -> dict:
        requests.append(request)
        return await complete(request)

    door.complete = recording  # type: ignore[method-assign]
    values = {"door_url": gateway.base_url, "door_key": door.key}

    def fill(text: str) -> str:
        for name, value in values.items():
            text = text.replace("{" + name + "}", value)
        return text

    try:
        process = await asyncio.create_subprocess_exec(
            *[fill(a) for a in argv], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env={**os.environ, **{k: fill(v) for k, v in env.items()}})
        try:
            out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            process.kill()
            out, _ = await process.communicate()
        return Captured(session.prompts, session.answers, requests, out.decode("utf-8", "replace"),
                        process.returncode if process.returncode is not None else -1)
    finally:
        gateway.close(door)
        await gateway.aclose()
