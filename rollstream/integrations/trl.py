"""TRL's ``GRPOTrainer(rollout_func=...)`` fed by rollstream: each prompt of a TRL batch
becomes one rollstream group (the init/run/eval pools, sandboxes and tools do the work),
and the trajectories come back as TRL's completion ids, rollout logprobs and env mask.

Contract of TRL 1.16 (``trl/trainer/grpo_trainer.py``, ``_generate``): TRL calls
``rollout_func(prompts, trainer)`` with this process's slice of the generation batch, in
which its ``RepeatSampler`` already put each dataset row ``num_generations`` times in a
row; the function returns one completion per entry, in order: ``prompt_ids``,
``completion_ids`` and ``logprobs`` (lists of lists), optionally ``env_mask`` (1 = model
token, 0 = tool observation: TRL multiplies it into the loss mask), and any other key is
merged into the rows handed to the reward functions. A job of several segments (a harness's
sub-agents or compacted history) is its last segment here, its earlier ones under
``rollstream_segments``: ``trl_segments.RollstreamGRPOTrainer`` trains those too. TRL only sees the prompt, so each
prompt must map to a task instance: give ``instances`` (their prompts are rendered by the
task, see :meth:`RolloutFunc.dataset_rows`) or an ``instance_for_prompt`` function.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollstream.config import Settings
from rollstream.episode_settings import AgentSettings
from rollstream.integrations.trl_bridge import RollstreamConnection
from rollstream.messages import Job, Result
from rollstream.sampling import SamplingParams
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.registry import get_task
from rollstream.trajectory import Trajectory

log = logging.getLogger(__name__)

# Keys of the extra fields TRL forwards to reward functions (prefixed: they land beside the
# dataset's own columns).
REWARD_KEY = "rollstream_reward"
# A job's earlier segments (the row is its last): RollstreamGRPOTrainer trains each as a row of its own.
SEGMENTS_KEY = "rollstream_segments"
EXTRA_KEYS = (REWARD_KEY, "rollstream_policy_version", "rollstream_job_id", "rollstream_status",
              "rollstream_failure", "rollstream_error", "rollstream_finish_reason", "rollstream_num_turns",
              "rollstream_tool_calls")


class TrlRolloutConfig(BaseModel):
    """What every rollout of a TRL run is: the task, its sampling and agent settings, and
    how long the trainer waits."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(min_length=1, description="Registered rollstream task name, e.g. 'arith'.")
    sampling: SamplingParams = Field(
        default_factory=SamplingParams,
        description="Sampling of each model turn. Keep temperature 1.0 (and TRL's GRPOConfig.temperature "
        "equal to it): the rollout logprobs TRL receives are taken at this temperature.")
    agent: dict[str, Any] = Field(default_factory=dict, description="Agent-loop overrides (max_turns, "
                                  "max_tokens_per_turn, max_context_tokens, ...).")
    sandbox: dict[str, Any] | None = Field(None, description="Sandbox spec overrides for every job.")
    job_timeout_s: float = Field(600.0, gt=0, description="Wall time of one rollout job in the pipeline.")
    batch_timeout_s: float = Field(
        900.0, gt=0, description="How long one TRL generation waits for all its rollouts; those still "
        "missing are cancelled and enter the batch as failed.")
    failed_reward: float | None = Field(
        0.0, description="Reward of a rollout that failed for a reason other than the service's (an invalid "
        "job, a cancellation). None makes TRL treat the row as unscorable (left out of its group's baseline, "
        "advantage 0).")
    infrastructure_failure_reward: float | None = Field(
        None, description="Reward of a rollout the service failed (sandbox, backend, worker, a service timeout, "
        "no result within batch_timeout_s) or whose environment is broken (failure 'task'). None (the default) "
        "drops it per sample: unscorable, never a 0 that would teach the policy about a crashed sandbox.")
    submitter: str | None = Field(None, description="Results stream name; default a fresh one per process.")


class BatchReport(BaseModel):
    """What one call of the rollout function did (kept in ``RolloutFunc.reports``)."""

    step: int | None
    groups: int
    rollouts: int
    failed: int
    failed_infrastructure: int = 0
    earlier_segments: int = 0  # rows RollstreamGRPOTrainer adds beside the jobs' own
    wait_s: float
    policy_versions: list[int]
    job_ids: list[str]


def prompt_key(prompt: Any) -> str:
    """A stable key for a TRL prompt (a string or a list of chat messages). Keys whose value
    is None are dropped: a datasets round trip adds them to messages that lacked them."""
    if isinstance(prompt, str):
        return prompt

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(prompt), sort_keys=True, ensure_ascii=False, default=str)


def group_rows(prompts: Sequence[Any], group_size: int | None) -> list[list[int]]:
    """Row indices of each rollstream group: runs of equal consecutive prompts (TRL's
    sampler repeats a row ``num_generations`` times in a row), cut to ``group_size``."""
    groups: list[list[int]] = []
    previous = None
    for index, prompt in enumerate(prompts):
        key = prompt_key(prompt)
        if groups and key == previous and (group_size is None or len(groups[-1]) < group_size):
            groups[-1].append(index)
        else:
            groups.append([index])
        previous = key
    return groups


class RolloutFunc:
    """The ``rollout_func`` of ``trl.GRPOTrainer``, backed by rollstream.

    >>> rollout = RolloutFunc("arith", redis_url=url, instances=instances,
    ...                       sampling={"temperature": 1.0, "max_tokens": 48}, agent={"max_turns": 3})
    >>> dataset = datasets.Dataset.from_list(rollout.dataset_rows(instances))
    >>> GRPOTrainer(model, reward_funcs=[rollstream_reward], rollout_func=rollout, train_dataset=dataset, ...)
    """

    def __init__(
        self,
        task: str | TrlRolloutConfig,
        *,
        redis_url: str | None = None,
        settings: Settings | None = None,
        instances: Sequence[dict[str, Any]] | None = None,
        instance_for_prompt: Callable[[Any], dict[str, Any]] | None = None,
        connection: RollstreamConnection | None = None,
        **config: Any,
    ) -> None:
        if isinstance(task, TrlRolloutConfig):
            self.config = task.model_copy(update=config)
        else:
            self.config = TrlRolloutConfig(task=task, **config)
        self.task = get_task(self.config.task)  # unknown task names fail here, not mid-training
        self.instance_for_prompt = instance_for_prompt
        self._instances: dict[str, dict[str, Any]] = {}
        for instance in instances or ():
            self.add_instance(instance)
        self._owns_connection = connection is None
        self.connection = connection or RollstreamConnection(redis_url, settings=settings,
                                                             submitter=self.config.submitter)
        self.reports: deque[BatchReport] = deque(maxlen=1000)

    # -- prompts <-> instances -------------------------------------------------------------
    def prompt(self, instance: dict[str, Any]) -> list[dict]:
        """The prompt the task renders for ``instance`` (what the model will see)."""
        if not isinstance(self.task, AgentTask):
            raise TypeError(f"task {self.config.task!r} renders no prompt (it is no agent task): "
                            "give add_instance each instance's prompt")
        return self.task.prompt_messages(instance)

    def add_instance(self, instance: dict[str, Any], prompt: Any = None) -> None:
        """Map ``prompt`` (default: the task's own prompt of the instance) to ``instance``."""
        self.task.validate(instance)
        key = prompt_key(self.prompt(instance) if prompt is None else prompt)
        known = self._instances.get(key)
        if known is not None and known != instance:
            raise ValueError(
                f"two task instances share the prompt {key[:200]}; TRL hands the rollout function only "
                "prompts, so each needs its own: make the prompts distinct or pass instance_for_prompt")
        self._instances[key] = instance

    def dataset_rows(self, instances: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Rows for ``datasets.Dataset.from_list``: ``prompt`` (the task's chat messages)
        and ``instance`` (as JSON, so rows of different shapes share one column type)."""
        chosen = list(instances) if instances is not None else list(self._instances.values())
        for instance in chosen:
            self.add_instance(instance)
        return [{"prompt": self.prompt(inst), "instance": json.dumps(inst, sort_keys=True)} for inst in chosen]

    def instance(self, prompt: Any) -> dict[str, Any]:
        found = self._instances.get(prompt_key(prompt))
        if found is not None:
            return found
        if self.instance_for_prompt is not None:
            return self.instance_for_prompt(prompt)
        raise KeyError(
            f"no task instance for the prompt {prompt_key(prompt)[:200]}; build the dataset with "
            "RolloutFunc.dataset_rows(instances), pass instances=..., or pass instance_for_prompt")

    # -- the TRL contract --------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list]:
        group_size = _num_generations(trainer)
        groups = group_rows(prompts, group_size)
        step = getattr(getattr(trainer, "state", None), "global_step", None)
        started = time.monotonic()
        jobs = [self._job(self.instance(prompts[rows[0]]), step) for rows in groups]
        results = self.connection.run(self._roll_out(jobs, groups),
                                      timeout_s=self.config.batch_timeout_s + 60)
        wait_s = time.monotonic() - started
        output = self._to_trl(prompts, groups, results, trainer)
        failed = sum(1 for s in output["rollstream_status"] if s != "completed")
        infra = sum(1 for f in output["rollstream_failure"] if f == "infrastructure")
        segments = sum(len(s) for s in output[SEGMENTS_KEY])
        if segments and trainer is not None and not getattr(trainer, "trains_every_segment", False):
            log.warning("%d segments of multi-chain jobs at step %s are not trained on: %s trains each job's last "
                        "segment only; use rollstream.integrations.trl_segments.RollstreamGRPOTrainer",
                        segments, step, type(trainer).__name__)
        self.reports.append(BatchReport(
            step=step, groups=len(groups), rollouts=len(prompts), failed=failed, failed_infrastructure=infra,
            earlier_segments=segments, wait_s=wait_s,
            policy_versions=output["rollstream_policy_version"], job_ids=output["rollstream_job_id"]))
        if failed:
            log.warning("%d of %d rollouts failed or timed out at step %s (%d by the service: reward %s; "
                        "others: reward %s); they enter the batch with an EOS-only completion, masked out of "
                        "the loss", failed, len(prompts), step, infra, self.config.infrastructure_failure_reward,
                        self.config.failed_reward)
        _log_metrics(trainer, wait_s=wait_s, failed=failed / max(len(prompts), 1),
                     infrastructure=infra / max(len(prompts), 1),
                     versions=output["rollstream_policy_version"])
        return output

    def _job(self, instance: dict[str, Any], step: int | None) -> Job:
        return Job(task=self.config.task, instance=instance, sampling=self.config.sampling,
                   agent=self.config.agent, sandbox=self.config.sandbox, timeout_s=self.config.job_timeout_s,
                   submitter=self.connection.client.submitter, metadata={"trl_step": step})

    async def _roll_out(self, jobs: list[Job], groups: list[list[int]]) -> dict[str, Result]:
        """Submit one group per distinct prompt and gather their results (by job id)."""
        client = self.connection.client
        wanted: dict[str, str] = {}  # job id -> group id
        group_ids = []
        for job, rows in zip(jobs, groups):
            group_id, job_ids = await client.submit_group(job, len(rows))
            group_ids.append(group_id)
            wanted.update((job_id, group_id) for job_id in job_ids)
        results: dict[str, Result] = {}
        deadline = time.monotonic() + self.config.batch_timeout_s
        while len(results) < len(wanted) and time.monotonic() < deadline:
            async for result in client.results(timeout_s=max(deadline - time.monotonic(), 0.01)):
                if result.job_id in wanted:
                    results[result.job_id] = result
                else:  # a late result of a batch that timed out earlier
                    log.debug("dropping a result of an earlier batch", extra={"job_id": result.job_id})
                if len(results) == len(wanted):
                    break
        missing = {group for job_id, group in wanted.items() if job_id not in results}
        if missing:
            log.warning("%d of %d rollouts did not finish in %.0fs (batch_timeout_s); cancelling their groups",
                        len(wanted) - len(results), len(wanted), self.config.batch_timeout_s)
            for group_id in missing:
                await client.cancel(group_id=group_id)
        for job_id, group_id in wanted.items():
            results.setdefault(job_id, Result(job_id=job_id, group_id=group_id, status="failed",
                                              failure="infrastructure",
                                              error=f"no result within batch_timeout_s={self.config.batch_timeout_s}"))
        # keep submission order inside each group so rows map to jobs deterministically
        return {job_id: results[job_id] for job_id in wanted}

    def _to_trl(self, prompts: list[Any], groups: list[list[int]], results: dict[str, Result],
                trainer: Any) -> dict[str, list]:
        n = len(prompts)
        out: dict[str, list] = {k: [None] * n for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                         *EXTRA_KEYS)}
        out[SEGMENTS_KEY] = [[] for _ in range(n)]
        ordered = iter(results.values())
        by_group = [[next(ordered) for _ in rows] for rows in groups]
        eos = _eos_token_id(trainer)
        finish = set(AgentSettings.model_validate(self.config.agent).finish_tool_names)  # not tool work
        for rows, group_results in zip(groups, by_group):
            prompt_ids = next((t.prompt_ids for r in group_results if (t := _usable(r)) is not None), None)
            if prompt_ids is None:
                prompt_ids = _tokenize_prompt(trainer, prompts[rows[0]], eos)
            for row, result in zip(rows, group_results):
                traj = _usable(result)
                if traj is not None and result.reward is not None:  # scored, where usable
                    row_out = {"prompt_ids": traj.prompt_ids, "completion_ids": traj.response_ids,
                               "logprobs": traj.logprobs, "env_mask": traj.loss_mask,
                               REWARD_KEY: float(result.reward), "rollstream_policy_version": traj.policy_version,
                               "rollstream_status": "completed", "rollstream_error": None,
                               "rollstream_failure": result.failure,
                               "rollstream_finish_reason": traj.finish_reason,
                               "rollstream_num_turns": traj.num_turns,
                               "rollstream_tool_calls": sum(c.name not in finish for c in traj.tool_calls),
                               SEGMENTS_KEY: earlier_segments(traj)}
                else:
                    # TRL indexes completion_ids[-1]: a failed rollout gets one EOS, masked out
                    infra = result.infrastructure_failure or result.task_failure  # nothing the policy did
                    row_out = {"prompt_ids": prompt_ids, "completion_ids": [eos], "logprobs": [0.0],
                               "env_mask": [0], REWARD_KEY: self.config.infrastructure_failure_reward if infra
                               else self.config.failed_reward, "rollstream_failure": result.failure,
                               "rollstream_policy_version": result.policy_version,
                               "rollstream_status": result.status if result.status != "completed" else "failed",
                               "rollstream_error": result.error or "completed without a trajectory",
                               "rollstream_finish_reason": "error", "rollstream_num_turns": 0,
                               "rollstream_tool_calls": 0}
                    log.warning("rollout failed; TRL gets an EOS-only completion", extra={
                        "job_id": result.job_id, "group_id": result.group_id, "error": row_out["rollstream_error"]})
                row_out["rollstream_job_id"] = result.job_id
                for key, value in row_out.items():
                    out[key][row] = value
        return out

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        if self._owns_connection:
            self.connection.close()

    def __enter__(self) -> RolloutFunc:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rollstream_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Reward function for ``GRPOTrainer(reward_funcs=[rollstream_reward])``: the reward
    rollstream's eval stage gave each rollout (None, i.e. unscorable, for a failed one
    when the config's ``failed_reward`` is None)."""
    rewards = kwargs.get(REWARD_KEY)
    if rewards is None:
        raise ValueError(f"no '{REWARD_KEY}' among the reward kwargs; rollstream_reward only works with "
                         "GRPOTrainer(rollout_func=RolloutFunc(...)), which forwards it")
    return [None if r is None else float(r) for r in rewards]


def earlier_segments(traj: Trajectory) -> list[dict[str, list]]:
    """A multi-segment trajectory's segments before its last (the top-level sequence), as TRL
    rows; segments with no model token are left out (nothing of theirs is trained on)."""
    return [{"prompt_ids": list(seg.prompt_ids), "completion_ids": list(seg.response_ids),
             "logprobs": list(seg.logprobs), "env_mask": list(seg.loss_mask)}
            for seg in traj.segments[:-1] if any(seg.loss_mask)]


# -- small helpers on the trainer (all optional: the function also runs without one) -------------
def _usable(result: Result) -> Trajectory | None:
    """The result's trajectory where it can train (completed, scored, with a response), else None."""
    traj = result.trajectory
    usable = result.ok and traj is not None and result.reward is not None and len(traj.response_ids) > 0
    return traj if usable else None


def _num_generations(trainer: Any) -> int | None:
    if trainer is None:
        return None
    training = getattr(getattr(trainer, "model", None), "training", True)
    size = getattr(trainer, "num_generations" if training else "num_generations_eval", None)
    return int(size) if size else None


def _tokenizer(trainer: Any) -> Any:
    processing = getattr(trainer, "processing_class", None)
    return getattr(processing, "tokenizer", processing)


def _eos_token_id(trainer: Any) -> int:
    tokenizer = _tokenizer(trainer)
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _tokenize_prompt(trainer: Any, prompt: Any, eos: int) -> list[int]:
    """Prompt ids of a group with no trajectory at all (every rollout failed): the row is
    masked out of the loss, so the ids only have to be a plausible prompt."""
    tokenizer = _tokenizer(trainer)
    try:
        if isinstance(prompt, str):
            return list(tokenizer(prompt)["input_ids"]) or [eos]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids) or [eos]
    except Exception:  # no tokenizer or no template: a lone EOS still keeps TRL's shapes valid
        log.debug("could not tokenize a failed group's prompt", exc_info=True)
        return [eos]


def _log_metrics(trainer: Any, *, wait_s: float, failed: float, infrastructure: float, versions: list[int]) -> None:
    """Add rollstream's figures to TRL's logged metrics (its private ``_metrics`` dict)."""
    metrics = getattr(trainer, "_metrics", None)
    if not isinstance(metrics, dict):
        return
    mode = "train" if getattr(getattr(trainer, "model", None), "training", True) else "eval"
    try:
        metrics[mode]["rollstream/wait_s"].append(wait_s)
        metrics[mode]["rollstream/failed_frac"].append(failed)
        metrics[mode]["rollstream/infrastructure_failed_frac"].append(infrastructure)
        if versions:
            metrics[mode]["rollstream/policy_version_min"].append(float(min(versions)))
    except (KeyError, TypeError, AttributeError):  # another TRL layout: logging is optional
        pass
