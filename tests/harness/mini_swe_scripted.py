"""Tiny models that have learnt by heart one mini-SWE-agent episode each, so that mini-SWE-agent,
unmodified, completes its loop on them (greedy): on arith, a bash block that computes, then the
submit command; on a shipped SWE instance, one edit of the checkout, then the submit command.
The episode's messages are mini-SWE-agent's own: its text-based model class and environment
render them here (the harness's venv, with a scripted reply in place of litellm's call), with
the config the preset runs (mini_textbased.yaml), so the prompts the model learns are the ones
the harness sends through the door. Built by tests/model_cache.py (before the tests, never in
one), which installs the preset first where scripts/install-harnesses has not."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from agent.scripted_model import _example

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.presets import find_preset, install_on_host
from rollstream.llm.tiny_model import _RECIPE_VERSION
from rollstream.tasks import arith

PRESET = "mini-swe-agent"
ARITH_INSTANCE = {"a": 12, "op": "+", "b": 30}
ARITH_REPLIES = ["THOUGHT: compute it.\n\n```mswea_bash_command\necho $((12+30))\n```",
                 "THOUGHT: submit it.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo 42\n```"]
# One of the shipped SWE instances: mini-SWE-agent edits the checkout with one command, then submits;
# eval runs the instance's hidden tests on the diff it left in the sandbox.
SWE_REPLIES = [
    ("THOUGHT: make remove refuse more than the stock.\n\n```mswea_bash_command\ncd /workspace/inventory && "
     "python3 - <<'EOF'\np = \"inventory/store.py\"\ns = open(p).read().replace(\"self._stock[item] = "
     "self._stock.get(item, 0) - qty\", \"have = self._stock.get(item, 0)\\n        if qty > have:\\n            "
     "raise InsufficientStock(item)\\n        self._stock[item] = have - qty\")\nopen(p, \"w\").write(s)\nEOF\n```"),
    "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"]
SWE_OUTPUTS = ["", "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n"]  # what the two commands print in the sandbox

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


def episode_examples(tokenizer, which: str) -> list[tuple[list[int], list[int]]]:
    """The episode as one example: the whole conversation as the door renders it (no tools: the
    text-based config), mask 1 on the assistant turns; the preset installed on this host first."""
    preset = find_preset(PRESET)
    assert preset is not None
    install_on_host(preset)
    task, replies, outputs = _episodes()[which]
    return [_example(ChatRenderer(tokenizer, None), episode(f"{preset.prefix}/bin/python", task, replies, outputs))]


def _episodes() -> dict[str, tuple[str, list[str], list[str] | None]]:
    """Each model's episode: the task's instruction, the replies, the commands' outputs (None: run)."""
    from rollstream.agent.sandbox_harness import instruction_of
    from rollstream.tasks.swe import SweTask

    from .sandbox_presets import swe_instance

    swe = swe_instance()
    return {"arith": (arith.question(**ARITH_INSTANCE), ARITH_REPLIES, None),
            "swe": (instruction_of(SweTask().prompt_messages(swe)), SWE_REPLIES, SWE_OUTPUTS)}


def trained_folder(parent: Path, which: str) -> Path:
    """Where the model of episode ``which`` ('arith', 'swe') is kept: named by its episode, the
    preset's package and this file, so a change to any trains anew."""
    preset = find_preset(PRESET)
    assert preset is not None
    key = hashlib.sha1(json.dumps([_episodes()[which], preset.package, _RECIPE_VERSION]).encode()
                       + Path(__file__).read_bytes()).hexdigest()[:12]
    return parent / f"mini-swe-{which}-{key}"


def build(parent: Path, which: str, steps: int = 300) -> Path:
    """Install the preset on this host (a no-op where it is), render the episode through it, train."""
    from .episode_model import train_episode

    return train_episode(trained_folder(parent, which), parent / "base",
                         lambda tokenizer: episode_examples(tokenizer, which), steps)
