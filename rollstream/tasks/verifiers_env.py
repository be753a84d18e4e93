"""The ``verifiers`` task: a verifiers environment (a package exposing ``load_environment``), run
unmodified. The instance names the environment by id (an installed package the operator allows),
its ``load_environment`` arguments and a row of its dataset; run plays the environment's own
episode through the job's door (verifiers_episode.py), so the model's tokens are recorded exactly;
eval reports the environment's rubric: the reward and each reward function's score.

Instance: ``{"environment": "reverse-text", "args": {...}, "index": 0, "split": "train" | "eval"}``.
``jobs(env_id, args)`` makes one job per dataset row; ``rollstream submit verifiers:ENV_ID[:ARGS]``
submits them. The environment's code (its tools included) runs on the run worker, as a task plugin
does: install only packages you trust, and allow them by id in ``verifiers_environments``."""

from __future__ import annotations

import json
from typing import Any

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.tools import tool_schemas
from rollstream.tasks import eval_report, verifiers_episode, verifiers_sandbox
from rollstream.tasks.base import Task, TaskContext
from rollstream.tasks.verifiers_episode import SPLITS, check_allowed
from rollstream.trajectory import Trajectory

HARNESS = "verifiers-env"  # verifiers_episode.run, through the rollstream.harnesses entry point
INSTANCE_FIELDS = ("environment", "args", "index", "split")
MAX_INDEX = 10**9


class VerifiersTask(Task):
    name = "verifiers"

    def validate(self, instance: dict) -> None:
        unknown = sorted(set(instance) - set(INSTANCE_FIELDS))
        if unknown:
            raise InvalidJob(f"verifiers: unknown instance fields {unknown}; it takes {list(INSTANCE_FIELDS)}")
        check_allowed(instance.get("environment"))
        if not isinstance(instance.get("args", {}), dict):
            raise InvalidJob("verifiers: args must be an object of load_environment's keyword arguments")
        index = instance.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_INDEX:
            raise InvalidJob(f"verifiers: index must be a dataset row number (an integer >= 0), got {index!r}")
        if instance.get("split", "train") not in SPLITS:
            raise InvalidJob(f"verifiers: split must be one of {list(SPLITS)}, got {instance.get('split')!r}")

    def sandbox_spec(self, instance: dict) -> SandboxSpec | None:
        """The operator's default sandbox for an environment that runs commands (a SandboxEnv);
        none for the others, whose episodes need only the model."""
        loaded = verifiers_episode.load_environment(instance["environment"], instance.get("args") or {})
        return SandboxSpec() if verifiers_sandbox.is_sandbox_env(loaded) else None

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        job = env.job
        if job.agent.get("harness"):
            raise JobFailed("a verifiers job's episode is driven by its environment's own turn protocol; leave "
                            "agent.harness unset", retryable=False, failure="job")
        # Imported here: the CLI imports this module too, and needs none of the run stage's clients.
        from rollstream.agent.harness import run_harness

        verifiers_episode.outcomes[job.job_id] = None
        try:
            tools = tool_schemas(["bash"]) if ctx.sandbox is not None else []  # what a SandboxEnv's commands use
            traj = await run_harness(HARNESS, [], tools, env, ctx.services, ctx.sandbox)
            outcome = verifiers_episode.outcomes.get(job.job_id)
        finally:
            verifiers_episode.outcomes.pop(job.job_id, None)
        if outcome is None:
            raise JobFailed(f"the verifiers episode of {job.instance.get('environment')!r} did not start: "
                            f"{traj.extra.get('finish_detail', 'no detail')}")
        if outcome.error is not None:
            raise JobFailed(outcome.error, retryable=False, failure="task")
        if traj.finish_reason == "harness_error":  # raised outside the environment's rollout: still the task's
            raise JobFailed(f"the verifiers episode of {job.instance.get('environment')!r} failed: "
                            f"{traj.extra.get('finish_detail', 'no detail')}", retryable=False, failure="task")
        refused = traj.extra["door"]["refused"] if "door" in traj.extra else 0
        if refused and traj.finish_reason not in ("max_turns", "context"):
            # Not the job's limits: the environment asked the door for what it does not serve
            # (its sampling arguments, say). Its rubric would score an episode that never ran.
            raise JobFailed(f"verifiers environment {job.instance.get('environment')!r}: the job's door refused its "
                            f"model call: {outcome.detail.get('error') or 'no detail'}", retryable=False,
                            failure="task")
        traj.extra.pop("harness", None)
        traj.extra["verifiers"] = {**outcome.detail, "reward": outcome.reward, "metrics": outcome.metrics,
                                   "weights": outcome.weights}
        return traj

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        """The environment's rubric scored the rollout on the run worker; its reward, with each
        function's score (``metrics``) and weight, goes to the eval info."""
        found = (env.trajectory.extra.get("verifiers") if env.trajectory is not None else None) or {}
        reward = found.get("reward")
        if reward is None:
            return eval_report.record(env, 0.0, "the environment's rubric gave no reward")
        reason = f"the rubric of verifiers environment {found.get('environment')!r}"
        if found.get("error"):
            reason += f" (the rollout ended on an error: {found['error']})"
        return eval_report.record(env, float(reward), reason, metrics=found.get("metrics", {}),
                                  weights=found.get("weights", {}), stop_condition=found.get("stop_condition"))


def jobs(env_id: str, args: dict[str, Any] | None = None, split: str = "train", limit: int | None = None,
         **job_fields: Any) -> list[dict]:
    """One job per row of the environment's dataset (loaded here to count them)."""
    args = args or {}
    env = verifiers_episode.load_environment(check_allowed(env_id), args)
    dataset = env.get_eval_dataset() if split == "eval" else env.get_dataset()
    count = len(dataset) if limit is None else min(limit, len(dataset))
    return [{"task": VerifiersTask.name, "instance": {"environment": env_id, "args": args, "index": i, "split": split},
             "metadata": {"verifiers_environment": env_id}, **job_fields} for i in range(count)]


TASK_SET_PREFIX = "verifiers:"


def task_set(spec: str) -> list[dict] | None:
    """The jobs of ``verifiers:ENV_ID`` or ``verifiers:ENV_ID:{"arg": ...}`` (a task-set name for
    ``rollstream submit``): one per row of the environment's dataset; None for any other spec."""
    if not spec.startswith(TASK_SET_PREFIX):
        return None
    env_id, _, raw_args = spec[len(TASK_SET_PREFIX):].partition(":")
    try:
        args = json.loads(raw_args) if raw_args else {}
    except json.JSONDecodeError as exc:
        raise InvalidJob(f"{spec}: the environment's arguments after the second ':' must be a JSON object ({exc})") \
            from None
    if not isinstance(args, dict):
        raise InvalidJob(f"{spec}: the environment's arguments after the second ':' must be a JSON object")
    return jobs(env_id, args)
