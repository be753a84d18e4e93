"""A tiny model that has learnt by heart one mini-SWE-agent episode, so that mini-SWE-agent,
unmodified, completes its loop on it (greedy): a bash block that computes, then the submit
command. The episode's messages are mini-SWE-agent's own: its text-based model class and
environment render them here (the harness's venv, with a scripted reply in place of litellm's
call), with the config the preset runs (mini_textbased.yaml), so the prompts the model learns
are the ones the harness sends through the door."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import torch

from agent.scripted_model import _example, train_and_save
from rollstream.agent.chat import ChatRenderer
from rollstream.llm.tiny_model import _RECIPE_VERSION, build_tiny_model

# Run by the harness's own interpreter: mini-SWE-agent's agent, environment and text-based model
# class with mini_textbased.yaml, litellm's call replaced by the scripted replies (the commands run
# here, or their outputs replayed); prints the messages it would send for the whole episode.
RENDER = r'''
import json, sys, tempfile
import litellm
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

task, replies = sys.argv[1], json.loads(sys.argv[2])
outputs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
sent = []


class Replayed(LocalEnvironment):
    """The commands' outputs as the sandbox gives them (where the host cannot run them)."""

    def execute(self, action, cwd="", *, timeout=None):
        output = {"output": outputs.pop(0), "returncode": 0, "exception_info": ""}
        self._check_finished(output)
        return output

class Scripted(LitellmTextbasedModel):
    def _query(self, messages, **kwargs):
        sent.append(messages)
        return litellm.ModelResponse(choices=[{"message": {"role": "assistant", "content": replies[len(sent) - 1]},
                                               "finish_reason": "stop"}])

config = get_config_from_spec("mini_textbased.yaml")
model = Scripted(**{**config["model"], "model_name": "openai/rollstream", "cost_tracking": "ignore_errors"})
env = (Replayed if outputs is not None else LocalEnvironment)(**{**config.get("environment", {}),
                                                                 "cwd": tempfile.mkdtemp()})
agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}
agent = DefaultAgent(model, env, **{**agent_config, "cost_limit": 0})
agent.run(task)
print(json.dumps(sent[-1] + [{"role": "assistant", "content": replies[len(sent) - 1]}]))
'''


def episode(python: str, task: str, replies: list[str], outputs: list[str] | None = None) -> list[dict]:
    """The messages of a whole episode, as mini-SWE-agent sends them, with the replies in place;
    ``outputs``: the commands' outputs (status 0) where the host cannot run them, else they run."""
    extra = [json.dumps(outputs)] if outputs is not None else []
    completed = subprocess.run([python, "-c", RENDER, task, json.dumps(replies), *extra], capture_output=True, text=True,
                               timeout=300, check=True,
                               env={**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
                                    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                                    "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/.rs-mswea-render"})
    messages = json.loads(completed.stdout.strip().splitlines()[-1])
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def build_mini_model(folder: Path, conversations: list[list[dict]], steps: int = 300) -> Path:
    """The tiny model trained on ``conversations`` (kept in folder, reused while they are the same)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = hashlib.sha1(json.dumps([conversations, _RECIPE_VERSION, steps]).encode()
                       + Path(__file__).read_bytes()).hexdigest()[:12]
    out = folder / f"mini-swe-{key}"
    if (out / "trained.json").exists():
        return out
    base = build_tiny_model(folder / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer, None)
    examples = [_example(renderer, c) for c in conversations]
    return train_and_save(model, tokenizer, examples, out, steps)
