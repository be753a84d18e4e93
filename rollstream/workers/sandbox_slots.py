"""Back-pressure on the node's sandboxes, for a stage that declares it
(``Stage.limits_by_node_sandboxes``: init): its consumer loop pulls work only while the
node has sandbox slots free, counting those of jobs on the node's run and eval streams plus
what this process is creating."""

from __future__ import annotations

import redis.asyncio as aioredis

from rollstream.pipeline.wire import FastRedis


class SandboxSlots:
    """The node's sandbox count comes with every read of the stream (``read_command``), and
    this process's forwards since then are added to it: an estimate that can only be high
    (eval's releases lower the true count), never low. A count cached for 50 ms without those
    forwards let the node reach 6 sandboxes with a limit of 3 (tests/pipeline/test_hot_path.py)."""

    def __init__(self, r: aioredis.Redis, reader: FastRedis | None, key: str, limit: int):
        self.r = r
        self.reader = reader  # the loop's reading connection; None: plain redis-py, one SCARD a look
        self.key = key
        self.limit = limit
        self._live_at_read: int | None = None
        self._forwards_since_read = 0

    async def free(self, free: int, inflight: int) -> int:
        """How many of the loop's ``free`` slots the node's sandboxes leave it."""
        if self._live_at_read is None:  # unknown, or no room at the last look: ask now
            if self.reader is not None:
                self.reader.uncork()  # with the hand-offs held so far
            self._forwards_since_read = 0
            self._live_at_read = int(await (self.reader.execute("SCARD", self.key) if self.reader
                                            else self.r.scard(self.key)))
        live = self._live_at_read + self._forwards_since_read
        free = min(free, self.limit - live - inflight)
        if free <= 0 or self.reader is None:
            self._live_at_read = None
        return free

    def read_command(self) -> tuple:
        """The count, to send in the same write as the stream read; its reply goes to ``counted``."""
        self._forwards_since_read = 0
        return ("SCARD", self.key)

    def counted(self, reply) -> None:
        self._live_at_read = int(reply)

    def forwarded(self) -> None:
        """This process handed on a job with a sandbox: it counts against the node now."""
        self._forwards_since_read += 1
