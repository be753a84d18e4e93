"""The typed messages that cross process boundaries: a job as submitted, the envelope that
carries it from stage to stage, and the result its submitter receives. One codec
(``rollstream.pipeline.codec``) puts them on the wire as msgpack."""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Any, Literal, TypeAlias, get_args

from pydantic import BaseModel, ConfigDict, Field

from rollstream.episode_settings import AgentOverrides
from rollstream.sampling import SamplingParams
from rollstream.sandbox_spec import SandboxHandle, SandboxOverrides
from rollstream.trajectory import Trajectory

JobStatus = Literal["queued", "running", "completed", "failed", "cancelled"]
# The stages, in the order a job goes through them: the one place they are spelled. init's
# stream is shared; run and eval are per node, where the job's sandbox is.
StageName = Literal["init", "run", "eval"]
STAGES: tuple[StageName, ...] = get_args(StageName)
INIT_STAGE, RUN_STAGE, EVAL_STAGE = STAGES
NODE_STAGES = STAGES[1:]  # those whose streams are per node (run, eval)
# Where a job's state hash says it is: a stage, or out of the pipeline (a result, a dead letter).
JobStage = StageName | Literal["done", "dead"]
ResultStatus = Literal["completed", "failed", "cancelled"]
# Whose fault a result's shortfall is. "infrastructure": the service failed the job (sandbox,
# backend, worker, a service timeout); trainers drop it per sample, never score it.
# "agent": the policy's own (context exhausted, max turns, its time budget); trained on as
# scored. "job": the submission itself is invalid. "task": the environment itself is broken (a
# Dockerfile that does not build, a verifier that writes no reward, an environment server or
# package that crashes): never retried, never trained on, its own error in the result.
# "cancelled": its submitter stopped it.
FailureKind = Literal["infrastructure", "agent", "job", "task", "cancelled"]
# Finish reasons of an episode that ended on one of the policy's own limits: its result is
# scored and trained on, and says failure="agent".
AGENT_LIMIT_FINISHES = frozenset({"max_turns", "context", "length", "timeout", "harness_error",
                                  "harness_timeout"})
# What a task hands from one of its stages to the next on the same node (``Envelope.state``):
# flat, named values (a flag, a count, a name). Never a path or a handle to trust: a message
# on a stream may carry anything, so a task rebuilds those from the job's id.
TaskState: TypeAlias = dict[str, str | int | float | bool | None]


# One grammar for every id that reaches a Redis key name or a path: job, group and submitter
# ids. ASCII letters, digits, '_', '.' and '-', starting with a letter or digit (so never '/',
# '..', ':', NUL or a leading '-'), at most 128 characters. A pattern, checked in pydantic-core,
# not a Python validator: every stage validates the job again, and a Python call there costs
# a quarter of the job's validation.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
ID_RULE = "1 to 128 ASCII letters, digits, '_', '.' or '-', starting with a letter or digit"
_ID_RE = re.compile(ID_PATTERN.removeprefix("^").removesuffix("$"))

# Bounds on the free-form parts of a job (instance, agent, sandbox, metadata), checked once
# at the door (client, API, a message added to the init stream by hand), not at every stage:
# what msgpack, JSON and the other side of the API can carry without failing later.
MAX_NESTING = 32
INT_RANGE = (-(2**63), 2**63 - 1)


def valid_id(value: object) -> bool:
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def new_id() -> str:
    return uuid.uuid4().hex


def _where(path: tuple) -> str:
    parts: list[str] = []
    while path:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    text = "".join(reversed(parts)).lstrip(".")
    return text if len(text) <= 120 else text[:60] + "…" + text[-50:]


_LOW, _HIGH = INT_RANGE


def _plainly_fine(value: dict | list, depth: int) -> bool:
    """The fast check of a JSON-like container: True when every value is a str, bool, None,
    an int in range, a finite float, or such a dict or list within the nesting bound. False
    sends the value to the walk that finds (and names) the problem, if there is one."""
    for item in value.values() if type(value) is dict else value:
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if _LOW <= item <= _HIGH:
                continue
            return False
        if kind is float:
            if item - item == 0.0:  # NaN and ±inf give NaN
                continue
            return False
        if (kind is dict or kind is list) and depth < MAX_NESTING and _plainly_fine(item, depth + 1):
            continue
        return False
    return True


def payload_problem(value: object, field: str) -> str | None:
    """Why ``value`` (a free-form part of a job) cannot travel, naming where; None if it can.
    Nesting deeper than ``MAX_NESTING``, integers outside 64 bits and NaN or infinite numbers
    are refused: each would fail later, at a stage or in the submitter's results."""
    if isinstance(value, (dict, list)) and type(value) in (dict, list) and _plainly_fine(value, 1):
        return None
    stack: list[tuple[object, tuple, int]] = [(value, (None, field), 0)]
    while stack:
        item, path, depth = stack.pop()
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if isinstance(item, (dict, list, tuple)):
            if depth >= MAX_NESTING:
                return f"{_where(path)} nests deeper than {MAX_NESTING} levels"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            stack.extend((child, (path, key), depth + 1) for key, child in pairs)
        elif isinstance(item, int) and not INT_RANGE[0] <= item <= INT_RANGE[1]:
            digits = str(item) if item.bit_length() < 200 else f"a {item.bit_length()}-bit integer"
            return f"{_where(path)}: {digits} is outside the 64-bit integer range"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{_where(path)}: {item} is not a finite number"
    return None


def job_problem(job: Job) -> str | None:
    """The first bound a job breaks (see ``payload_problem``), or None."""
    if not 0 <= job.priority <= 100:  # a Job copied with an update skips the field's own check
        return f"priority {job.priority} is outside 0-100"
    for field in ("instance", "agent", "sandbox", "metadata"):
        value = getattr(job, field)
        if value:
            problem = payload_problem(value, field)
            if problem:
                return problem
    extra = job.sampling.model_extra
    return payload_problem(extra, "sampling") if extra else None


class Job(BaseModel):
    """One rollout: a task instance, agent and sampling settings, and where results go.

    ``instance`` is the task's own payload (a prompt, a repository, tests); the named
    task validates it at submit time."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task: str = Field(min_length=1, max_length=200)
    instance: dict[str, Any] = Field(default_factory=dict)
    job_id: str = Field(default_factory=new_id, max_length=128, pattern=ID_PATTERN,
                        description=f"{ID_RULE} (ids go into Redis key names and paths)")
    group_id: str | None = Field(default=None, max_length=128, pattern=ID_PATTERN, description=ID_RULE)
    submitter: str = Field("default", max_length=128, pattern=ID_PATTERN,
                           description=f"{ID_RULE}; its results arrive on <namespace>:results:<submitter>")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    agent: AgentOverrides = Field(default_factory=AgentOverrides, description="Agent-loop overrides "
                                  "(max_turns, max_context_tokens, harness, ...).")
    sandbox: SandboxOverrides | None = Field(default=None, description="Sandbox spec overrides, as the "
                                             "operator's policy allows; the task supplies the rest.")
    timeout_s: float = Field(3600.0, gt=0, description="Seconds the job may spend at work in its stages "
                             "(init, run, eval, summed); time waiting in queues does not count.")
    queue_timeout_s: float | None = Field(None, gt=0, description="Seconds the job may wait in stage queues "
                                          "(summed) before it fails unrun; None waits as long as it takes.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Returned unchanged in the result.")
    priority: int = Field(50, ge=0, le=100, description="0-100, higher first: init serves queued jobs by "
                          "queue time + (100 - priority) * priority_aging_s, so none starves.")
    submitted_at: float = Field(default_factory=time.time)


class Envelope(BaseModel):
    """A job in flight: the job plus what earlier stages produced. This is what the
    stage streams carry."""

    job: Job
    attempt: int = Field(0, ge=0, le=1_000_000, description="Times the job was restarted from init.")
    node: str | None = None
    sandbox: SandboxHandle | None = Field(default=None, description="Handle of the sandbox init made.")
    state: TaskState = Field(default_factory=dict, description="Task state handed from init to run and eval.")
    trajectory: Trajectory | None = None
    reward: float | None = None
    timings_s: dict[str, float] = Field(default_factory=dict)
    errors: list[str] = Field(default_factory=list, description="Errors of earlier attempts.")

    def restarted(self, failed_with: str | None = None) -> Envelope:
        """The job as init takes it again: nothing a node made for it (sandbox, state,
        trajectory, node) goes with it. ``failed_with``: the error of the attempt that ends
        here, which counts as one; None for a job handed back unfinished, which does not."""
        update: dict[str, Any] = {"sandbox": None, "state": {}, "trajectory": None, "node": None}
        if failed_with is not None:
            update |= {"attempt": self.attempt + 1, "errors": [*self.errors, failed_with]}
        return self.model_copy(update=update)

    def is_last_attempt(self, max_attempts: int) -> bool:
        return self.attempt + 1 >= max_attempts

    def with_earlier_errors(self, error: str) -> str:
        """``error``, followed by those of the job's earlier attempts: what a dead letter says."""
        return error + ("; earlier attempts: " + " | ".join(self.errors) if self.errors else "")


class Result(BaseModel):
    """What a submitter receives, exactly once per job."""

    job_id: str
    group_id: str | None = None
    submitter: str = "default"
    task: str = ""
    status: ResultStatus
    reward: float | None = None
    trajectory: Trajectory | None = None
    error: str | None = None
    error_stage: str | None = None
    failure: FailureKind | None = Field(
        default=None, description="Whose fault a shortfall is: set on every failed or cancelled result, and "
        "'agent' on a completed one whose episode hit a limit; None for a clean completion. Trainers drop "
        "'infrastructure' and 'task' per sample (see rollstream.trainer.sampler).")
    attempts: int = 1
    policy_version: int = 0
    timings_s: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    finished_at: float = Field(default_factory=time.time)

    @classmethod
    def completed(cls, env: Envelope, reward: float) -> Result:
        """The job's scored result; failure="agent" when its episode ended on a policy limit."""
        traj = env.trajectory
        if traj is not None:
            traj.reward = reward
        failure: FailureKind | None = \
            "agent" if traj is not None and traj.finish_reason in AGENT_LIMIT_FINISHES else None
        return cls(job_id=env.job.job_id, group_id=env.job.group_id, submitter=env.job.submitter,
                   task=env.job.task, status="completed", reward=reward, trajectory=traj, failure=failure,
                   attempts=env.attempt + 1, policy_version=traj.policy_version if traj else 0,
                   timings_s=env.timings_s, metadata=env.job.metadata)

    @classmethod
    def failed(cls, env: Envelope, error: str, stage: str, failure: FailureKind = "infrastructure") -> Result:
        """The job failed in ``stage``: by default the service's failure, unless the caller
        knows better (an invalid job, a broken task, the agent's own failure)."""
        return cls._unfinished(env, "failed", error, stage, failure)

    @classmethod
    def cancelled(cls, env: Envelope, reason: str, stage: str) -> Result:
        return cls._unfinished(env, "cancelled", reason, stage, "cancelled")

    @classmethod
    def _unfinished(cls, env: Envelope, status: ResultStatus, error: str, stage: str, failure: FailureKind) -> Result:
        return cls(job_id=env.job.job_id, group_id=env.job.group_id, submitter=env.job.submitter,
                   task=env.job.task, status=status, error=error, error_stage=stage, failure=failure,
                   attempts=env.attempt + 1, timings_s=env.timings_s, metadata=env.job.metadata,
                   trajectory=env.trajectory, finished_at=time.time())

    @classmethod
    def invalid_job(cls, job_id: str, submitter: str, error: str, stage: str, *, group_id: str | None = None,
                    task: str = "") -> Result:
        """A failed result that carries only the job's ids: for a message that cannot be read
        or carried on as a job, whose other parts are what failed."""
        return cls(job_id=job_id, group_id=group_id, submitter=submitter, task=task, status="failed", error=error,
                   error_stage=stage, failure="job")

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    @property
    def infrastructure_failure(self) -> bool:
        """The service, not the policy, failed this job: a sample to drop, never to score 0."""
        return self.failure == "infrastructure"

    @property
    def task_failure(self) -> bool:
        """The environment itself is broken (its build, its verifier, its server): a sample to
        drop and a task to mend, never one to score 0 or to run again as it is."""
        return self.failure == "task"


class DeadLetter(BaseModel):
    """An entry of the dead-letter stream: why a job could not be processed."""

    job_id: str | None
    submitter: str | None
    stage: str
    error: str
    deliveries: int = 0
    raw: bytes | None = Field(default=None, description="The undecodable message, if it could not be read.")
    envelope: Envelope | None = None
    at: float = Field(default_factory=time.time)

    @classmethod
    def of_job(cls, env: Envelope, stage: str, error: str, *, with_envelope: bool = True) -> DeadLetter:
        return cls(job_id=env.job.job_id, submitter=env.job.submitter, stage=stage, error=error,
                   envelope=env if with_envelope else None)
