"""The ``swe`` task: fix an issue in a repository, SWE-bench style. Init clones the
repository at ``base_commit`` from the local mirror into the sandbox; the agent edits it
with bash/editor. Eval verifies in a fresh sandbox (swe_eval.py): the agent's changes (test
files excluded) on a pristine checkout, plus the instance's ``test_patch``; FAIL_TO_PASS and
PASS_TO_PASS run with pytest under a time limit: reward 1 only if every one passes.

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
from typing import ClassVar

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.env_images import ENV_PYTHON, env_variables
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import eval_report, swe_env, swe_eval, swe_records, swe_repos
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.base import TaskContext
from rollstream.tasks.prompt_template import fill_prompt
from rollstream.tasks.swe_eval import patch_paths, test_ids  # noqa: F401  (patch_paths: callers import it here)

SHIPPED_INSTANCES = Path(__file__).resolve().parent.parent / "data" / "swe" / "instances.jsonl"
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement")
# Caches and build/install debris (pip install -e ., setup.py build) never enter the agent's
# diff; the ignore applies to untracked files only, so a tracked build/ folder still counts.
_LOCAL_IGNORES = ("__pycache__/\n*.pyc\n.pytest_cache/\n.ipynb_checkpoints/\n*.egg-info/\n.eggs/\nbuild/\n"
                  "dist/\npip-wheel-metadata/\n.mypy_cache/\n.ruff_cache/\n.tox/\n.nox/\n.coverage\n.cache/\n")
# Plugin autoload stays as the project configures it (the SWE-bench harness does not turn it
# off): a setup.cfg passing --cov needs pytest-cov loaded.
DEFAULT_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}

SYSTEM_PROMPT = (
    "You are a software engineer working in a sandbox. The repository is checked out at {repo_dir}. "
    "Fix the issue below by editing the source code (bash and editor tools). Do not change the tests: "
    "hidden tests will check your fix. Call submit when you are done."
)


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
        assert env.sandbox is not None  # init made the job's sandbox before it prepares it
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
    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        """Verified in a fresh sandbox from the same spec, never in the agent's (swe_eval.py)."""
        return await swe_eval.score(self, env, ctx)

    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        raise JobFailed("the swe task is scored by score() in a fresh sandbox, never in the agent's own "
                        "sandbox; call SweTask().score(env, ctx) with ctx.sandboxes set", retryable=False)
