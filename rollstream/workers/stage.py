"""What every stage worker shares: the Stage interface the consumer loop drives (its work
returns a ``pipeline.handoff.Forward`` or the job's ``Result``) and the per-process context
(Redis, names, the node's sandboxes, the services the stage started)."""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from rollstream.agent.services import ProcessServices
from rollstream.config import Settings
from rollstream.messages import Envelope, Result, StageName
from rollstream.pipeline.handoff import Forward, Handoff
from rollstream.pipeline.keys import Keys
from rollstream.tasks.base import TaskContext
from rollstream.tasks.registry import get_task
from rollstream.workers.node_sandboxes import NodeSandboxes


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
