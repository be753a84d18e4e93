"""DAPO's dynamic sampling: keeps groups in flight through a rollout source until a batch of
groups with differing rewards is full, then cancels (or carries) what is left. Pure logic
over the RolloutSource protocol; trainer/source.py adapts the Redis client to it."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, Field

log = logging.getLogger(__name__)

P = TypeVar("P")
P_contra = TypeVar("P_contra", contravariant=True)  # a source only takes prompts


class RolloutResultLike(Protocol):
    """What the sampler reads from one finished job (rollstream.messages.Result fits)."""

    @property
    def job_id(self) -> str: ...
    @property
    def group_id(self) -> str | None: ...  # None: a job submitted alone, of no group of ours
    @property
    def status(self) -> str: ...  # "completed" | "failed" | "cancelled"
    # Whose fault a shortfall is (messages.FailureKind); sources without it may leave it out.
    @property
    def failure(self) -> str | None: ...
    @property
    def reward(self) -> float | None: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def trajectory(self) -> Any: ...


class RolloutSource(Protocol[P_contra]):
    """Where groups are run: the Redis client in production, a simulator in tests."""

    async def submit_group(self, prompt: P_contra, n: int) -> str:
        """Start n rollouts of `prompt`; return the group id their results will carry."""

    def results(self) -> AsyncIterator[RolloutResultLike]:
        """All results of submitted jobs, in arrival order, without end."""

    async def cancel_group(self, group_id: str) -> None:
        """Stop the group's jobs and free their sandboxes and LLM slots."""


def _infrastructure_failure(result: Any) -> bool:
    return getattr(result, "failure", None) == "infrastructure"


def _unscorable(result: Any) -> bool:
    """The service failed the rollout, or its environment is broken ('task'): nothing the
    policy did, so never a sample to score."""
    return getattr(result, "failure", None) in ("infrastructure", "task")


class SamplerStalled(RuntimeError):
    """Sampling cannot fill a batch: no rollout result for too long, every result too stale,
    or every rollout failing."""


class SamplerConfig(BaseModel):
    groups_per_batch: int = Field(8, ge=1, description="groups (prompts) with differing rewards per update")
    group_size: int = Field(8, ge=2, description="rollouts per prompt (G)")
    overflow_mode: Literal["cancel", "carry"] = Field(
        "cancel", description="on a full batch: cancel in-flight groups, or carry them into the next step"
    )
    max_staleness: int = Field(
        1, ge=0, description="carry/keep a group only if its policy version is at most this far behind"
    )
    oversample: float = Field(1.25, ge=1.0, description="slack on top of needed / keep_rate groups in flight")
    max_in_flight_groups: int = Field(64, ge=1, description="hard cap on groups in flight")
    min_keep_rate: float = Field(
        0.1, gt=0.0, le=1.0, description="floor of the keep-rate estimate (bounds over-submission)"
    )
    keep_rate_ema: float = Field(
        0.2, gt=0.0, le=1.0, description="weight of each new group outcome in the keep-rate estimate"
    )
    initial_keep_rate: float = Field(1.0, gt=0.0, le=1.0)
    min_completed_per_group: int = Field(2, ge=2, description="a group with fewer completed rollouts is dropped")
    result_timeout_s: float = Field(
        600.0, gt=0, description="raise SamplerStalled when no result arrives for this long"
    )
    max_failed_groups_in_a_row: int | None = Field(
        None,
        ge=1,
        description="raise SamplerStalled after this many groups in a row in which no rollout "
        "completed (every one failed: a broken backend, task or sandbox); default 2 × max_in_flight_groups",
    )
    seed: int = 0


class InFlightGroup(BaseModel):
    group_id: str
    prompt_index: int
    submitted_version: int


class SamplerState(BaseModel):
    """Everything needed to resume sampling where a checkpoint left it."""

    epoch: int = 0
    position: int = 0
    requeued: list[int] = Field(default_factory=list)
    keep_rate: float = 1.0
    groups_submitted: int = 0
    groups_kept: int = 0
    groups_dropped: int = 0
    in_flight: list[InFlightGroup] = Field(default_factory=list)


@dataclass
class SampledGroup:
    group_id: str
    prompt_index: int
    submitted_version: int
    results: list[Any] = field(default_factory=list)

    @property
    def completed(self) -> list[Any]:
        """The scored rollouts. An infrastructure or task failure is never among them: it is
        dropped from its group (not scored 0), whatever its status says."""
        return [r for r in self.results if r.status == "completed" and r.reward is not None and not _unscorable(r)]

    @property
    def rewards(self) -> list[float]:
        return [float(r.reward) for r in self.completed]

    @property
    def oldest_policy_version(self) -> int:
        versions = [r.policy_version for r in self.completed]
        return min(versions) if versions else self.submitted_version


@dataclass
class BatchStats:
    submitted: int = 0
    kept: int = 0
    dropped_equal: int = 0
    dropped_failed: int = 0
    dropped_stale: int = 0
    # rollouts dropped from their groups because the service failed them, and rollouts the
    # agent ended on its own limits (scored and kept: the policy's doing)
    rollouts_failed_infrastructure: int = 0
    rollouts_failed_agent: int = 0
    rollouts_failed_task: int = 0  # dropped too: their environment is broken (Result.task_failure)
    cancelled: int = 0
    carried: int = 0
    results: int = 0
    keep_rate: float = 1.0
    wait_s: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    # rewards of every group resolved this step, kept or dropped: the unbiased learning curve
    rewards_all: list[float] = field(default_factory=list)


@dataclass
class SampledBatch:
    groups: list[SampledGroup]
    stats: BatchStats


class DynamicSampler(Generic[P]):
    """Fills batches of informative groups; see module docstring.

    Call `await next_batch(policy_version)` once per training step. Between calls carried
    groups keep running (their results wait in the source)."""

    def __init__(self, source: RolloutSource[P], prompts: Sequence[P], config: SamplerConfig) -> None:
        if not prompts:
            raise ValueError("DynamicSampler needs at least one prompt; the task file was empty")
        self.source = source
        self.prompts = prompts
        self.config = config
        self.state = SamplerState(keep_rate=config.initial_keep_rate)
        self._in_flight: dict[str, SampledGroup] = {}
        self._orphans: list[InFlightGroup] = []
        self._results: AsyncIterator[RolloutResultLike] | None = None
        self._failed_groups_in_a_row = 0

    # ---- prompts -------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.config.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _next_prompt_index(self) -> int:
        if self.state.requeued:
            return self.state.requeued.pop(0)
        if self.state.position >= len(self.prompts):
            self.state.epoch += 1
            self.state.position = 0
        index = self._order(self.state.epoch)[self.state.position]
        self.state.position += 1
        return index

    # ---- in-flight bookkeeping -----------------------------------------------------
    def _target_in_flight(self, needed: int) -> int:
        if needed <= 0:
            return 0
        rate = max(self.state.keep_rate, self.config.min_keep_rate)
        return min(self.config.max_in_flight_groups, max(needed, math.ceil(needed / rate * self.config.oversample)))

    async def _submit(self, policy_version: int, stats: BatchStats) -> None:
        index = self._next_prompt_index()
        group_id = await self.source.submit_group(self.prompts[index], self.config.group_size)
        if group_id in self._in_flight:
            raise RuntimeError(f"rollout source returned group id {group_id!r} twice; group ids must be unique")
        self._in_flight[group_id] = SampledGroup(group_id, index, policy_version)
        self.state.groups_submitted += 1
        stats.submitted += 1
        log.debug("submitted group", extra={"group_id": group_id, "prompt_index": index})

    async def _top_up(self, needed: int, policy_version: int, stats: BatchStats) -> None:
        while len(self._in_flight) < self._target_in_flight(needed):
            await self._submit(policy_version, stats)

    async def _cancel(self, group: SampledGroup, requeue: bool = True) -> None:
        self._in_flight.pop(group.group_id, None)
        await self.source.cancel_group(group.group_id)
        if requeue:
            # the prompt was never trained on: give it back so an epoch still sees every prompt
            self.state.requeued.append(group.prompt_index)

    def _record_outcome(self, kept: bool) -> None:
        alpha = self.config.keep_rate_ema
        self.state.keep_rate = (1 - alpha) * self.state.keep_rate + alpha * (1.0 if kept else 0.0)
        if kept:
            self.state.groups_kept += 1
        else:
            self.state.groups_dropped += 1

    def _judge(self, group: SampledGroup, policy_version: int, stats: BatchStats) -> bool:
        rewards = group.rewards
        stats.rewards_all.extend(rewards)
        self._check_not_all_failing(group)
        if len(rewards) < self.config.min_completed_per_group:
            stats.dropped_failed += 1
            self._record_outcome(False)
            return False
        if max(rewards) - min(rewards) <= 1e-9:
            stats.dropped_equal += 1
            self._record_outcome(False)
            return False
        self._record_outcome(True)
        if policy_version - group.oldest_policy_version > self.config.max_staleness:
            stats.dropped_stale += 1
            if stats.dropped_stale > 4 * self.config.max_in_flight_groups:
                raise SamplerStalled(
                    f"every group is too stale: results carry policy version {group.oldest_policy_version} "
                    f"while the trainer is at {policy_version} (max_staleness={self.config.max_staleness}); "
                    "check that weight sync reaches every backend and that it reports the new version"
                )
            return False
        return True

    def _check_not_all_failing(self, group: SampledGroup) -> None:
        """Topping up replaces a failed group at once; when every rollout fails, that would
        go on for ever. Stop after a bound of groups in a row with no completed rollout."""
        if group.completed:
            self._failed_groups_in_a_row = 0
            return
        self._failed_groups_in_a_row += 1
        bound = self.config.max_failed_groups_in_a_row or 2 * self.config.max_in_flight_groups
        if self._failed_groups_in_a_row >= bound:
            errors = [getattr(r, "error", None) for r in group.results]
            last = next((e for e in reversed(errors) if e), "no error given")
            raise SamplerStalled(
                f"{self._failed_groups_in_a_row} groups in a row had no completed rollout; the last "
                f"failure: {last}. Check the task, the sandboxes and the LLM backends ('rollstream status')"
            )

    async def _next_result(self) -> RolloutResultLike:
        while True:
            if self._results is None:
                self._results = self.source.results().__aiter__()
            try:
                return await asyncio.wait_for(self._results.__anext__(), self.config.result_timeout_s)
            except StopAsyncIteration:
                self._results = None  # a source whose stream ended on a poll timeout: reopen
                await asyncio.sleep(0)
            except TimeoutError as exc:
                raise SamplerStalled(
                    f"no rollout result for {self.config.result_timeout_s:.0f} s with "
                    f"{len(self._in_flight)} groups in flight; check that init/run/eval workers "
                    "and an LLM backend are running ('rollstream status')"
                ) from exc

    # ---- the step --------------------------------------------------------------------
    async def next_batch(self, policy_version: int) -> SampledBatch:
        """Wait until `groups_per_batch` groups with differing rewards are complete."""
        started = time.monotonic()
        stats = BatchStats()
        for orphan in self._orphans:
            # in flight when the checkpoint was written; nobody reads their results now
            await self.source.cancel_group(orphan.group_id)
            self.state.requeued.append(orphan.prompt_index)
            stats.cancelled += 1
        self._orphans = []
        for stale in list(self._in_flight.values()):
            if policy_version - stale.submitted_version > self.config.max_staleness:
                await self._cancel(stale)
                stats.cancelled += 1

        batch: list[SampledGroup] = []
        need = self.config.groups_per_batch
        await self._top_up(need, policy_version, stats)
        while len(batch) < need:
            result = await self._next_result()
            stats.results += 1
            group = self._in_flight.get(result.group_id) if result.group_id is not None else None
            if group is None:
                continue  # a late result of a cancelled group
            if any(r.job_id == result.job_id for r in group.results):
                continue  # redelivered after a consumer crash: count each job once
            group.results.append(result)
            if _infrastructure_failure(result):
                stats.rollouts_failed_infrastructure += 1
            elif getattr(result, "failure", None) == "agent":
                stats.rollouts_failed_agent += 1
            elif getattr(result, "failure", None) == "task":
                stats.rollouts_failed_task += 1
            if len(group.results) < self.config.group_size:
                continue
            del self._in_flight[group.group_id]
            if self._judge(group, policy_version, stats):
                batch.append(group)
                stats.kept += 1
            elif len(batch) < need and len(self._in_flight) < self.config.max_in_flight_groups:
                await self._submit(policy_version, stats)  # the replacement, at once
            await self._top_up(need - len(batch), policy_version, stats)

        await self._finish_step(policy_version, stats)
        staleness = [policy_version - g.oldest_policy_version for g in batch]
        stats.staleness_mean = sum(staleness) / len(staleness)
        stats.staleness_max = max(staleness)
        stats.keep_rate = self.state.keep_rate
        stats.wait_s = time.monotonic() - started
        return SampledBatch(batch, stats)

    async def _finish_step(self, policy_version: int, stats: BatchStats) -> None:
        """The batch is full: cancel the redundant groups or carry those fresh enough."""
        for group in list(self._in_flight.values()):
            # the next step trains at policy_version + 1
            fresh = (policy_version + 1) - group.submitted_version <= self.config.max_staleness
            if self.config.overflow_mode == "carry" and fresh:
                stats.carried += 1
            else:
                await self._cancel(group)
                stats.cancelled += 1

    async def cancel_all(self) -> None:
        """Stop everything in flight (end of training)."""
        for group in list(self._in_flight.values()):
            await self._cancel(group)

    @property
    def in_flight_group_ids(self) -> list[str]:
        return list(self._in_flight)

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict:
        snapshot = self.state.model_copy(deep=True)
        snapshot.in_flight = [
            InFlightGroup(group_id=g.group_id, prompt_index=g.prompt_index, submitted_version=g.submitted_version)
            for g in self._in_flight.values()
        ]
        return snapshot.model_dump()

    def load_state_dict(self, state: dict) -> None:
        """Restore; groups that were in flight are cancelled and their prompts re-run at the
        next `next_batch` (their partial results are gone with the old process)."""
        self.state = SamplerState.model_validate(state)
        self._orphans = list(self.state.in_flight)
        self.state.in_flight = []
        self._in_flight = {}
