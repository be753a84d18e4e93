"""Poison results: an entry of a submitter's results stream that cannot be delivered (not
msgpack, not a Result, or not encodable as JSON for the HTTP API). Result readers move it to
the dead-letter stream, with the reason, and go on with the results behind it: one bad entry
never blocks a submitter's results."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from pydantic import ValidationError

from rollstream.messages import DeadLetter, Result
from rollstream.pipeline.codec import DecodeError, pack, unpack
from rollstream.pipeline.keys import RESULTS_GROUP, Keys

log = logging.getLogger(__name__)

# What reading a result can raise for bad bytes (KeyError: no 'data' field).
UNREADABLE = (DecodeError, ValidationError, KeyError, TypeError, ValueError, RecursionError)


def read_result(fields: dict) -> Result:
    """The Result in a results-stream entry; raises one of ``UNREADABLE`` for a poison entry."""
    return unpack(Result, fields[b"data"])


async def dead_letter_result(r: aioredis.Redis, keys: Keys, submitter: str, msg_id, fields: dict,
                             error: str, *, dead_maxlen: int = 100_000) -> None:
    """Move one undeliverable entry from ``submitter``'s results stream to the dead letters,
    atomically (acknowledged and deleted where it was, added where it goes)."""
    stream = keys.results(submitter)
    raw = fields.get(b"data") or repr(fields).encode()
    letter = DeadLetter(job_id=None, submitter=submitter, stage="results",
                        error=f"result {msg_id!r} could not be delivered: {error}", raw=raw)
    log.warning("results of %s: entry %s dead-lettered: %s", submitter, msg_id, error)
    async with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.dead, {"data": pack(letter)}, maxlen=dead_maxlen, approximate=True)
        pipe.xack(stream, RESULTS_GROUP, msg_id)
        pipe.xdel(stream, msg_id)
        await pipe.execute()
