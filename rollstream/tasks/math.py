"""The ``math`` task: a question with a known answer. Run: the agent reasons (optionally
with an IPython tool) and gives its final answer in ``\\boxed{}`` or through ``submit``.
Eval: compare by value with ``math_answers.answers_match`` (reward 1 or 0).

Instance: {"question": str, "answer": str, "tools"?: ["ipython"] | [], "eval_timeout_s"?}
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.math_answers import MAX_ANSWER_CHARS, answers_match, extract_answer

_FIELDS = {"question", "answer", "tools", "eval_timeout_s", "system_prompt", "id", "source"}
_KNOWN_TOOLS = {"ipython", "bash"}

SYSTEM_PROMPT = (
    "You are a careful mathematician. Solve the problem step by step. When you are sure, give the "
    "final answer as \\boxed{...} (a number or a simplified expression), or call the submit tool "
    "with the answer."
)


class MathTask(AgentTask):
    name = "math"
    tools: ClassVar[list[str]] = []

    def validate(self, instance: dict) -> None:
        for field in ("question", "answer"):
            if not isinstance(instance.get(field), (str, int, float)) or str(instance.get(field)).strip() == "":
                raise InvalidJob(f"math needs instance.{field} as a non-empty string, e.g. "
                                 '{"question": "What is 1/2 + 1/4?", "answer": "3/4"}')
        if len(str(instance["answer"])) > MAX_ANSWER_CHARS:
            raise InvalidJob(f"math: answer is longer than {MAX_ANSWER_CHARS} characters")
        unknown = set(instance) - _FIELDS
        if unknown:
            raise InvalidJob(f"math does not know instance field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
        tools = instance.get("tools", self.tools)
        if not isinstance(tools, list) or not set(tools) <= _KNOWN_TOOLS:
            raise InvalidJob(f"math: tools must be a list drawn from {sorted(_KNOWN_TOOLS)}, got {tools!r}")
        eval_report.check_eval_timeout(instance)

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec()

    def prompt_messages(self, instance: dict) -> list[dict]:
        tools = self.tool_names(instance)
        hint = " You can run Python in an IPython tool." if "ipython" in tools else ""
        return [{"role": "system", "content": instance.get("system_prompt", SYSTEM_PROMPT) + hint},
                {"role": "user", "content": str(instance["question"])}]

    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        return await self.grade(env)

    async def grade(self, env: Envelope) -> float:
        """The reward without the sandbox: math needs none to score."""
        gold = str(env.job.instance["answer"])
        predicted = extract_answer(eval_report.submitted_answer(env), eval_report.response_text(env))
        if predicted is None:
            return eval_report.record(env, 0.0, "no answer: nothing submitted and no \\boxed{} in the response",
                                      gold=gold)

        async def compare() -> float:
            # sympy is CPU work: off the event loop, so the worker's other jobs keep moving.
            same = await asyncio.to_thread(answers_match, predicted, gold)
            reason = "answer matches" if same else "answer differs from the reference"
            return eval_report.record(env, 1.0 if same else 0.0, reason, predicted=predicted[:200], gold=gold)

        limit_s = eval_report.eval_timeout_s(env.job.instance, default=30.0)
        return await eval_report.within_limit(env, limit_s, compare)
