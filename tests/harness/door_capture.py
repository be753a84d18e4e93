"""What a harness sends, captured through rollstream's own door: a job's door on loopback whose
"model" answers a script of replies (the text the served model would emit, tool calls in the
template's <tool_call> form), while the harness, unmodified, runs on this host against it. Each
call's prompt is the door's own rendering of the harness's request (its system prompt, tools and
history), so the examples a scripted model learns are the very token ids the door sends the
backend when the same harness runs in a sandbox against the real model. ``capture_in_sandbox``
runs it where a job runs it (a bwrap or podman sandbox of the task's spec, staged by the run stage's
own stage_launch, behind the relay), so that what the CLI says of its surroundings (working folder,
platform, files) is what it says in a job."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollstream.agent.gateway import Gateway
from rollstream.agent.presets import Preset
from rollstream.agent.sandbox_harness import (
    HARNESS_SESSION,
    launch_values,
    stage_launch,
)
from rollstream.episode_settings import agent_settings
from rollstream.llm.inference_client import Generation
from rollstream.sampling import SamplingParams
from rollstream.sandbox_spec import SandboxSpec


@dataclass
class Captured:
    prompts: list[list[int]]  # each call's prompt ids, as the door rendered them
    replies: list[list[int]]  # the scripted answer's ids (ending with the end-of-turn token)
    output: str  # what the harness printed (stdout and stderr)
    exit_code: int


class ScriptedSession:
    """The door's LLM session, answering each call with the next scripted text."""

    def __init__(self, tokenizer, replies: list[str], end_of_turn: str) -> None:
        self.tokenizer, self.replies, self.end_of_turn = tokenizer, list(replies), end_of_turn
        self.backend = "scripted"
        self.prompts: list[list[int]] = []
        self.answers: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params, on_tokens=None, release_later: bool = False) -> Generation:
        text = self.replies[len(self.prompts)] if len(self.prompts) < len(self.replies) else "(no more replies)"
        ids = self.tokenizer.encode(text + self.end_of_turn, add_special_tokens=False)
        self.prompts.append(list(prompt_ids))
        self.answers.append(ids)
        if on_tokens is not None:  # a streamed call: the reply in one piece
            await on_tokens(ids, [0.0] * len(ids))
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")

    async def release_finished(self) -> None:
        pass  # no backend slot to give back

    async def close(self) -> None:
        pass


def capture(tokenizer, replies: list[str], argv: list[str], env: dict[str, str], cwd: Path,
            agent: dict | None = None, timeout_s: float = 300.0) -> Captured:
    """Run ``argv`` (``{door_url}``, ``{door_key}`` in it and in ``env`` filled in) against a
    door answering ``replies``; returns what the door saw."""
    return asyncio.run(_capture(tokenizer, replies, argv, env, cwd, agent or {}, timeout_s))


def _open(gateway: Gateway, tokenizer, replies: list[str], agent: dict):
    settings = agent_settings({"max_turns": len(replies) + 2, "max_context_tokens": 1 << 20,
                               "max_tokens_per_turn": 4096, **agent}, SamplingParams(temperature=0.0))
    session = ScriptedSession(tokenizer, replies, settings.end_of_turn_token or "<|im_end|>")
    return session, gateway.open("capture", session, tokenizer, settings)


def capture_in_sandbox(tokenizer, replies: list[str], preset: Preset, instruction: str, spec: SandboxSpec,
                       timeout_s: float = 300.0, prepare=None, backend: str = "bwrap") -> Captured:
    """Run ``preset`` as the run stage does, in a sandbox of ``spec`` (bwrap, or ``backend``: 'docker'
    with the preset's image in ``spec``), against a door answering ``replies``; returns what the door
    saw. ``prepare(handle, sandbox)``, a coroutine, sets the sandbox up first as the task's init does
    (an SWE task's checkout)."""
    spec = spec.model_copy(update={"backend": backend})
    return asyncio.run(_capture_in_sandbox(tokenizer, replies, preset, instruction, spec, timeout_s, prepare))


async def _capture_in_sandbox(tokenizer, replies, preset, instruction, spec, timeout_s, prepare) -> Captured:
    from rollstream.sandboxes import SandboxClient, create_sandbox, destroy_sandbox

    root = tempfile.mkdtemp(prefix="rs-cap-")
    gateway = await Gateway().start()
    session, door = _open(gateway, tokenizer, replies, {})
    handle = None
    try:
        handle = await create_sandbox(spec, sandbox_id="capture", owner="capture", root_dir=root)
        async with SandboxClient(handle.socket_path) as sandbox:
            if prepare is not None:
                await prepare(handle, sandbox)
            await gateway.open_in_sandbox(door, os.path.join(os.path.dirname(sandbox.socket_path), "door"))
            command = await stage_launch(sandbox, preset, door.key, launch_values(preset, instruction))
            result = await sandbox.bash(command, timeout_s=timeout_s, no_output_timeout_s=0, session=HARNESS_SESSION)
        return Captured(session.prompts, session.answers, result.output, result.exit_code)
    finally:
        gateway.close(door)
        await gateway.aclose()
        if handle is not None:
            await destroy_sandbox(handle)
        shutil.rmtree(root, ignore_errors=True)


async def _capture(tokenizer, replies, argv, env, cwd, agent, timeout_s) -> Captured:
    gateway = await Gateway().start()
    session, door = _open(gateway, tokenizer, replies, agent)
    values = {"door_url": gateway.base_url, "door_key": door.key}

    def fill(text: str) -> str:
        for name, value in values.items():
            text = text.replace("{" + name + "}", value)
        return text

    try:
        process = await asyncio.create_subprocess_exec(
            *[fill(a) for a in argv], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PWD": str(cwd), **{k: fill(v) for k, v in env.items()}})
        try:
            out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        except TimeoutError:
            process.kill()
            out, _ = await process.communicate()
        return Captured(session.prompts, session.answers, out.decode("utf-8", "replace"),
                        process.returncode if process.returncode is not None else -1)
    finally:
        gateway.close(door)
        await gateway.aclose()
