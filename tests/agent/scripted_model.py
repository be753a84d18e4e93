"""A tiny model briefly trained (CPU, seconds) to emit scripted Hermes tool calls, so the
agent loop's tool paths run against a real model and server deterministically (greedy)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.parsing import malformed_call_observation, parse_tool_calls
from rollstream.agent.tools import function_schema, submit_tool_schema
from rollstream.llm.tiny_model import build_tiny_model

SYSTEM = "Use tools."
CALCULATOR = function_schema("calculator", "Evaluate arithmetic.", {"expression": {"type": "string"}})
TOOLS = [CALCULATOR, submit_tool_schema("submit")]

ADD_QUESTION = "What is 12 + 30?"
BROKEN_QUESTION = "What is 7 * 6?"


def call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def scripts() -> list[list[dict]]:
    """Conversations the model learns by heart: a calculator call then submit; and a
    broken tool call first (invalid JSON), then the right one after the error."""
    add = prompt(ADD_QUESTION) + [
        {"role": "assistant", "content": "", "tool_calls": [call("calculator", {"expression": "12 + 30"})]},
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "assistant", "content": "", "tool_calls": [call("submit", {"answer": "42"})]},
    ]
    # Written as raw text (the template would render a valid call); the error observation
    # is the agent loop's own, so the context after it is one the model has seen.
    broken_call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 6"}\n</tool_call>'
    (malformed,) = parse_tool_calls(broken_call).calls
    broken = prompt(BROKEN_QUESTION) + [
        {"role": "assistant", "content": broken_call},
        {"role": "tool", "name": "error", "content": malformed_call_observation(malformed)},
        {"role": "assistant", "content": "", "tool_calls": [call("submit", {"answer": "42"})]},
    ]
    return [add, broken]


def _example(renderer: ChatRenderer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a mask over the assistant turns' tokens."""
    ids = renderer.encode(renderer.render(messages, add_generation_prompt=False))
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(renderer.prompt_ids(messages[:i]))
        end = len(renderer.encode(renderer.render(messages[: i + 1], add_generation_prompt=False)))
        assert ids[:start] == renderer.prompt_ids(messages[:i]), "template is not prefix-stable"
        for j in range(start, end):
            # Learn up to and including <|im_end|>, not the newline the template adds after.
            if ids[j - 1] != renderer.end_of_turn_id:
                mask[j] = 1
    return ids, mask


def recipe_key() -> str:
    """Changes whenever this file (the scripts, the training) changes."""
    from rollstream.llm import tiny_model

    source = Path(__file__).read_bytes() + str(tiny_model._RECIPE_VERSION).encode()
    return hashlib.sha1(source).hexdigest()[:12]


def build_scripted_model(folder: Path, steps: int = 400) -> Path:
    """Build the tiny model in folder/base, train it on the scripts, save to
    folder/scripted-<recipe>; reused when already there (training takes ~a minute on a
    busy 2-core machine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = folder / f"scripted-{recipe_key()}"
    if (out / "trained.json").exists():
        return out
    base = build_tiny_model(folder / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer, TOOLS)
    examples = [_example(renderer, s) for s in scripts()]
    return train_and_save(model, tokenizer, examples, out, steps)


def train_and_save(model, tokenizer, examples: list[tuple[list[int], list[int]]], out: Path, steps: int) -> Path:
    """Train ``model`` on ``examples`` (ids, loss mask) until its loss is near zero or ``steps``
    full passes, then save it with ``tokenizer`` to ``out`` (written aside and renamed, so an
    interrupted run never leaves a half-saved model). The test models' one trainer."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    total, step = 0.0, 0
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for ids, mask in examples:
            logits = model(torch.tensor([ids])).logits[0, :-1]
            weight = torch.tensor(mask[1:], dtype=torch.float32)
            loss = (torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
                    * weight).sum() / weight.sum()
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        if total < 1e-3 * len(examples):
            break
    model.eval()
    tmp = out.parent / f".{out.name}.{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "trained.json").write_text(json.dumps({"steps": step + 1, "loss": total}))
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another session saved it first
    return out
