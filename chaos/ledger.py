"""Accounting for a soak run: every job submitted, every result received, and the verdict
(lost, doubled, unexpected, dead letters and their reasons) once the run is over."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from rollstream.messages import DeadLetter, Result
from rollstream.pipeline.codec import unpack
from rollstream.pipeline.keys import Keys


@dataclass
class Ledger:
    submitted: dict[str, str] = field(default_factory=dict)  # job id → channel ("python", "http")
    received: Counter = field(default_factory=Counter)  # job id → results seen
    status: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    rewards: dict[str, float | None] = field(default_factory=dict)

    def expect(self, job_id: str, channel: str) -> None:
        self.submitted[job_id] = channel

    def record(self, result: Result) -> None:
        self.received[result.job_id] += 1
        self.status[result.job_id] = result.status
        self.rewards[result.job_id] = result.reward
        if result.error:
            self.errors[result.job_id] = result.error

    def verdict(self, dead_letters: list[DeadLetter], max_deliveries: int) -> Verdict:
        lost = [j for j in self.submitted if j not in self.received]
        doubled = [j for j, n in self.received.items() if n > 1]
        unexpected = [j for j in self.received if j not in self.submitted]
        failed = [j for j, s in self.status.items() if s == "failed"]
        reasonless = [j for j in failed if not self.errors.get(j)]
        mine = [d for d in dead_letters if d.job_id in self.submitted]
        # A dead letter is owed either to retries running out or to a job that no retry can
        # fix (undecodable, invalid); both must say why.
        unexplained = [d.job_id for d in mine if not d.error]
        early = [d.job_id for d in mine if not _exhausted(d, max_deliveries)]
        return Verdict(submitted=len(self.submitted), received=sum(self.received.values()), lost=lost,
                       doubled=doubled, unexpected=unexpected, failed=len(failed), reasonless_failures=reasonless,
                       dead_letters=len(mine), dead_letters_unexplained=unexplained, dead_letters_early=early,
                       failure_reasons=Counter(_reason(self.errors[j]) for j in failed if j in self.errors))


def _exhausted(letter: DeadLetter, max_deliveries: int) -> bool:
    """Whether the job had all its tries: attempts from init, deliveries within a stage, or
    an error that no retry can fix (undecodable or invalid job, timeout)."""
    attempts = letter.envelope.attempt + 1 if letter.envelope else 0
    final = ("malformed", "invalid", "unknown task", "timed out", "validationerror")
    return (attempts >= max_deliveries or letter.deliveries > max_deliveries
            or any(word in letter.error.lower() for word in final))


def _reason(error: str) -> str:
    """The first clause of an error, so that reasons can be counted."""
    return error.split(";")[0].split(":")[0][:80]


@dataclass
class Verdict:
    submitted: int
    received: int
    lost: list[str]
    doubled: list[str]
    unexpected: list[str]
    failed: int
    reasonless_failures: list[str]
    dead_letters: int
    dead_letters_unexplained: list[str]
    dead_letters_early: list[str]
    failure_reasons: Counter

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.unexpected or self.reasonless_failures
                    or self.dead_letters_unexplained or self.dead_letters_early)

    def summary(self) -> str:
        return (f"{self.submitted} submitted, {self.received} results, {len(self.lost)} lost, "
                f"{len(self.doubled)} doubled, {self.failed} failed, {self.dead_letters} dead letters")


async def read_dead_letters(r: aioredis.Redis, keys: Keys) -> list[DeadLetter]:
    out = []
    for _id, fields in await r.xrange(keys.dead):
        out.append(unpack(DeadLetter, fields[b"data"]))
    return out
