"""What every stage worker shares: the Stage interface the consumer loop drives, the
outcomes a stage returns, and the per-process context (Redis, names, the node's sandboxes,
the services the stage started)."""

from __future__ import annotations

import asyncio
import functools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from rollstream.config import Settings
from rollstream.messages import STAGES, Envelope, FailureKind, Result, ResultStatus, StageName
from rollstream.pipeline.handoff import Handoff
from rollstream.pipeline.keys import Keys
from rollstream.tasks.base import ProcessServices, TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.node_sandboxes import NodeSandboxes


@dataclass
class Forward:
    """Send the job on to ``stage`` on this node."""

    stage: StageName


@dataclass
class WorkerContext:
    settings: Settings
    redis: aioredis.Redis
    keys: Keys
    handoff: Handoff
    services: ProcessServices = field(default_factory=ProcessServices)

    @property
    def node(self) -> str:
        return self.settings.node

    @functools.cached_property
    def sandboxes(self) -> NodeSandboxes:
        return NodeSandboxes.from_settings(self.settings)

    def task_context(self, cancelled=None) -> TaskContext:
        ctx = TaskContext(node=self.settings.node, work_dir=self.work_dir, services=self.services)
        if cancelled is not None:
            ctx.cancelled = cancelled
        return ctx

    @functools.cached_property
    def work_dir(self) -> Path:
        """The node's folder for task work (made by the worker process at start)."""
        return self.settings.data_dir / "work"


# Finish reasons of an episode that ended on one of the policy's own limits: its result is
# scored and trained on, and says failure="agent".
AGENT_LIMIT_FINISHES = frozenset({"max_turns", "context", "length", "timeout", "harness_error",
                                  "harness_timeout"})


def completed_result(env: Envelope, reward: float) -> Result:
    traj = env.trajectory
    if traj is not None:
        traj.reward = reward
    failure = "agent" if traj is not None and traj.finish_reason in AGENT_LIMIT_FINISHES else None
    return Result(job_id=env.job.job_id, group_id=env.job.group_id, submitter=env.job.submitter,
                  task=env.job.task, status="completed", reward=reward, trajectory=traj, failure=failure,
                  attempts=env.attempt + 1, policy_version=traj.policy_version if traj else 0,
                  timings_s=env.timings_s, metadata=env.job.metadata)


def ended_result(env: Envelope, status: ResultStatus, error: str, stage: StageName,
                 failure: FailureKind | None = None) -> Result:
    """A failed or cancelled result. ``failure`` defaults to "cancelled" for a cancelled job
    and "infrastructure" for a failed one: a stage that gives up on a job is the service
    failing it unless the caller knows better (an invalid job, the agent's own failure)."""
    if failure is None:
        failure = "cancelled" if status == "cancelled" else "infrastructure"
    return Result(job_id=env.job.job_id, group_id=env.job.group_id, submitter=env.job.submitter,
                  task=env.job.task, status=status, error=error, error_stage=stage, failure=failure,
                  attempts=env.attempt + 1, timings_s=env.timings_s, metadata=env.job.metadata,
                  trajectory=env.trajectory, finished_at=time.time())


def active_s(env: Envelope, stage: StageName) -> float:
    """Seconds this attempt of the job has spent at work in the stages before ``stage``: what
    its ``timeout_s`` counts (queue time does not). Each attempt restarts from init, so the
    earlier stages' timings are always this attempt's own."""
    return sum(env.timings_s.get(f"{s}_s", 0.0) for s in STAGES[:STAGES.index(stage)])


def queued_s(env: Envelope, stage: StageName) -> float:
    """Seconds the job has waited in stage queues up to the start of ``stage`` (that stage's
    own wait included): what its ``queue_timeout_s`` bounds."""
    return sum(env.timings_s.get(f"{s}_wait_s", 0.0) for s in STAGES[:STAGES.index(stage) + 1])


class Stage(ABC):
    """One pipeline stage. ``process`` does the stage's work on a job and returns where
    it goes next (a ``Forward``) or its final ``Result``."""

    name: StageName
    # Pull work only while the node has sandbox slots free (init's back-pressure): the loop
    # reads the node's sandbox count with every read of the stream.
    limits_by_node_sandboxes: bool = False
    # Read the stream through init's waiting room, best priority first (pipeline/priorities.py).
    serves_by_priority: bool = False
    # Move the jobs of dead nodes back to init, every worker_ttl_s / 2.
    rescues_dead_nodes: bool = False
    # A job redelivered here because its worker died mid-job starts over from init (what its
    # sandbox went through is unknown); a stage before any sandbox exists just runs it again.
    restarts_redelivered_jobs: bool = True

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    async def start_services(self, worker_id: str) -> list[asyncio.Task]:
        """Start what this stage's tasks reach through the context's services, and its node
        duties; returns the background tasks to cancel at shutdown."""
        return []

    def admission_problem(self, env: Envelope) -> str | None:
        """Why a message read from this stage's stream is refused before any work, or None."""
        return None

    @abstractmethod
    async def process(self, env: Envelope, tctx: TaskContext) -> Forward | Result: ...

    async def release(self, env: Envelope, tctx: TaskContext | None = None) -> None:
        """Free what the job holds on this node: it is leaving the node. What its task's
        ``setup`` made goes first (the task's ``teardown``, with ``tctx`` when the stage has
        one), then its sandbox."""
        try:
            task = get_task(env.job.task)
        except Exception:  # a task unknown here made nothing here; a sandbox it has still goes
            task = None
        try:
            if task is not None:
                await task.teardown(env, tctx or self.ctx.task_context())
        finally:
            if env.sandbox is not None:
                await self.ctx.sandboxes.destroy(env)
