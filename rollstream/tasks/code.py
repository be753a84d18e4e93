"""The ``code`` task: write a program or function that passes unit tests. Run: the agent
writes ``solution.py`` in the sandbox (bash/editor tools) or submits the code as its
answer. Eval: the tests run *in the sandbox* under time and output limits
(``code_runner.py``); reward = fraction of cases passed, or 1/0 for all-pass.

Instance: {"prompt": str, "tests": str | [str], "entry_point"?: str,
"reward_mode"?: "fraction" | "all_pass", "solution_file"?: "solution.py", "files"?: {path: text},
"tools"?: [...], "eval_timeout_s"?: 60, "per_test_timeout_s"?: 10, "max_output_bytes"?: 1000000,
"reference_solution"?: str (never shown to the agent; for harness validation)}
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from pathlib import Path
from typing import Any, ClassVar

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.prompt_template import fill_prompt

_FIELDS = {"prompt", "tests", "entry_point", "reward_mode", "solution_file", "files", "tools", "eval_timeout_s",
           "per_test_timeout_s", "max_output_bytes", "reference_solution", "system_prompt", "id", "source"}
_RUNNER_SOURCE = Path(__file__).with_name("code_runner.py")
_EVAL_DIR = "/tmp/.rs-eval"
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OUTPUT_TAIL_BYTES = 3000

SYSTEM_PROMPT = (
    "You are an expert Python programmer working in a sandbox. Write your solution to {file} in the "
    "working directory (use the tools to create and test it), then call submit. You may instead "
    "submit the complete code as the answer, in a ```python block."
)


def extract_code(text: str) -> str | None:
    """The last fenced Python block of ``text``, or ``text`` itself if it is Python code."""
    blocks = _FENCE.findall(text or "")
    if blocks:
        return blocks[-1]
    try:
        compile(text, "<answer>", "exec")
    except (SyntaxError, ValueError):
        return None
    return text if re.search(r"^\s*(def|class|import|from)\s", text, re.MULTILINE) else None


class CodeTask(AgentTask):
    name = "code"
    tools: ClassVar[list[str]] = ["bash", "editor"]

    def validate(self, instance: dict) -> None:
        if not isinstance(instance.get("prompt"), str) or not instance["prompt"].strip():
            raise InvalidJob('code needs instance.prompt, e.g. {"prompt": "Write add(a, b)", '
                             '"tests": ["assert add(1, 2) == 3"], "entry_point": "add"}')
        tests = instance.get("tests")
        if isinstance(tests, list):
            if not tests or not all(isinstance(t, str) for t in tests):
                raise InvalidJob("code: tests must be a non-empty list of Python snippets (strings)")
        elif not isinstance(tests, str) or not tests.strip():
            raise InvalidJob("code: tests must be Python source (asserts, test_* functions or "
                             "check(candidate)) or a list of such snippets")
        for snippet in tests if isinstance(tests, list) else [tests]:
            try:
                compile(snippet, "<tests>", "exec")
            except SyntaxError as exc:
                raise InvalidJob(f"code: a test does not compile: {exc}") from None
        if instance.get("reward_mode", "all_pass") not in ("fraction", "all_pass"):
            raise InvalidJob("code: reward_mode must be 'fraction' or 'all_pass'")
        entry = instance.get("entry_point")
        if entry is not None and (not isinstance(entry, str) or not entry.isidentifier()):
            raise InvalidJob(f"code: entry_point must be a Python identifier, got {entry!r}")
        name = instance.get("solution_file", "solution.py")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\.py", name):
            raise InvalidJob("code: solution_file must be a plain module file name such as solution.py")
        fill_prompt(instance.get("system_prompt", SYSTEM_PROMPT), file=name)  # refused at submit, not at run
        unknown = set(instance) - _FIELDS
        if unknown:
            raise InvalidJob(f"code does not know instance field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
        for knob in ("per_test_timeout_s", "max_output_bytes"):
            value = instance.get(knob, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidJob(f"code: {knob} must be a positive number")
        eval_report.check_eval_timeout(instance)

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(files=dict(instance.get("files", {})))

    def prompt_messages(self, instance: dict) -> list[dict]:
        solution_file = instance.get("solution_file", "solution.py")
        system = fill_prompt(instance.get("system_prompt", SYSTEM_PROMPT), file=solution_file)
        user = instance["prompt"]
        if instance.get("entry_point"):
            user += f"\n\nDefine the function `{instance['entry_point']}` in {solution_file}."
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        limit_s = eval_report.eval_timeout_s(env.job.instance)
        # The in-sandbox limit fires first and reports; this one guards the call itself.
        return await eval_report.within_limit(env, limit_s + 15, lambda: self._run_tests(env, sandbox, limit_s))

    async def _solution_source(self, env: Envelope, sandbox: SandboxClient, path: str) -> tuple[str | None, str]:
        answer = eval_report.submitted_answer(env)
        if isinstance(answer, str) and answer.strip():
            code = extract_code(answer)
            if code is not None:
                return code, "the submitted answer"
        try:
            data = await sandbox.read_file(path)
            return data.decode("utf-8", "replace"), path
        except Exception:  # ToolError when the agent never wrote the file
            pass
        code = extract_code(eval_report.response_text(env))
        return (code, "the last code block of the response") if code else (None, "")

    async def _run_tests(self, env: Envelope, sandbox: SandboxClient, limit_s: float) -> float:
        inst = env.job.instance
        solution_file = inst.get("solution_file", "solution.py")
        code, origin = await self._solution_source(env, sandbox, solution_file)
        if code is None:
            return eval_report.record(env, 0.0, f"no solution: {solution_file} is missing and no code was submitted")
        await sandbox.write_file(solution_file, code)
        nonce = uuid.uuid4().hex
        report = f"{_EVAL_DIR}/{nonce}.json"
        job = {"solution": solution_file, "module": solution_file[:-3], "tests": inst["tests"],
               "entry_point": inst.get("entry_point"), "per_test_timeout_s": float(inst.get("per_test_timeout_s", 10)),
               "max_output_bytes": int(inst.get("max_output_bytes", 1_000_000)), "report": report}
        await sandbox.write_file(f"{_EVAL_DIR}/runner.py", _RUNNER_SOURCE.read_bytes())
        await sandbox.write_file(f"{_EVAL_DIR}/{nonce}.in", json.dumps(job))
        # `timeout` kills a runner stuck outside Python (C loops ignore the alarm); tail keeps
        # a flood of output from crossing the socket.
        command = (f"timeout -k 2 {limit_s:g} python3 {_EVAL_DIR}/runner.py < {_EVAL_DIR}/{nonce}.in 2>&1 "
                   f"| tail -c {OUTPUT_TAIL_BYTES}; echo \"runner exit ${{PIPESTATUS[0]}}\"")
        result = await sandbox.bash(command, timeout_s=limit_s + 10, no_output_timeout_s=0, session="rs-eval")
        try:
            lines = (await sandbox.read_file(report)).decode("utf-8", "replace").splitlines()
        except Exception:  # ToolError: the runner died before it opened its report
            lines = []
        finally:
            await sandbox.bash(f"rm -f {shlex.quote(report)} {_EVAL_DIR}/{nonce}.in", timeout_s=10, session="rs-eval")
        return self._score_report(env, lines, result, limit_s, origin)

    @staticmethod
    def _score_report(env: Envelope, lines: list[str], result: Any, limit_s: float, origin: str) -> float:
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by the kill
        header = entries[0] if entries else {}
        cases = [e for e in entries if "name" in e]
        tests = env.job.instance["tests"]
        total = max(1, int(header.get("total", len(tests) if isinstance(tests, list) else 1)))
        passed = sum(1 for c in cases if c["ok"])
        failures = [f"{c['name']}: {c['error']}" for c in cases if not c["ok"]]
        if header.get("load_error"):
            failures = [f"the solution failed to load: {header['load_error']}"]
        elif not any(e.get("done") for e in entries):
            why = "timed out" if result.timed_out or "runner exit 124" in result.output else "crashed"
            failures.append(f"the test run {why} after {len(cases)} of {total} cases (eval_timeout_s={limit_s:g})")
        mode = env.job.instance.get("reward_mode", "all_pass")
        reward = passed / total if mode == "fraction" else float(passed == total)
        reason = f"{passed}/{total} test cases passed" + (f"; {failures[0]}" if failures else "")
        return eval_report.record(env, reward, reason, passed=passed, total=total, failures=failures[:20],
                                  solution=origin, output=result.output)
