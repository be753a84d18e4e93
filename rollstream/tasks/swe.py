"""The ``swe`` task: fix an issue in a repository, SWE-bench style. Init clones the
repository at ``base_commit`` from the local mirror into the sandbox; the agent edits it
with bash/editor. Eval takes the agent's diff (test files excluded), resets the checkout,
applies that diff and the instance's ``test_patch``, runs FAIL_TO_PASS and PASS_TO_PASS
with pytest under a time limit: reward 1 only if every one passes.

Instance: a SWE-bench / SWE-Gym / SWE-smith / R2E-Gym record (swe_records.py makes the
field names canonical; the repo as owner/name, URL or local path) plus optional
repo_mirror, eval_timeout_s, test_command, env (sandbox environment), tools, and the
environment: an ``image`` or a recipe (swe_env.py) built once by ``rollstream images build``.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from pathlib import Path
from typing import Any, ClassVar

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.env_images import ENV_PYTHON, env_variables
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report, swe_env, swe_records, swe_repos
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.prompt_template import fill_prompt
from rollstream.trajectory import Trajectory

SHIPPED_INSTANCES = Path(__file__).resolve().parent.parent / "data" / "swe" / "instances.jsonl"
_PLUGIN_SOURCE = Path(__file__).with_name("swe_report_plugin.py")
_EVAL_DIR = "/tmp/.rs-eval"
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement")
_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.MULTILINE)
# Files the agent may not change in its favour: the tests are the task's, not the agent's.
_TEST_GLOBS = ("**/tests/**", "**/test/**", "**/test_*.py", "**/*_test.py", "**/conftest.py")
# Caches and build/install debris (pip install -e ., setup.py build) never enter the agent's
# diff; the ignore applies to untracked files only, so a tracked build/ folder still counts.
_LOCAL_IGNORES = ("__pycache__/\n*.pyc\n.pytest_cache/\n.ipynb_checkpoints/\n*.egg-info/\n.eggs/\nbuild/\n"
                  "dist/\npip-wheel-metadata/\n.mypy_cache/\n.ruff_cache/\n.tox/\n.nox/\n.coverage\n.cache/\n")
MODEL_PATCH_MAX_CHARS = 100_000
# Plugin autoload stays as the project configures it (the SWE-bench harness does not turn it
# off): a setup.cfg passing --cov needs pytest-cov loaded.
DEFAULT_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
PYTEST_USAGE_ERROR = 4
OUTPUT_TAIL_BYTES = 3000

SYSTEM_PROMPT = (
    "You are a software engineer working in a sandbox. The repository is checked out at {repo_dir}. "
    "Fix the issue below by editing the source code (bash and editor tools). Do not change the tests: "
    "hidden tests will check your fix. Call submit when you are done."
)


def test_ids(instance: dict, field: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list; SWE-bench stores them as JSON strings."""
    return swe_records.test_list(instance.get(field), field)


def patch_paths(patch: str) -> list[str]:
    """Files a unified git diff touches."""
    return sorted({p for pair in _DIFF_PATH.findall(patch or "") for p in pair})


def load_instances(path: Path = SHIPPED_INSTANCES) -> list[dict]:
    """SWE-bench-format records from a JSONL file (the shipped set by default)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class SweTask(AgentTask):
    name = "swe"
    tools: ClassVar[list[str]] = ["bash", "editor"]

    # -- instance ----------------------------------------------------------------------
    def validate(self, instance: dict) -> None:
        instance = swe_records.normalize(instance)
        missing = [f for f in _REQUIRED if f not in instance]
        if missing:
            raise InvalidJob(f"swe instance lacks {missing}; it needs the SWE-bench fields {list(_REQUIRED)} "
                             f"(or their SWE-smith/R2E-Gym names: {swe_records.ALIASES})")
        for field in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
            if not isinstance(instance[field], str):
                raise InvalidJob(f"swe: {field} must be a string")
        swe_env.env_recipe(instance)  # a malformed recipe fails here, not at init
        if not re.fullmatch(r"[0-9a-fA-F]{7,64}", instance["base_commit"]):
            raise InvalidJob(f"swe: base_commit must be a hexadecimal commit id, got {instance['base_commit']!r}")
        if not test_ids(instance, "FAIL_TO_PASS") + test_ids(instance, "PASS_TO_PASS"):
            raise InvalidJob("swe: FAIL_TO_PASS and PASS_TO_PASS are both empty; nothing would be tested")
        env = instance.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidJob("swe: env must map variable names to strings")
        self.mirror(instance)
        self.prompt_messages(instance)  # a system_prompt with fields it will not fill fails here
        if "test_command" in instance and not isinstance(instance["test_command"], str):
            raise InvalidJob("swe: test_command must be a string such as 'python -m pytest'")
        eval_report.check_eval_timeout(instance)

    def repo_dir(self, instance: dict, workdir: str = "/workspace") -> str:
        return swe_env.repo_dir(swe_records.normalize(instance), workdir)

    def mirror(self, instance: dict) -> Path:
        """The instance's ``repo_mirror``, else the default; ``swe_repos`` checks it against the
        operator's allowed folders before reading anything there."""
        if instance.get("repo_mirror") and not isinstance(instance["repo_mirror"], str):
            raise InvalidJob("swe: repo_mirror must be a folder path (a string)")
        return Path(instance["repo_mirror"]) if instance.get("repo_mirror") else swe_repos.default_mirror()

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        inst = swe_records.normalize(instance)
        if swe_env.recipe_fields(inst) is not None:
            return SandboxSpec(image=swe_env.sandbox_image(inst), python=ENV_PYTHON,
                               env={**env_variables(), **DEFAULT_ENV, **inst.get("env", {})})
        return SandboxSpec(image=inst.get("image") or None, env={**DEFAULT_ENV, **inst.get("env", {})})

    def prompt_messages(self, instance: dict) -> list[dict]:
        instance = swe_records.normalize(instance)
        system = fill_prompt(instance.get("system_prompt", SYSTEM_PROMPT), repo_dir=self.repo_dir(instance))
        return [{"role": "system", "content": system}, {"role": "user", "content": instance["problem_statement"]}]

    # -- init --------------------------------------------------------------------------
    async def prepare(self, env: Envelope, sandbox: SandboxClient) -> None:
        inst = swe_records.normalize(env.job.instance)
        if inst.get("repo_dir"):
            return await self._use_image_checkout(inst, sandbox)
        roots = swe_repos.MirrorRoots.from_settings()
        bundle = await asyncio.to_thread(swe_repos.bundle, inst["repo"], inst["base_commit"], self.mirror(inst),
                                         inst.get("repo_path"), roots)
        inner = f"/tmp/.rs-swe-{inst['base_commit'][:12]}.bundle"
        await sandbox.write_file(inner, await asyncio.to_thread(swe_repos.read_bundle, bundle, roots))
        repo = self.repo_dir(inst, env.sandbox.workdir)
        q = shlex.quote
        result = await sandbox.bash(
            f"git clone -q --no-checkout {inner} {q(repo)} && cd {q(repo)} && "
            f"git -c advice.detachedHead=false checkout -q --detach {q(inst['base_commit'])} && "
            "git config user.name agent && git config user.email agent@sandbox.invalid && "
            f"printf %s {q(_LOCAL_IGNORES)} >> .git/info/exclude && git remote remove origin; "
            f"rm -f {inner}; cd {q(repo)} && git rev-parse HEAD", timeout_s=120)
        if result.exit_code != 0 or inst["base_commit"] not in result.output:
            raise swe_repos.MirrorError(f"could not check out {inst['repo']}@{inst['base_commit']} in the "
                                        f"sandbox: {result.output[-800:]}")

    async def _use_image_checkout(self, inst: dict, sandbox: SandboxClient) -> None:
        """A published image (SWE-bench's /testbed) already holds the repository: check
        base_commit out there instead of cloning."""
        q = shlex.quote
        repo = inst["repo_dir"]
        result = await sandbox.bash(
            f"cd {q(repo)} && git -c advice.detachedHead=false checkout -q --detach {q(inst['base_commit'])} && "
            "git config user.name agent && git config user.email agent@sandbox.invalid && "
            f"printf %s {q(_LOCAL_IGNORES)} >> .git/info/exclude && git rev-parse HEAD", timeout_s=120)
        if result.exit_code != 0 or inst["base_commit"] not in result.output:
            raise swe_repos.MirrorError(f"the image's checkout {repo} cannot be put at {inst['base_commit']}: "
                                        f"{result.output[-800:]}")

    # -- eval --------------------------------------------------------------------------
    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        limit_s = eval_report.eval_timeout_s(env.job.instance, default=120.0)
        return await eval_report.within_limit(env, limit_s + 60, lambda: self._evaluate(env, sandbox, limit_s))

    async def _sh(self, sandbox: SandboxClient, command: str, timeout_s: float = 60):
        return await sandbox.bash(command, timeout_s=timeout_s, no_output_timeout_s=0, session="rs-eval")

    async def _evaluate(self, env: Envelope, sandbox: SandboxClient, limit_s: float) -> float:
        inst = swe_records.normalize(env.job.instance)
        q = shlex.quote
        repo, base = self.repo_dir(inst, env.sandbox.workdir), inst["base_commit"]
        excludes = [f":(exclude){p}" for p in patch_paths(inst["test_patch"])]
        excludes += [f":(exclude,glob){g}" for g in _TEST_GLOBS]
        diff = await self._sh(sandbox, (
            f"mkdir -p {_EVAL_DIR} && cd {q(repo)} && printf %s {q(_LOCAL_IGNORES)} >> .git/info/exclude && "
            "git add -A && "
            f"git diff --cached --binary {q(base)} -- . {' '.join(q(e) for e in excludes)} > {_EVAL_DIR}/model.patch"
            f" && wc -c < {_EVAL_DIR}/model.patch"))
        if diff.exit_code != 0:
            return eval_report.record(env, 0.0, "could not take the diff of the repository (was .git removed?)",
                                      output=diff.output)
        model_patch = (await sandbox.read_file(f"{_EVAL_DIR}/model.patch")).decode("utf-8", "replace")
        env.trajectory = env.trajectory or Trajectory()
        env.trajectory.extra["model_patch"] = model_patch[:MODEL_PATCH_MAX_CHARS]
        await sandbox.write_file(f"{_EVAL_DIR}/test.patch", inst["test_patch"])
        await sandbox.write_file(f"{_EVAL_DIR}/rs_swe_report.py", _PLUGIN_SOURCE.read_bytes())
        reset = await self._sh(sandbox, f"cd {q(repo)} && git reset -q --hard {q(base)} && git clean -qfdx")
        if reset.exit_code != 0:
            return eval_report.record(env, 0.0, "could not reset the repository to base_commit", output=reset.output)
        if model_patch.strip():
            applied = await self._sh(sandbox, f"cd {q(repo)} && git apply --whitespace=nowarn {_EVAL_DIR}/model.patch")
            if applied.exit_code != 0:
                return eval_report.record(env, 0.0, "the agent's diff does not apply to base_commit",
                                          output=applied.output)
        if inst["test_patch"].strip():
            applied = await self._sh(sandbox, f"cd {q(repo)} && git apply --whitespace=nowarn {_EVAL_DIR}/test.patch")
            if applied.exit_code != 0:
                return eval_report.record(env, 0.0, "the instance's test_patch does not apply after the agent's diff "
                                          "(did the agent edit the tests?)", output=applied.output)
        return await self._run_tests(env, sandbox, repo, limit_s)

    async def _pytest(self, sandbox: SandboxClient, inst: dict, repo: str, limit_s: float, tests: list[str],
                      prefix: str = "") -> tuple[Any, dict | None]:
        """One pytest run of `tests`; returns the bash result and the plugin's report (None if none)."""
        q = shlex.quote
        report = f"{_EVAL_DIR}/report.json"
        test_command = inst.get("test_command", "python -m pytest")
        command = (f"cd {q(repo)} && rm -f {report} && {prefix}RS_SWE_REPORT={report} "
                   f"PYTHONPATH={_EVAL_DIR}${{PYTHONPATH:+:$PYTHONPATH}} "
                   f"timeout -k 2 {limit_s:g} {test_command} -p rs_swe_report -p no:cacheprovider -q "
                   f"{' '.join(q(t) for t in tests)} 2>&1 "
                   f"| tail -c {OUTPUT_TAIL_BYTES}; echo \"tests exit ${{PIPESTATUS[0]}}\"")
        result = await self._sh(sandbox, command, timeout_s=limit_s + 10)
        try:
            return result, json.loads(await sandbox.read_file(report))
        except Exception:  # no report: pytest was killed, crashed or never started
            return result, None

    async def _run_tests(self, env: Envelope, sandbox: SandboxClient, repo: str, limit_s: float) -> float:
        inst = swe_records.normalize(env.job.instance)
        fail_to_pass, pass_to_pass = test_ids(inst, "FAIL_TO_PASS"), test_ids(inst, "PASS_TO_PASS")
        tests = list(dict.fromkeys(fail_to_pass + pass_to_pass))
        # As the harness does: run the test files, then read each listed test's outcome (a
        # thousand ids on one command line, or ids with spaces, need not survive the shell).
        targets = list(dict.fromkeys(t.split("::")[0] if "::" in t else t for t in tests))
        result, report = await self._pytest(sandbox, inst, repo, limit_s, targets)
        fallback = ""
        usage_error = f"tests exit {PYTEST_USAGE_ERROR}" in result.output or (
            report is not None and report.get("exitstatus") == PYTEST_USAGE_ERROR)
        if usage_error and inst.get("env", {}).get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
            # The instance turned plugin autoload off, and the project's configuration needs a
            # plugin (setup.cfg's --cov...): run as the project configures it.
            fallback = ("; pytest stopped with a usage error with PYTEST_DISABLE_PLUGIN_AUTOLOAD set, "
                        "so the tests ran again with plugin autoload on")
            result, report = await self._pytest(sandbox, inst, repo, limit_s, targets,
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
