"""The verl adapter's translations, free of verl itself: a verl dataset row and its sampling
params become a rollstream ``Job``; a rollstream ``Result`` becomes the fields of verl's
``AgentLoopOutput`` (ids, loss mask, logprobs, reward, turns), cut to verl's length limit."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from rollstream.errors import InvalidJob
from rollstream.messages import Job, Result
from rollstream.sampling import SamplingParams
from rollstream.trajectory import Segment, Trajectory

ROW_KEY = "rollstream"  # extra_info[ROW_KEY] holds what the job needs
# verl asks its own servers for logprobs with this flag; rollstream always returns them.
_VERL_ONLY_SAMPLING = {"logprobs"}


class RowSpec(BaseModel):
    """What one dataset row asks rollstream to run (``extra_info.rollstream``)."""

    task: str | None = Field(None, description="rollstream task; None: the loop config's task.")
    instance: dict[str, Any] = Field(default_factory=dict, description="The task's instance payload.")
    agent: dict[str, Any] = Field(default_factory=dict, description="Agent overrides for this row.")
    sandbox: dict[str, Any] | None = None
    timeout_s: float | None = Field(None, gt=0)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (how verl's non-tensor batch hands values over) as Python."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return value


def row_spec(row: Mapping[str, Any]) -> RowSpec:
    """Read ``extra_info.rollstream`` (a dict, or the same as a JSON string, which keeps
    parquet schemas uniform across tasks) from the kwargs verl passes to ``run``."""
    extra_info = row.get("extra_info") or {}
    raw = extra_info.get(ROW_KEY) if isinstance(extra_info, Mapping) else None
    if raw is None:
        raise InvalidJob(
            "verl dataset row has no extra_info.rollstream; build rows with "
            "rollstream.integrations.verl_mapping.dataset_row(task, instance) "
            "(extra_info.rollstream = {'task': ..., 'instance': {...}})")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InvalidJob(f"extra_info.rollstream is not valid JSON: {exc}") from exc
    try:
        return RowSpec.model_validate(raw)
    except ValidationError as exc:
        raise InvalidJob(f"malformed extra_info.rollstream: {exc}") from exc


def dataset_row(task: str, instance: dict[str, Any], *, index: int = 0, data_source: str | None = None,
                prompt: list[dict] | None = None, agent: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row of a verl RL dataset (parquet) that the rollstream loop runs. ``prompt`` is
    for verl's logging and length filter only: the task renders the real prompt."""
    if prompt is None:
        from rollstream.tasks.registry import get_task

        render = getattr(get_task(task), "prompt_messages", None)
        prompt = render(instance) if render else [{"role": "user", "content": json.dumps(instance)}]
    spec = {"task": task, "instance": instance, **({"agent": agent} if agent else {})}
    return {"data_source": data_source or f"rollstream/{task}", "prompt": prompt, "agent_name": "rollstream",
            "extra_info": {"index": index, ROW_KEY: json.dumps(spec)}}


def sampling_from_verl(params: Mapping[str, Any]) -> SamplingParams:
    """verl's per-sample sampling params (temperature, top_p, top_k, repetition_penalty;
    greedy for validation) as rollstream's. Unknown keys pass through to the server."""
    clean = {k: _plain(v) for k, v in params.items() if k not in _VERL_ONLY_SAMPLING and v is not None}
    if clean.get("top_k") == 0:
        clean["top_k"] = -1
    return SamplingParams.model_validate(clean)


def build_job(row: Mapping[str, Any], sampling_params: Mapping[str, Any], *, default_task: str | None,
              agent_defaults: Mapping[str, Any], agent_overrides: Mapping[str, Any],
              sandbox: Mapping[str, Any] | None, timeout_s: float) -> Job:
    """The rollstream job of one verl sample. Samples of one prompt share verl's ``uid``,
    which becomes the group id, so they prefer one backend (prefix-cache hits)."""
    spec = row_spec(row)
    task = spec.task or default_task
    if not task:
        raise InvalidJob("no rollstream task: set extra_info.rollstream.task in the dataset, 'task' in the "
                         "agent loop config, or ROLLSTREAM_VERL_TASK")
    uid = _plain(row.get("uid"))
    metadata = {"verl_index": _plain(row.get("index")), "verl_uid": uid}
    return Job(task=task, instance=spec.instance, group_id=f"verl-{uid}" if uid is not None else None,
               sampling=sampling_from_verl(sampling_params),
               agent={**agent_defaults, **agent_overrides, **spec.agent},
               sandbox=spec.sandbox if spec.sandbox is not None else (dict(sandbox) if sandbox else None),
               timeout_s=spec.timeout_s or timeout_s,
               metadata={k: v for k, v in metadata.items() if v is not None})


@dataclass
class VerlSample:
    """The fields of verl's ``AgentLoopOutput`` for one rollout."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward_score: float
    num_turns: int
    metrics: dict[str, float]
    extra_fields: dict[str, Any] = field(default_factory=dict)


def observation_blocks(loss_mask: list[int]) -> int:
    """Runs of 0 in the loss mask: one per tool-observation block between model turns."""
    return sum(1 for i, m in enumerate(loss_mask) if m == 0 and (i == 0 or loss_mask[i - 1] != 0))


def verl_num_turns(traj: Trajectory) -> int:
    """verl counts chat turns: the prompt, each assistant turn, each tool-response block."""
    return 1 + traj.num_turns + observation_blocks(traj.loss_mask)


def sample_from_result(result: Result, *, response_length: int) -> VerlSample:
    """A completed result as verl fields; ids, mask and logprobs are cut at the same index
    (verl's ``rollout.response_length``), and logprobs are 0.0 wherever the mask is 0."""
    traj = result.trajectory
    if traj is None:
        raise ValueError(f"rollstream job {result.job_id} has no trajectory (status {result.status})")
    sample = _cut(traj, result, response_length=response_length, num_turns=verl_num_turns(traj),
                  metrics=timing_metrics(result))
    sample.extra_fields["rollstream_finish_reason"] = traj.finish_reason
    return sample


def segment_samples(result: Result, *, response_length: int) -> list[VerlSample]:
    """Every segment of a completed job as a sample, its last (the top-level sequence) last, as
    verl's v1 trainer takes an agent loop's several outputs: each carries the job's reward, and
    verl computes GRPO's advantage from the last output of each rollout and gives it to the
    others. Earlier segments with no model token are left out; one-segment jobs give one."""
    last = sample_from_result(result, response_length=response_length)  # raises without a trajectory
    segments = result.trajectory.segments if result.trajectory is not None else []
    samples = [_cut(seg, result, response_length=response_length,
                    num_turns=1 + seg.num_calls + observation_blocks(seg.loss_mask),
                    metrics={**timing_metrics(result), "generate_sequences": 0.0, "tool_calls": 0.0,
                             "compute_score": 0.0})
               for seg in segments[:-1] if any(seg.loss_mask)]
    for number, sample in enumerate(samples):
        sample.extra_fields.update(rollstream_finish_reason="segment", rollstream_segment=number)
    last.extra_fields["rollstream_segment"] = max(len(segments) - 1, 0)
    return [*samples, last]


def _cut(seq: Trajectory | Segment, result: Result, *, response_length: int, num_turns: int,
         metrics: dict[str, float]) -> VerlSample:
    cut = min(len(seq.response_ids), response_length)
    mask = list(seq.loss_mask[:cut])
    logprobs = [lp if m else 0.0 for lp, m in zip(seq.logprobs[:cut], mask)]
    traj = result.trajectory
    assert traj is not None  # only a result with a trajectory is cut into samples
    reward = result.reward if result.reward is not None else traj.reward
    return VerlSample(
        prompt_ids=list(seq.prompt_ids), response_ids=list(seq.response_ids[:cut]), response_mask=mask,
        response_logprobs=logprobs, reward_score=float(reward or 0.0), num_turns=num_turns, metrics=metrics,
        extra_fields={**_common_extra(result), "rollstream_truncated": cut < len(seq.response_ids)})


def failed_sample(result: Result, prompt_ids: list[int]) -> VerlSample:
    """A failed or cancelled job as a zero-reward sample with nothing to learn from: no
    response tokens (so nothing enters the loss), reward 0."""
    return VerlSample(prompt_ids=list(prompt_ids), response_ids=[], response_mask=[], response_logprobs=[],
                      reward_score=0.0, num_turns=1, metrics=timing_metrics(result),
                      extra_fields={**_common_extra(result), "rollstream_finish_reason": "error",
                                    "rollstream_truncated": False})


def _common_extra(result: Result) -> dict[str, Any]:
    # turn_scores/tool_rewards keep the schema of verl's own loops (its batch concat needs it).
    return {"turn_scores": [], "tool_rewards": [], "rollstream_job_id": result.job_id,
            "rollstream_status": result.status, "rollstream_failure": result.failure, "rollstream_error": result.error,
            "rollstream_policy_version": result.policy_version}


def timing_metrics(result: Result) -> dict[str, float]:
    """verl's AgentLoopMetrics from rollstream's timings: model time, tool time, eval time."""
    traj_t = result.trajectory.timings_s if result.trajectory else {}
    return {"generate_sequences": float(traj_t.get("llm_s", 0.0)), "tool_calls": float(traj_t.get("tools_s", 0.0)),
            "compute_score": float(result.timings_s.get("eval_s", 0.0)), "num_preempted": -1}
