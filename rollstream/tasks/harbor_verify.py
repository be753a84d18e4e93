"""The ``harbor`` task's eval, verified in a fresh sandbox (tasks/verification.py): the agent's
sandbox is stopped and its whole workdir read from the host (verification.read_tree, whole:
folders and regular files, .git included; symlinks only where the pristine image has the same
one; special files refused); a new sandbox from the pristine image gets the workdir as the
Dockerfile left it, then the agent's tree over it (and what it deleted removed). The task's
``tests/`` go to /tests and ``tests/test.sh`` runs there under task.toml's ``[verifier]
timeout_sec``; its reward file gives the reward: /logs/verifier/reward.txt (a number), else
reward.json (``{"reward": x, ...}``, every field kept). Per-test outcomes are kept where the tests
report them: a CTRF report (/logs/verifier/ctrf.json), else pytest's "short test summary info"
(``-rA``, as Terminal-Bench's run-tests.sh asks for) in test.sh's output. Nothing the agent left
outside its workdir, and none of its processes, reaches the tests.

A test.sh that runs past its limit scores 0 with the reason; one that writes no reward, or no
number, fails the job (failure 'task': the task folder's verifier is broken, not the agent).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex

from rollstream.errors import JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.errors import ToolError
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report, verification
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor_folder import TaskFolder
from rollstream.tasks.harbor_image import STATE_DIR

EVAL_DIR = f"{STATE_DIR}/eval"
VERIFIER_DIR = f"{STATE_DIR}/logs/verifier"
# Creating the fresh sandbox and rebuilding the agent's workdir, on top of test.sh's own limit.
FRESH_SANDBOX_ALLOWANCE_S = 120.0
REWARD_MAX_BYTES = 1 << 20
OUTPUT_TAIL_BYTES = 3000
MAX_TESTS_KEPT = 200
SUMMARY_TAIL_BYTES = 256 << 10  # where test.sh's output is searched for pytest's short summary
# pytest's -r outcomes in CTRF's words (CTRF: passed, failed, skipped, pending, other).
PYTEST_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped",
                   "XFAIL": "other", "XPASS": "other"}


class RewardMissing(JobFailed):
    """test.sh wrote no usable reward: the task's verifier is broken (failure 'task')."""

    def __init__(self, message: str):
        super().__init__(message, retryable=False, failure="task")


async def _sh(sandbox: SandboxClient, command: str, timeout_s: float = 120):
    return await sandbox.bash(command, timeout_s=timeout_s, no_output_timeout_s=0, session="rs-eval")


async def score(env: Envelope, ctx: TaskContext, folder: TaskFolder, spec: SandboxSpec) -> float:
    """Verify the job's episode of ``folder``; ``spec`` is the pristine sandbox the tests run in."""
    limit_s = folder.config.verifier.timeout_sec
    return await eval_report.within_limit(env, limit_s + 30 + FRESH_SANDBOX_ALLOWANCE_S,
                                          lambda: _verify(folder, spec, env, ctx, limit_s))


async def _verify(folder: TaskFolder, spec: SandboxSpec, env: Envelope, ctx: TaskContext, limit_s: float) -> float:
    agent = verification.agent_handle(env, ctx)
    await asyncio.to_thread(verification.stop_processes, agent)
    try:
        tree = await asyncio.to_thread(verification.read_tree, agent.host_workdir, whole=True)
    except verification.VerificationRefused as refused:
        return eval_report.record(env, 0.0, str(refused))
    if tree.refused:
        return eval_report.record(env, 0.0, f"special files refused in the workdir: {', '.join(tree.refused[:20])}")
    tests = await asyncio.to_thread(folder.files, "tests")
    sandbox = await verification.fresh_sandbox(env, ctx, spec)
    async with sandbox:
        problem = await apply_agent_tree(sandbox, tree.tar, spec.workdir)
        if problem:
            return eval_report.record(env, 0.0, problem)
        await sandbox.write_file(f"{EVAL_DIR}/tests.tar", tests.tar())
        return await run_tests(env, sandbox, folder, spec.workdir, limit_s)


async def apply_agent_tree(sandbox: SandboxClient, tar: bytes, workdir: str) -> str:
    """Make ``workdir`` (pristine) hold the agent's tree: its files over it, the files it deleted
    removed; returns why the tree is refused ("" if it is not)."""
    q = shlex.quote
    agent, work = f"{EVAL_DIR}/agent", q(workdir)
    await _sh(sandbox, f"mkdir -p {agent}")
    await sandbox.write_file(f"{EVAL_DIR}/agent.tar", tar)
    # A symlink the agent added or pointed elsewhere is refused: the tests would follow it.
    result = await _sh(sandbox, (
        f"(set -e; tar -x --no-same-owner -f {EVAL_DIR}/agent.tar -C {agent}; cd {agent}; "
        "find . -type l -print0 | while IFS= read -r -d '' link; do "
        f"  if [ ! -L {work}/\"$link\" ] || [ \"$(readlink \"$link\")\" != \"$(readlink {work}/\"$link\")\" ]; then "
        "    printf 'refused link %s\\n' \"${link#./}\"; fi; done)"))
    if result.exit_code != 0:
        return f"the agent's workdir could not be unpacked for verification: {result.output[-800:]}"
    refused = [line.removeprefix("refused link ") for line in result.output.splitlines()
               if line.startswith("refused link ")]
    if refused:
        return f"symlinks refused (added or changed by the agent): {', '.join(refused[:20])}"
    # What the agent removed, or turned from a file into a folder or back, goes first; then its
    # tree is unpacked over the rest.
    result = await _sh(sandbox, (
        f"(set -e; cd {work}; "
        "find . \\( -type f -o -type l \\) -print0 | while IFS= read -r -d '' path; do "
        f"  if [ -L {agent}/\"$path\" ] || {{ [ -e {agent}/\"$path\" ] && [ ! -d {agent}/\"$path\" ]; }}; then :; "
        "  else rm -f -- \"$path\"; fi; done; "
        "find . -mindepth 1 -depth -type d -print0 | while IFS= read -r -d '' path; do "
        f"  if [ -d {agent}/\"$path\" ] && [ ! -L {agent}/\"$path\" ]; then :; else rm -rf -- \"$path\"; fi; done; "
        f"tar -x --no-same-owner -f {EVAL_DIR}/agent.tar -C {work}; rm -rf {agent} {EVAL_DIR}/agent.tar)"))
    if result.exit_code != 0:
        return f"the agent's workdir could not be rebuilt on the pristine image: {result.output[-800:]}"
    return ""


async def run_tests(env: Envelope, sandbox: SandboxClient, folder: TaskFolder, workdir: str, limit_s: float) -> float:
    """tests/ into /tests, test.sh run in ``workdir``, the reward file read and recorded."""
    q = shlex.quote
    variables = " ".join(q(f"{name}={value}") for name, value in folder.config.verifier.env.items())
    result = await _sh(sandbox, (
        f"rm -rf {STATE_DIR}/tests/* {VERIFIER_DIR}/*; mkdir -p {STATE_DIR}/tests {VERIFIER_DIR} && "
        f"tar -x --no-same-owner -f {EVAL_DIR}/tests.tar -C {STATE_DIR}/tests && cd {q(workdir)} && "
        f"env {variables} timeout -k 5 {limit_s:g} bash /tests/test.sh > {VERIFIER_DIR}/test-stdout.txt 2>&1; "
        f"echo \"rs-test-exit $?\"; tail -c {OUTPUT_TAIL_BYTES} {VERIFIER_DIR}/test-stdout.txt"),
        timeout_s=limit_s + 30)
    first = result.output.splitlines()[0] if result.output else ""
    status = first.removeprefix("rs-test-exit ").strip()
    output = result.output[len(first) + 1:]
    if result.timed_out or status in ("124", "137"):
        return eval_report.record(env, 0.0, f"tests/test.sh timed out after {limit_s:g} s (task.toml [verifier] "
                                  "timeout_sec)", output=output)
    summary = await _sh(sandbox, f"tail -c {SUMMARY_TAIL_BYTES} {VERIFIER_DIR}/test-stdout.txt | "
                                 "sed -n '/short test summary info/,$p'")
    details = await read_reward(sandbox, folder, status, output, summary.output)
    reward = details.pop("reward")
    return eval_report.record(env, reward, f"tests/test.sh exited {status}; reward {reward:g} from "
                              f"{details.pop('source')}", output=output, **details)


async def _read(sandbox: SandboxClient, name: str) -> bytes | None:
    try:
        return await sandbox.read_file(f"{VERIFIER_DIR}/{name}", max_bytes=REWARD_MAX_BYTES)
    except ToolError:
        return None


async def read_reward(sandbox: SandboxClient, folder: TaskFolder, status: str, output: str,
                      summary: str = "") -> dict:
    """The reward (and reward.json's other fields, per-test outcomes from CTRF or else from pytest's
    ``summary``) test.sh reported; raises RewardMissing when it reported none."""
    details: dict = {}
    ctrf = await _read(sandbox, "ctrf.json")
    tests = ctrf_outcomes(ctrf) if ctrf is not None else pytest_summary_outcomes(summary)
    if tests or ctrf is not None:
        details["tests"] = tests
    text = await _read(sandbox, "reward.txt")
    if text is not None:
        try:
            value = float(text.decode("utf-8").strip())
        except (UnicodeDecodeError, ValueError):
            raise RewardMissing(f"harbor task {folder.name}: tests/test.sh wrote {text[:80]!r} to "
                                "/logs/verifier/reward.txt, not a number; fix the task's test.sh "
                                f"(exit {status}; its output ends: {output[-500:]})") from None
        return {**details, **_checked(value, folder, "reward.txt"), "source": "reward.txt"}
    data = await _read(sandbox, "reward.json")
    if data is None:
        raise RewardMissing(f"harbor task {folder.name}: tests/test.sh wrote no /logs/verifier/reward.txt or "
                            f"reward.json; fix the task's test.sh (exit {status}; its output ends: {output[-500:]})")
    try:
        metrics = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        metrics = None
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))} if isinstance(metrics, dict) else {}
    if "reward" in numbers or len(numbers) == 1:
        value = numbers.get("reward", next(iter(numbers.values()), 0.0))
        return {**details, **_checked(float(value), folder, "reward.json"), "metrics": metrics,
                "source": "reward.json"}
    raise RewardMissing(f"harbor task {folder.name}: /logs/verifier/reward.json is {data[:120]!r}, not an object "
                        "with a numeric 'reward' (or a single number); fix the task's test.sh")


def _checked(value: float, folder: TaskFolder, source: str) -> dict:
    if not math.isfinite(value):
        raise RewardMissing(f"harbor task {folder.name}: {source} holds {value}, not a finite number")
    return {"reward": value}


def ctrf_outcomes(data: bytes) -> dict[str, str]:
    """Per-test outcomes of a CTRF report (pytest --ctrf, as Terminal-Bench's tests write it)."""
    try:
        tests = json.loads(data)["results"]["tests"]
        return {str(t["name"]): str(t["status"]) for t in tests[:MAX_TESTS_KEPT]}
    except (ValueError, KeyError, TypeError):
        return {}


def pytest_summary_outcomes(text: str) -> dict[str, str]:
    """Per-test outcomes of pytest's last "short test summary info" section in ``text`` (``-rA``
    lists every test: ``PASSED path::test``, ``FAILED path::test - message``; a skipped one by its
    place, ``path.py:9``), in CTRF's words."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "short test summary info" in line]
    outcomes: dict[str, str] = {}
    for line in lines[starts[-1] + 1:] if starts else ():
        if line.startswith("="):
            break
        word, _, rest = line.partition(" ")
        name = rest.split(" - ", 1)[0].strip()
        if word == "SKIPPED":  # "SKIPPED [1] path.py:9: reason": pytest names the place, not the test
            name = rest.partition("] ")[2].split(": ", 1)[0] if rest.startswith("[") else name
        if word in PYTEST_OUTCOMES and name and len(outcomes) < MAX_TESTS_KEPT:
            outcomes[name] = PYTEST_OUTCOMES[word]
    return outcomes
