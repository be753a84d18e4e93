"""A tiny model trained (CPU, seconds) to give the dataset's answer to row 0 of each test
environment in tests/tasks/verifiers_envs, in the environments' own formats (tool calls, a command
in the sandbox and its output included), so a verifiers
episode scores 1 through the real pipeline, deterministically (greedy). The conversations are
rendered as the job's door renders what verifiers sends it (same template, same tool schemas)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path

ENVS_DIR = Path(__file__).parent / "verifiers_envs"


def _environments():
    sys.path.insert(0, str(ENVS_DIR))
    import verifiers as vf

    names = ("vf-reverse-text", "vf-alphabet-sort", "vf-tool-test", "vf-sandbox-secret")
    return vf, {name: vf.load_environment(name) for name in names}


def conversations() -> list[tuple[list[dict], list[dict] | None]]:
    """(messages ending in the answer, tools as the door shows them) for row 0 of each environment."""
    vf, envs = _environments()
    reverse = envs["vf-reverse-text"].get_dataset()[0]
    sort = envs["vf-alphabet-sort"].get_dataset()[0]
    tools_row = envs["vf-tool-test"].get_dataset()[0]
    client = vf.OpenAIChatCompletionsClient(object())

    def schemas(env) -> list[dict]:
        native = [json.loads(json.dumps(asyncio.run(client.to_native_tool(t)))) for t in env.tool_defs]
        return [{**s, "function": {k: v for k, v in s["function"].items() if k != "strict"}} for s in native]

    secret = envs["vf-sandbox-secret"].get_dataset()[0]
    first, second = sort["info"]["ground_truths"]
    return [
        (reverse["prompt"] + [{"role": "assistant",
                               "content": f"<reversed_text>\n{reverse['answer']}\n</reversed_text>"}], None),
        (sort["prompt"] + [
            {"role": "assistant", "content": "<alphabetical_sorted>\n" + "\n".join(first) + "\n</alphabetical_sorted>"},
            {"role": "user", "content": sort["info"]["follow_ups"][0]},
            {"role": "assistant", "content": "<combined_alphabetical_sorted>\n" + "\n".join(second)
             + "\n</combined_alphabetical_sorted>"}], None),
        (tools_row["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {"x": 1}}}
            for name in tools_row["info"]["tool_names"]]}],
         schemas(envs["vf-tool-test"])),
        (secret["prompt"] + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": {"command": "cat secret.txt"}}}]},
            {"role": "tool", "content": secret["answer"]},  # what SandboxEnv's bash returns: the file, stripped
            {"role": "assistant", "content": f"<answer>{secret['answer']}</answer>"}],
         schemas(envs["vf-sandbox-secret"])),
    ]


def trained_folder(folder: Path, data: list | None = None) -> Path:
    """Where ``build`` leaves the model: named by this file and the conversations, so a change
    to either trains anew."""
    data = conversations() if data is None else data
    key = hashlib.sha1(Path(__file__).read_bytes() + json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
    return folder / f"verifiers-{key}"


def build(folder: Path, base: Path, steps: int = 400) -> Path:
    """Train the tiny model of ``base`` on the conversations into folder/verifiers-<recipe>."""
    import torch
    from agent.scripted_model import (
        _example,  # the agent tests' masking of assistant turns
        train_and_save,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollstream.agent.chat import ChatRenderer

    data = conversations()
    out = trained_folder(folder, data)
    if (out / "trained.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    examples = [_example(ChatRenderer(tokenizer, tools), messages) for messages, tools in data]
    return train_and_save(model, tokenizer, examples, out, steps)
