"""Writes that must outlive a failover. Redis replicates asynchronously: a write the primary
acknowledged can be gone from the replica that Sentinel promotes. With ``replica_acks`` = N,
a submission and each stage hand-off are followed by ``WAIT N timeout`` on the same
connection, in the same write, and count only once N replicas hold them.

What is waited for, and why: a submission (the client's acknowledgement is the only record
of the job outside Redis: lost, the job is gone), and each hand-off and result (lost, the
message it consumed is pending again on the new primary and its stage is done twice). What
is not: reads, heartbeats, running marks, counters (all rewritten within seconds)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import NoScriptError, ResponseError

from rollstream.pipeline.connection import SOCKET_TIMEOUT_S
from rollstream.pipeline.wire import FastRedis


class ReplicasBehind(ResponseError):
    """Fewer replicas than asked confirmed a write in time. The write ran on the primary (its
    reply is ``reply``) and stays there unless the primary fails now; sending it again is
    safe (a submission queues no job twice, a hand-off moves a message at most once). Its
    message starts with Redis's own NOREPLICAS code, so it is waited out and reported like
    a primary that refuses writes for want of replicas."""

    def __init__(self, reply, confirmed: int, wanted: int, timeout_ms: int):
        super().__init__(f"NOREPLICAS {confirmed} of {wanted} replica(s) confirmed the write within {timeout_ms} ms "
                         "(Redis WAIT); it is on the primary but may not survive a failover: send it again "
                         "(a submission queues no job twice), or check the replicas ('INFO replication')")
        self.reply = reply
        self.confirmed = confirmed


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


async def follow_the_sentinels(r: aioredis.Redis, fast: FastRedis | None) -> None:
    """After a write no replica confirmed: if the Sentinels name another primary by now (they
    promoted a replica while this primary still answers, and its replicas left it), leave this
    one, so the write sent again goes to the new primary rather than to one that will be
    overwritten when it is turned into a replica."""
    pool = r.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return
    try:
        address = await pool.get_master_address()  # also drops the pool's idle connections to an old one
    except redis.ConnectionError:  # mid-failover no Sentinel names one yet: the next connect asks again
        return
    if fast is not None:
        fast.leave_unless(address)


async def script_then_wait(r: aioredis.Redis, fast: FastRedis | None, script: str, keys: list, args: list, *,
                           acks: int, timeout_ms: int, before: Sequence[tuple] = ()) -> tuple:
    """Run ``script`` and WAIT for ``acks`` replicas on the same connection, in one write: a WAIT
    on another connection (or after a reconnect) would confirm nothing about this write.
    Returns (the script's reply, replicas that confirmed)."""
    wait = ("WAIT", acks, timeout_ms)
    if fast is not None:
        call = ("EVALSHA", _sha(script), len(keys), *keys, *args)
        timeout_s = timeout_ms / 1000 + SOCKET_TIMEOUT_S
        try:
            replies = await fast.execute_many([*before, call, wait], timeout_s=timeout_s)
        except NoScriptError:  # Redis restarted, or a new primary: what came before it ran already
            await fast.execute("SCRIPT", "LOAD", script)
            replies = await fast.execute_many([call, wait], timeout_s=timeout_s)
        if int(replies[-1]) < acks:
            await follow_the_sentinels(r, fast)
        return replies[-2], int(replies[-1])
    if before:
        raise ValueError("commands can ride along with a script only on a lean connection")
    async with r.pipeline(transaction=False) as pipe:
        await r.register_script(script)(keys=keys, args=args, client=pipe)  # queues it: awaited, or never sent
        pipe.execute_command(*wait)
        reply, confirmed = await pipe.execute()
    if int(confirmed) < acks:
        await follow_the_sentinels(r, fast)
    return reply, int(confirmed)
