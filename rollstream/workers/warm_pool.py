"""Init's warm pool: sandboxes started before any job asks for them, so that a job's run slot
never waits on sandbox creation. Each init process keeps ready sandboxes per exact sandbox spec
(image, backend, limits, mounts, network: the spec after the node's backend and the operator's
policy), for the specs its jobs asked for lately (a spec never asked for is never warmed), as
many as the run slots it expects to fill, within the memory the node has left at what its job
sandboxes measure (``warm_pool_cap``, ``planned_sandbox_mb``). A warm sandbox goes to one job,
unused (nothing to reset), and is the job's from then on; idle ones go after
``warm_pool_idle_ttl_s``, and all of them when the worker stops or its node drains.

Pooled sandboxes are named in ``rs:node:{node}:warm`` with a lease that the pool renews: the
node's reaper (workers/node_reaper.py) spares those and reaps the rest, so a SIGKILLed worker's
pool is torn down like any orphan once its lease runs out."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from rollstream.config import Settings
from rollstream.pipeline.jobstate import JobStateFields, hash_args
from rollstream.pipeline.keys import Keys
from rollstream.sandbox_spec import SandboxHandle, SandboxSpec
from rollstream.sandboxes import capacity
from rollstream.sandboxes.errors import SandboxError
from rollstream.sandboxes.lifecycle import (
    create_sandbox,
    destroy_sandbox,
    reassign_owner,
)
from rollstream.sandboxes.reaper import Reaper
from rollstream.workers.sandbox_slots import node_slots

log = logging.getLogger(__name__)

# A claimed sandbox stays spared by its lease while its job is still in init (the job's state
# names it only once init hands the job on): as long as a job's sandbox is spared in init.
CLAIMED_LEASE_S = 600.0
# Sandboxes of one pool started at once (creation is CPU-bound: a burst would slow the jobs).
MAX_STARTING = 4
# How often the pool measures what the node's job sandboxes cost, and how many of them at most
# (a measure reads /proc/PID/smaps_rollup of every process of each: ~1 ms a sandbox).
MEASURE_EVERY_S = 30.0
MEASURE_SAMPLE = 32
# Backends whose sandbox is its supervisor's process tree, so that its PSS is the sandbox's
# cost; a container engine's processes are the engine's children (docker: the configured figure).
MEASURED_BACKENDS = ("bwrap", "local")


def planned_sandbox_mb() -> float:
    """What the pool plans one sandbox at: the node's job sandboxes as this process measured
    them (the largest mean seen: their harnesses, kernels and what their cells hold), never less
    than a sandbox with a live kernel (``capacity.sandbox_mb("kernel")``), since a job's kernel
    and harness may start after it was measured."""
    return max(capacity.sandbox_mb("kernel"), capacity.measured_mb("job") or 0.0)


def measure_job_sandboxes(root: str, sample: int = MEASURE_SAMPLE) -> float | None:
    """Measure up to ``sample`` of the jobs' sandboxes running under ``root`` (the newest;
    warm ones, which no job uses yet, left out) into ``capacity``'s figure for "job"; their mean
    MB, or None when there is none to measure."""
    records = [rec for rec in Reaper(root).sandboxes()
               if rec.running and rec.supervisor_pid and rec.backend in MEASURED_BACKENDS
               and not rec.owner.startswith("warm-")]
    records.sort(key=lambda rec: rec.created_at, reverse=True)
    pids = [rec.supervisor_pid for rec in records[:sample] if rec.supervisor_pid]
    try:
        return capacity.observe("job", pids) if pids else None
    except ValueError:  # they all ended while we looked
        return None


def warm_pool_cap(wanted: int, sandboxes_in_use: int, max_warm: int, node_capacity: int | None = None,
                  warm_now: int = 0) -> int:
    """How many warm sandboxes a node's pool should hold: the ``wanted`` (init: the node's run
    slots that no job's sandbox fills; eval: the node's jobs that will verify in a fresh sandbox),
    at most ``max_warm``, and no more than the node can hold beside the sandboxes in use.
    ``node_capacity``: the sandboxes the node can hold in all, those live now (in use and
    ``warm_now``) included; by default ``capacity.node_capacity`` at ``planned_sandbox_mb``: what
    the node's job sandboxes measure, at least one with an IPython kernel (bench/density.py)."""
    if node_capacity is None:
        node_capacity = capacity.node_capacity("kernel", live_sandboxes=sandboxes_in_use + warm_now,
                                               per_sandbox_mb=planned_sandbox_mb())
    return max(0, min(max_warm, wanted, node_capacity - sandboxes_in_use))


def spec_key(spec: SandboxSpec) -> str:
    """Equal for specs a warm sandbox may serve interchangeably: every field equal."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, default=str)


@dataclass
class _Warm:
    handle: SandboxHandle
    ready_at: float


@dataclass
class _Shelf:
    """The pool's sandboxes of one spec and the recent asks for it."""

    spec: SandboxSpec
    idle: list[_Warm] = field(default_factory=list)
    starting: int = 0
    waiting: int = 0  # jobs waiting for one of the ``starting`` sandboxes
    asks: deque = field(default_factory=deque)  # times a job asked for this spec
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as a start ends

    def start_ended(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class WarmPool:
    """One stage process's pool (init: the jobs' sandboxes; eval: the fresh sandboxes tasks
    verify in, started while the agents still work). ``take`` hands a job a ready sandbox of
    its exact spec, or None; ``run`` keeps the pool filled until cancelled, then destroys what
    it holds."""

    def __init__(self, settings: Settings, r, keys: Keys, root: str, *, stage: str,
                 wanted: Callable[[Counter, int], int], replaces_job_sandbox: bool = False):
        """``wanted(slots, in_use)``: how many sandboxes the stage expects to be asked for soon,
        from the node's live worker slots by stage and its job sandboxes in use.
        ``replaces_job_sandbox``: a sandbox taken here takes the place of the job's own (eval)."""
        self.s, self.r, self.keys, self.root, self.stage = settings, r, keys, root, stage
        self.wanted, self.replaces_job_sandbox = wanted, replaces_job_sandbox
        self.owner = f"warm-{uuid.uuid4().hex[:12]}"  # this pool's sandboxes before a job has them
        self.lease_key = keys.node_warm(settings.node)
        self.shelves: dict[str, _Shelf] = {}
        self.hits = self.misses = 0
        self._starts: set[asyncio.Task] = set()
        self._ending: set[asyncio.Future] = set()  # destroys under way
        self._measured_at = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.s.warm_pool_max_per_node > 0

    @property
    def lease_s(self) -> float:
        return max(3 * self.s.warm_pool_check_s, self.s.worker_ttl_s)

    # -- a job asks ------------------------------------------------------------------------
    async def take(self, spec: SandboxSpec, job_id: str) -> SandboxHandle | None:
        """A ready sandbox of exactly ``spec``, now ``job_id``'s, or one the pool is starting
        for no other job (it is ready sooner than one started now); None when there is neither
        (the pool learns the spec is wanted and warms it from then on). The reaper spares it until
        the job's state names it: init's hand-on, or at once in eval (``_replaces``)."""
        if not self.enabled:
            return None
        key = spec_key(spec)
        shelf = self.shelves.get(key)
        if shelf is None:
            shelf = self.shelves[key] = _Shelf(spec)
        shelf.asks.append(time.monotonic())
        while shelf.idle or shelf.starting > shelf.waiting:
            if not shelf.idle:
                shelf.waiting += 1
                try:
                    await shelf.changed.wait()
                finally:
                    shelf.waiting -= 1
                continue
            warm = shelf.idle.pop(0)  # the oldest: the rest stay within their time to live longer
            try:
                await self.r.zadd(self.lease_key, {warm.handle.id: time.time() + CLAIMED_LEASE_S})
                handle = await asyncio.to_thread(reassign_owner, warm.handle, job_id)
                if self.replaces_job_sandbox:
                    await self._replaces(job_id, handle.id)
            except (redis.RedisError, OSError, SandboxError) as exc:
                log.warning("warm sandbox %s could not be handed to job %s (%s); destroying it", warm.handle.id,
                            job_id, exc)
                await self._destroy(warm.handle)
                continue
            except asyncio.CancelledError:  # the job was cancelled meanwhile: it never had it
                await self._destroy(warm.handle)
                raise
            self.hits += 1
            return handle
        self.misses += 1
        return None

    async def _replaces(self, job_id: str, sandbox_id: str) -> None:
        """Eval's fresh sandbox takes the place of the job's own (destroyed just before) in the
        node's count and in the job's state, as one made under the job's id would: the count
        stays true for init's back-pressure, and the reaper keeps the new one as the job's."""
        job_key, live_key = self.keys.job(job_id), self.keys.node_sandboxes(self.s.node)
        before = await self.r.hget(job_key, "sandbox")
        async with self.r.pipeline(transaction=True) as pipe:
            if before:
                pipe.srem(live_key, before)
            pipe.sadd(live_key, sandbox_id)
            pipe.hset(job_key, items=hash_args(JobStateFields(sandbox=sandbox_id)))
            await pipe.execute()

    # -- keeping it filled -------------------------------------------------------------------
    async def run(self) -> None:
        if not self.enabled:
            return
        try:
            while True:
                try:
                    await self.tick()
                except (redis.RedisError, OSError) as exc:
                    log.warning("warm pool: %s; trying again", exc)
                await asyncio.sleep(self.s.warm_pool_check_s)
        finally:
            await asyncio.shield(self.close())

    async def tick(self) -> None:
        """Renew the leases, let idle sandboxes past their time go, and start what the wanted
        specs lack."""
        now_mono = time.monotonic()
        idle = [w for shelf in self.shelves.values() for w in shelf.idle]
        if idle:
            await self.r.zadd(self.lease_key, {w.handle.id: time.time() + self.lease_s for w in idle})
        for shelf in self.shelves.values():
            while shelf.asks and now_mono - shelf.asks[0] > self.s.warm_pool_idle_ttl_s:
                shelf.asks.popleft()
            expired = [w for w in shelf.idle if now_mono - w.ready_at > self.s.warm_pool_idle_ttl_s]
            for warm in expired:
                shelf.idle.remove(warm)
                await self._destroy(warm.handle)
        if now_mono - self._measured_at > MEASURE_EVERY_S:
            self._measured_at = now_mono
            try:
                await asyncio.to_thread(measure_job_sandboxes, self.root)
            except (OSError, SandboxError) as exc:  # the last figure stands
                log.warning("warm pool: the node's sandboxes not measured (%s)", exc)
        targets = self.targets(await self.total_target())
        for key, shelf in self.shelves.items():
            want = targets.get(key, 0)
            while len(shelf.idle) > want:  # demand moved to other specs: the newest go first
                await self._destroy(shelf.idle.pop().handle)
            for _ in range(min(want - len(shelf.idle) - shelf.starting, MAX_STARTING - len(self._starts))):
                shelf.starting += 1
                task = asyncio.create_task(self._start(shelf))
                self._starts.add(task)
                task.add_done_callback(self._starts.discard)

    async def total_target(self) -> int:
        """This process's share of the node's warm sandboxes (``warm_pool_cap``), split evenly
        among the node's workers of its stage."""
        slots, workers = await node_slots(self.r, self.keys, self.s.node, self.s.worker_ttl_s)
        in_use = int(await self.r.scard(self.keys.node_sandboxes(self.s.node)))
        wanted, peers = self.wanted(slots, in_use), max(1, workers[self.stage])
        warm_now = sum(len(s.idle) + s.starting for s in self.shelves.values())
        cap = warm_pool_cap(wanted, in_use, self.s.warm_pool_max_per_node, warm_now=warm_now * peers)
        return math.ceil(cap / peers)

    def targets(self, total: int) -> dict[str, int]:
        """``total`` split over the specs asked for within the time to live, by their share of the asks."""
        asks = {key: len(shelf.asks) for key, shelf in self.shelves.items() if shelf.asks}
        count = sum(asks.values())
        return {key: math.ceil(total * n / count) for key, n in asks.items()} if count else {}

    async def _start(self, shelf: _Shelf) -> None:
        sandbox_id, handle = f"{self.owner}-{self.stage[0]}{uuid.uuid4().hex[:8]}", None
        try:
            # Named before it exists: the node's reaper must never find it unclaimed.
            await self.r.zadd(self.lease_key, {sandbox_id: time.time() + self.lease_s + shelf.spec.setup_timeout_s})
            handle = await create_sandbox(shelf.spec, sandbox_id=sandbox_id, owner=self.owner, root_dir=self.root)
        except (SandboxError, OSError) as exc:  # a spec that does not start here: its jobs will say why
            log.warning("warm pool: sandbox for a wanted spec did not start (%s)", exc)
        finally:
            shelf.starting -= 1
            if handle is not None:
                shelf.idle.append(_Warm(handle, time.monotonic()))
            else:  # failed, or cancelled (create_sandbox took down what it had made): its lease goes too
                self._track_ending(self._drop_lease(sandbox_id))
            shelf.start_ended()

    async def _destroy(self, handle: SandboxHandle) -> None:
        """Destroy one of the pool's sandboxes, to the end even if the caller is cancelled (the
        worker stopping): ``close`` waits for it."""
        await asyncio.shield(self._track_ending(self._teardown(handle)))

    def _track_ending(self, coro) -> asyncio.Future:
        ending = asyncio.ensure_future(coro)
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)
        return ending

    async def _teardown(self, handle: SandboxHandle) -> None:
        try:
            await destroy_sandbox(handle)
        finally:
            await self._drop_lease(handle.id)

    async def _drop_lease(self, sandbox_id: str) -> None:
        try:
            await self.r.zrem(self.lease_key, sandbox_id)
        except (redis.RedisError, OSError) as exc:  # it runs out by itself
            log.warning("warm pool: lease of %s not removed (%s)", sandbox_id, exc)

    async def close(self) -> None:
        """Destroy every sandbox the pool holds or is starting (the worker stops, its node drains)."""
        for task in list(self._starts):
            task.cancel()
        await asyncio.gather(*self._starts, return_exceptions=True)
        held = [w.handle for shelf in self.shelves.values() for w in shelf.idle]
        for shelf in self.shelves.values():
            shelf.idle.clear()
        for handle, outcome in zip(held, await asyncio.gather(*(self._destroy(h) for h in held),
                                                              return_exceptions=True)):
            if isinstance(outcome, BaseException):
                log.error("warm pool: sandbox %s not destroyed at shutdown (%r); the node's reaper will", handle.id,
                          outcome)
        await asyncio.gather(*self._ending, return_exceptions=True)
        if held:
            log.info("warm pool: destroyed %d idle sandboxes at shutdown", len(held))
