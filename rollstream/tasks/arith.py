"""The built-in ``arith`` toy task: a question like "What is 37 + 48?" that the agent should
answer by computing it with the bash tool and submitting the result. A small model learns it
on a CPU in minutes, so the whole loop (sandbox, tools, LLM turns, DAPO) can be seen to work.
``conversations`` gives the worked examples for a short supervised warm-up on the format."""

from __future__ import annotations

import random
from typing import Any, ClassVar

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxLimits, SandboxSpec
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report
from rollstream.tasks.agent_task import AgentTask

SYSTEM = "Compute with bash, then submit the number."
# A short schema keeps the prompt short, which is what makes CPU training fast.
BASH_SCHEMA = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def expected(instance: dict) -> int:
    return OPS[instance["op"]](int(instance["a"]), int(instance["b"]))


def make_instances(n: int, seed: int = 0, ops: str = "+", low: int = 1, high: int = 99) -> list[dict]:
    rng = random.Random(seed)
    return [{"a": rng.randint(low, high), "op": rng.choice(ops), "b": rng.randint(low, high)} for _ in range(n)]


def prompt(instance: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(instance["a"], instance["op"], instance["b"])}]


def conversations(instances: list[dict], answer_copy_rate: float = 1.0, answer_key_rate: float = 1.0,
                  seed: int = 0) -> list[list[dict]]:
    """Worked episodes: a bash call that computes the answer, its output, a submit.

    With ``answer_key_rate`` < 1 only that share of episodes calls submit with the argument
    its schema names (``answer``); the others call it ``result``, which the task does not
    take (reward 0). A model warmed up on them computes and copies in every episode but
    follows the tool's schema only sometimes: RL then has that to learn (bench/arith_rl.py).
    With ``answer_copy_rate`` < 1 only that share of episodes submits the tool's output; the
    others submit a wrong number near it."""
    rng = random.Random(seed)
    out = []
    for inst in instances:
        command = f"echo $(({inst['a']}{inst['op']}{inst['b']}))"
        result = str(expected(inst))
        if rng.random() >= answer_copy_rate:
            result = str(expected(inst) + rng.choice((-1, 1)) * rng.randint(1, 30))
        key = "answer" if answer_key_rate >= 1 or rng.random() < answer_key_rate else "result"  # no draw at 1
        out.append(prompt(inst) + [
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]},
            {"role": "tool", "name": "bash", "content": f"{expected(inst)}\n"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "submit", "arguments": {key: result}}}]},
        ])
    return out


# Sampling and agent limits that suit the tiny local model (a bash call, a submit): short
# turns keep CPU rollouts quick. Tests, the demo and the soak all use them.
SMALL_MODEL_SAMPLING = {"temperature": 1.0, "max_tokens": 48}
SMALL_MODEL_AGENT = {"max_turns": 3, "max_tokens_per_turn": 48, "max_context_tokens": 1024}


def job(instance: dict, **fields: Any) -> dict:
    """A job for ``instance`` with the small-model settings; ``fields`` add or override."""
    return {"task": "arith", "instance": instance, "sampling": dict(SMALL_MODEL_SAMPLING),
            "agent": dict(SMALL_MODEL_AGENT), **fields}


def parse_int(answer: Any) -> int | None:
    if isinstance(answer, dict):
        answer = answer.get("answer")
    try:
        return int(str(answer).strip())
    except (TypeError, ValueError):
        return None


class ArithTask(AgentTask):
    name = "arith"
    tools: ClassVar[list[str]] = ["bash"]

    def validate(self, instance: dict) -> None:
        try:
            int(instance["a"]), int(instance["b"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidJob(
                "arith needs integer instance.a and instance.b, e.g. {\"a\": 3, \"op\": \"+\", \"b\": 4}"
            ) from e
        if instance.get("op") not in OPS:
            raise InvalidJob(f"arith: op must be one of {sorted(OPS)}")

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(limits=SandboxLimits(memory_mb=512, cpu_time_s=60, default_timeout_s=10,
                                                default_no_output_timeout_s=10, idle_timeout_s=600))

    def prompt_messages(self, instance: dict) -> list[dict]:
        return prompt(instance)

    def tool_schemas(self, instance: dict) -> list[dict]:
        return [BASH_SCHEMA]

    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        gold = expected(env.job.instance)
        submitted = eval_report.submitted_answer(env)
        if submitted is None:
            return eval_report.record(env, 0.0, "no answer: the agent never called submit with 'answer'",
                                      gold=gold)
        if isinstance(submitted, dict):
            return eval_report.record(env, 0.0, "submit was called without its 'answer' argument",
                                      submitted=str(submitted)[:200], gold=gold)
        answer = parse_int(submitted)
        if answer is None:
            return eval_report.record(env, 0.0, "the submitted answer is not an integer",
                                      submitted=str(submitted)[:200], gold=gold)
        if answer != gold:
            return eval_report.record(env, 0.0, "the submitted answer differs from a op b", predicted=answer, gold=gold)
        return eval_report.record(env, 1.0, "answer matches", predicted=answer, gold=gold)
