"""Back-pressure on a node, for a stage that declares it (``Stage.limits_by_node_sandboxes``:
init): its consumer loop pulls work only while the node has room for it. Two bounds, read
with every read of the stream: the node's live sandboxes (those of jobs on its run and eval
streams plus what this process is creating) under ``max_sandboxes_per_node``, and the jobs
queued for or at work in its run stage, with or without a sandbox, under the node's live run
slots plus ``init_run_ahead``: init never runs ahead of what run can serve, and jobs that no
node can start soon stay in the shared init stream for a node with room."""

from __future__ import annotations

import time
from collections import Counter

import redis.asyncio as aioredis

from rollstream.config import Settings
from rollstream.messages import RUN_STAGE
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.wire import FastRedis
from rollstream.pipeline.workerstate import WorkerRecord

# The node's sandbox count and its run stream's length in one reply. Run messages are deleted
# at their hand-off (transition.lua), so the length is the jobs queued for run or at work there.
_COUNT = "return {redis.call('SCARD', KEYS[1]), redis.call('XLEN', KEYS[2])}"
# How old the node's run slots may be while it has none (its run workers starting with init):
# otherwise a heartbeat interval, the pace at which run workers join and leave. Each look reads
# every live worker's record, so a fleet's init processes must not look much more often.
NO_RUN_SLOTS_FRESH_S = 0.5


async def node_slots(r: aioredis.Redis, keys: Keys, node: str, worker_ttl_s: float) -> tuple[Counter, Counter]:
    """``node``'s live worker slots by stage (workers that drain take no new work and are left
    out) and its workers by stage, from their records (workerstate.py)."""
    names = await r.zrangebyscore(keys.workers, time.time() - worker_ttl_s, "+inf")
    slots: Counter = Counter()
    workers: Counter = Counter()
    if not names:
        return slots, workers
    async with r.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.worker(name.decode() if isinstance(name, bytes) else str(name)))
        records = await pipe.execute()
    for rec in map(WorkerRecord.parse, records):
        if rec is not None and rec.node == node:
            workers[rec.stage] += 1
            if not rec.draining:
                slots[rec.stage] += rec.concurrency
    return slots, workers


class SandboxSlots:
    """The node's counts come with every read of the stream (``read_command``), and this
    process's forwards since then are added to them: estimates that can only be high (run's and
    eval's hand-offs lower the true counts), never low. A count cached for 50 ms without those
    forwards let the node reach 6 sandboxes with a limit of 3 (tests/pipeline/test_hot_path.py)."""

    def __init__(self, r: aioredis.Redis, reader: FastRedis | None, keys: Keys, node: str, settings: Settings):
        self.r = r
        self.reader = reader  # the loop's reading connection; None: plain redis-py, one EVAL a look
        self.keys, self.node = keys, node
        self.sandbox_key, self.run_stream = keys.node_sandboxes(node), keys.run_stream(node)
        self.limit = settings.max_sandboxes_per_node
        self.run_ahead = settings.init_run_ahead
        self.worker_ttl_s = settings.worker_ttl_s
        self.heartbeat_s = settings.heartbeat_interval_s
        self._at_read: tuple[int, int] | None = None  # (live sandboxes, run stream length)
        self._forwards_since_read = 0
        self._sandbox_forwards_since_read = 0
        self._run_slots = 0
        self._run_slots_at = float("-inf")

    async def free(self, free: int, inflight: int) -> int:
        """How many of the loop's ``free`` slots the node's sandboxes and run slots leave it."""
        if self._at_read is None:  # unknown, or no room at the last look: ask now
            if self.reader is not None:
                self.reader.uncork()  # with the hand-offs held so far
            self._reset_forwards()
            self.counted(await (self.reader.execute("EVAL", _COUNT, 2, self.sandbox_key, self.run_stream)
                                if self.reader else self.r.eval(_COUNT, 2, self.sandbox_key, self.run_stream)))
        fresh_s = self.heartbeat_s if self._run_slots else min(self.heartbeat_s, NO_RUN_SLOTS_FRESH_S)
        if time.monotonic() - self._run_slots_at > fresh_s:
            self._run_slots = (await node_slots(self.r, self.keys, self.node, self.worker_ttl_s))[0][RUN_STAGE]
            self._run_slots_at = time.monotonic()
        assert self._at_read is not None
        live, queued = self._at_read
        free = min(free,
                   self.limit - (live + self._sandbox_forwards_since_read) - inflight,
                   self._run_slots + self.run_ahead - (queued + self._forwards_since_read) - inflight)
        if free <= 0 or self.reader is None:
            self._at_read = None
        return free

    def read_command(self) -> tuple:
        """The counts, to send in the same write as the stream read; its reply goes to ``counted``."""
        self._reset_forwards()  # hand-offs sent before it are in its reply
        return ("EVAL", _COUNT, 2, self.sandbox_key, self.run_stream)

    def counted(self, reply) -> None:
        self._at_read = (int(reply[0]), int(reply[1]))

    def _reset_forwards(self) -> None:
        self._forwards_since_read = self._sandbox_forwards_since_read = 0

    def forwarded(self, with_sandbox: bool) -> None:
        """This process handed a job on to run: it counts against the node's run slots now, and
        against its sandboxes if it has one."""
        self._forwards_since_read += 1
        self._sandbox_forwards_since_read += with_sandbox
