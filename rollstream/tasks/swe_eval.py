"""The ``swe`` task's eval, verified in a fresh sandbox (tasks/verification.py). The agent's
sandbox is stopped and its checkout read from the host; a new sandbox from the same spec gets a
pristine checkout at base_commit, where the image's own git rebuilds the agent's changes (test
files, the test runner's own files, symlinks and special files never come along); then the
instance's ``test_patch`` is applied and FAIL_TO_PASS / PASS_TO_PASS run with pytest under a
time limit: reward 1 only if every one passes. Nothing the agent left outside its checkout's
files, and none of its processes, reaches the tests."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

from rollstream.messages import Envelope
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report, swe_records, verification
from rollstream.tasks.base import TaskContext
from rollstream.trajectory import Trajectory

if TYPE_CHECKING:
    from rollstream.sandbox_spec import SandboxSpec


class SweTask(Protocol):
    """What verification needs of the SWE task (tasks/swe.py), named here so that the task
    can import its eval without the eval importing the task back."""

    def repo_dir(self, instance: dict, workdir: str = "/workspace") -> str: ...

    def sandbox_spec(self, instance: dict) -> SandboxSpec: ...

    async def prepare(self, env: Envelope, sandbox: SandboxClient) -> None: ...

_PLUGIN_SOURCE = Path(__file__).with_name("swe_report_plugin.py")
EVAL_DIR = "/tmp/.rs-eval"
_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.MULTILINE)
# Files the agent may not change in its favour: the tests are the task's, not the agent's.
_TEST_GLOBS = ("**/tests/**", "**/test/**", "**/test_*.py", "**/*_test.py", "**/conftest.py")
# Files at the checkout's top that configure or replace the test runner: `python -m pytest`
# imports from the checkout first, so a `pytest` package there would be the runner.
_RUNNER_PATHS = ("pytest.py", "pytest", "_pytest", "py.py", "pluggy", "rs_swe_report.py", "sitecustomize.py",
                 "usercustomize.py", "pytest.ini", ".pytest.ini")
# A symlink (120000) or a submodule (160000) that the agent's change adds or alters.
_LINK_CHANGE = re.compile(r"^(?:new file mode|new mode|index \S+) (120000|160000)$", re.MULTILINE)
_CHANGED_PATH = re.compile(r"^diff --git a/\S+ b/(\S+)$", re.MULTILINE)
MODEL_PATCH_MAX_CHARS = 100_000
PYTEST_USAGE_ERROR = 4
OUTPUT_TAIL_BYTES = 3000
# Creating the fresh sandbox and checking base_commit out again, on top of the tests' own limit.
FRESH_SANDBOX_ALLOWANCE_S = 120.0


def patch_paths(patch: str) -> list[str]:
    """Files a unified git diff touches."""
    return sorted({p for pair in _DIFF_PATH.findall(patch or "") for p in pair})


def test_ids(instance: dict, field: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list; SWE-bench stores them as JSON strings."""
    return swe_records.test_list(instance.get(field), field)


def excluded_pathspecs(inst: dict) -> list[str]:
    """The git pathspecs that keep the tests and the runner's files out of the agent's diff."""
    excludes = [f":(exclude){p}" for p in patch_paths(inst["test_patch"])]
    excludes += [f":(exclude,glob){g}" for g in _TEST_GLOBS]
    excludes += [f":(exclude,top){p}" for p in _RUNNER_PATHS] + [":(exclude,glob)**/*.pth"]
    return excludes


async def _sh(sandbox: SandboxClient, command: str, timeout_s: float = 60):
    return await sandbox.bash(command, timeout_s=timeout_s, no_output_timeout_s=0, session="rs-eval")


async def score(task: SweTask, env: Envelope, ctx: TaskContext) -> float:
    limit_s = eval_report.eval_timeout_s(env.job.instance, default=120.0)
    return await eval_report.within_limit(env, limit_s + 60 + FRESH_SANDBOX_ALLOWANCE_S,
                                          lambda: _verify(task, env, ctx, limit_s))


async def _verify(task: SweTask, env: Envelope, ctx: TaskContext, limit_s: float) -> float:
    inst = swe_records.normalize(env.job.instance)
    agent = verification.agent_handle(env, ctx)
    repo = PurePosixPath(task.repo_dir(inst, agent.workdir))
    env.trajectory = env.trajectory or Trajectory()
    record: dict[str, Any] = {"fresh_sandbox": True}
    env.trajectory.extra["verification"] = record
    tree, agent_patch = None, ""
    try:
        if repo.is_relative_to(agent.workdir):
            record["processes_killed_first"] = await asyncio.to_thread(verification.stop_processes, agent)
            inside = repo.relative_to(agent.workdir)
            checkout = inside.parts[0] if inside.parts else ""
            record["left_behind"] = verification.left_behind(agent.host_workdir, checkout)
            tree = await asyncio.to_thread(verification.read_tree, os.path.join(agent.host_workdir, str(inside)))
        else:
            # A published image's checkout (SWE-bench's /testbed) lies outside the workdir, out of
            # the host's reach: its diff comes from the agent's own git, before its processes die
            # with its sandbox. Whatever that says is only ever a diff, rebuilt and filtered below.
            record["diff_from_agent_sandbox"] = True
            agent_patch = await agent_diff(verification.agent_client(ctx), str(repo), inst["base_commit"],
                                           excluded_pathspecs(inst))
    except verification.VerificationRefused as refused:
        return eval_report.record(env, 0.0, str(refused))
    sandbox = await verification.fresh_sandbox(env, ctx, task.sandbox_spec(env.job.instance))
    try:  # connected already: `async with` would connect a second time
        await task.prepare(env, sandbox)
        model_patch, problem = await _rebuild_changes(sandbox, inst, str(repo), tree, agent_patch)
        env.trajectory.extra["model_patch"] = model_patch[:MODEL_PATCH_MAX_CHARS]
        if problem:
            return eval_report.record(env, 0.0, problem)
        return await apply_and_test(env, sandbox, inst, str(repo), model_patch, limit_s)
    finally:
        await sandbox.close()


async def agent_diff(sandbox: SandboxClient, repo: str, base: str, excludes: list[str]) -> str:
    """The diff of ``repo`` against ``base`` as the git of ``sandbox`` gives it (in place)."""
    q = shlex.quote
    diff = await _sh(sandbox, f"mkdir -p {EVAL_DIR} && cd {q(repo)} && git add -A && git diff --cached --binary "
                              f"{q(base)} -- . {' '.join(q(e) for e in excludes)} > {EVAL_DIR}/agent.patch")
    if diff.exit_code != 0:
        raise verification.VerificationRefused(f"could not take the diff of the repository: {diff.output[-500:]}")
    return (await sandbox.read_file(f"{EVAL_DIR}/agent.patch")).decode("utf-8", "replace")


async def _rebuild_changes(sandbox: SandboxClient, inst: dict, repo: str, tree: verification.AgentTree | None,
                           agent_patch: str) -> tuple[str, str]:
    """The agent's changes as a diff taken by the fresh sandbox's git (``repo`` stays at
    base_commit), and why they are refused ("" if they are not)."""
    q, work = shlex.quote, f"{EVAL_DIR}/agent"
    base = q(inst["base_commit"])
    excludes = " ".join(q(e) for e in excluded_pathspecs(inst))
    await _sh(sandbox, f"mkdir -p {work}/tree")
    if tree is not None:
        # The agent's files in a folder of their own, diffed against base_commit through a
        # separate index: the checkout the tests run in is never written by tar.
        excludes += " " + " ".join(q(e) for e in verification.rebuild_pathspecs())
        await sandbox.write_file(f"{work}/tree.tar", tree.tar)
        command = (f"tar -x --no-same-owner -f {work}/tree.tar -C {work}/tree && cd {work}/tree && "
                   f"GIT_DIR={q(repo)}/.git GIT_WORK_TREE={work}/tree GIT_INDEX_FILE={work}/index "
                   f"sh -c 'git read-tree \"$0\" && git add -A && git diff --cached --binary \"$0\" -- . \"$@\"' "
                   f"{base} {excludes} > {work}/model.patch")
    else:
        await sandbox.write_file(f"{work}/agent.patch", agent_patch)
        command = (f"cd {q(repo)} && {{ ! test -s {work}/agent.patch || "
                   f"git apply --whitespace=nowarn {work}/agent.patch; }} && git add -A && "
                   f"git diff --cached --binary {base} -- . {excludes} > {work}/model.patch; status=$?; "
                   f"git reset -q --hard {base} && git clean -qfdx && exit $status")
    rebuilt = await _sh(sandbox, command, timeout_s=120)
    if rebuilt.exit_code != 0:
        return "", f"the agent's changes could not be rebuilt on base_commit: {rebuilt.output[-800:]}"
    model_patch = (await sandbox.read_file(f"{work}/model.patch")).decode("utf-8", "replace")
    problems = [f"special files refused: {', '.join(tree.refused[:20])}"] if tree is not None and tree.refused else []
    links = _links_changed(model_patch)
    if links:
        problems.append(f"symlinks or submodules refused: {', '.join(links[:20])}")
    return model_patch, "; ".join(problems)


def _links_changed(patch: str) -> list[str]:
    """The files of ``patch`` that it makes (or keeps, changed) a symlink or a submodule."""
    found = []
    sections = _CHANGED_PATH.split(patch)
    for path, body in zip(sections[1::2], sections[2::2]):
        if _LINK_CHANGE.search(body.split("\n---", 1)[0].split("\nGIT binary patch", 1)[0]):
            found.append(path)
    return found


async def apply_and_test(env: Envelope, sandbox: SandboxClient, inst: dict, repo: str, model_patch: str,
                         limit_s: float) -> float:
    """Apply the agent's diff and the instance's test_patch to ``repo`` (at base_commit) in
    ``sandbox``, run the tests, record the outcome."""
    q = shlex.quote
    await _sh(sandbox, f"mkdir -p {EVAL_DIR}")
    await sandbox.write_file(f"{EVAL_DIR}/model.patch", model_patch)
    await sandbox.write_file(f"{EVAL_DIR}/test.patch", inst["test_patch"])
    await sandbox.write_file(f"{EVAL_DIR}/rs_swe_report.py", _PLUGIN_SOURCE.read_bytes())
    if model_patch.strip():
        applied = await _sh(sandbox, f"cd {q(repo)} && git apply --whitespace=nowarn {EVAL_DIR}/model.patch")
        if applied.exit_code != 0:
            return eval_report.record(env, 0.0, "the agent's diff does not apply to base_commit", output=applied.output)
    if inst["test_patch"].strip():
        applied = await _sh(sandbox, f"cd {q(repo)} && git apply --whitespace=nowarn {EVAL_DIR}/test.patch")
        if applied.exit_code != 0:
            return eval_report.record(env, 0.0, "the instance's test_patch does not apply after the agent's diff "
                                      "(did the agent edit the tests?)", output=applied.output)
    return await _run_tests(env, sandbox, inst, repo, limit_s)


async def _pytest(sandbox: SandboxClient, inst: dict, repo: str, limit_s: float, tests: list[str],
                  prefix: str = "") -> tuple[Any, dict | None]:
    """One pytest run of `tests`; returns the bash result and the plugin's report (None if none)."""
    q = shlex.quote
    report = f"{EVAL_DIR}/report.json"
    test_command = inst.get("test_command", "python -m pytest")
    command = (f"cd {q(repo)} && rm -f {report} && {prefix}ROLLSTREAM_SWE_REPORT={report} "
               f"PYTHONPATH={EVAL_DIR}${{PYTHONPATH:+:$PYTHONPATH}} "
               f"timeout -k 2 {limit_s:g} {test_command} -p rs_swe_report -p no:cacheprovider -q "
               f"{' '.join(q(t) for t in tests)} 2>&1 "
               f"| tail -c {OUTPUT_TAIL_BYTES}; echo \"tests exit ${{PIPESTATUS[0]}}\"")
    result = await _sh(sandbox, command, timeout_s=limit_s + 10)
    try:
        return result, json.loads(await sandbox.read_file(report))
    except Exception:  # no report: pytest was killed, crashed or never started
        return result, None


async def _run_tests(env: Envelope, sandbox: SandboxClient, inst: dict, repo: str, limit_s: float) -> float:
    fail_to_pass, pass_to_pass = test_ids(inst, "FAIL_TO_PASS"), test_ids(inst, "PASS_TO_PASS")
    tests = list(dict.fromkeys(fail_to_pass + pass_to_pass))
    # As the harness does: run the test files, then read each listed test's outcome (a
    # thousand ids on one command line, or ids with spaces, need not survive the shell).
    targets = list(dict.fromkeys(t.split("::")[0] if "::" in t else t for t in tests))
    result, report = await _pytest(sandbox, inst, repo, limit_s, targets)
    fallback = ""
    usage_error = f"tests exit {PYTEST_USAGE_ERROR}" in result.output or (
        report is not None and report.get("exitstatus") == PYTEST_USAGE_ERROR)
    if usage_error and inst.get("env", {}).get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        # The instance turned plugin autoload off, and the project's configuration needs a
        # plugin (setup.cfg's --cov...): run as the project configures it.
        fallback = ("; pytest stopped with a usage error with PYTEST_DISABLE_PLUGIN_AUTOLOAD set, "
                    "so the tests ran again with plugin autoload on")
        result, report = await _pytest(sandbox, inst, repo, limit_s, targets,
                                       prefix="env -u PYTEST_DISABLE_PLUGIN_AUTOLOAD ")
    if report is None:
        why = "timed out" if result.timed_out or "tests exit 124" in result.output else "crashed"
        return eval_report.record(env, 0.0, f"the test run {why} without a report (limit {limit_s:g} s){fallback}",
                                  output=result.output)
    outcomes = report["outcomes"]
    tests_outcome = {t: outcomes.get(t, "not run") for t in tests}
    failed = {t: outcomes.get(t, "not run") for t in fail_to_pass + pass_to_pass if outcomes.get(t) != "passed"}
    f2p_ok = sum(outcomes.get(t) == "passed" for t in fail_to_pass)
    p2p_ok = sum(outcomes.get(t) == "passed" for t in pass_to_pass)
    summary = f"FAIL_TO_PASS {f2p_ok}/{len(fail_to_pass)}, PASS_TO_PASS {p2p_ok}/{len(pass_to_pass)}"
    if failed:
        first = next(iter(failed.items()))
        return eval_report.record(env, 0.0, f"{summary}; {first[0]} {first[1]}{fallback}",
                                  failed=dict(list(failed.items())[:50]), tests=tests_outcome, output=result.output)
    return eval_report.record(env, 1.0, f"{summary}: resolved{fallback}", tests=tests_outcome, output=result.output)
