"""A job's state hash (stage, status, attempts, worker, node, timings, error): the hand-off
script writes where the job goes, workers mark it running (``RunningMarks``), and
``GET /v1/jobs/{id}`` / ``rollstream status`` read it. Written as ``JobStateFields`` and read
as ``JobState``: the same fields by the same names (``hash_args`` puts them on the wire)."""

from __future__ import annotations

from importlib import resources
from typing import Literal, NamedTuple, TypedDict

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from rollstream.messages import FailureKind, JobStage, JobStatus, StageName
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.wire import FastRedis


class JobStateFields(TypedDict, total=False):
    """A write to a job's state hash: the fields it sets (the others stay as they are). A plain
    dict at run time, so the hot path pays nothing; its names are ``JobState``'s."""

    job_id: str
    group_id: str
    submitter: str
    task: str
    stage: JobStage
    status: JobStatus
    attempts: int
    worker: str
    node: str
    sandbox: str
    error: str
    last_error: str
    failure: FailureKind
    reward: float
    priority: int
    submitted_at: float
    finished_at: float


def started_at_field(stage: StageName) -> str:
    """The timing field a stage's start is written to (read back into ``JobState.timings``)."""
    return f"{stage}_started_at"


def hash_args(fields: JobStateFields, started: tuple[StageName, float] | None = None) -> list:
    """``fields`` as HSET's flat field/value list, in the order given (a stage's start time
    last); None is written as ''. Values go as they are: redis-py encodes the numbers."""
    flat: list = []
    for k, v in fields.items():
        flat += [k, "" if v is None else v]
    if started is not None:
        flat += [started_at_field(started[0]), started[1]]
    return flat


class JobState(BaseModel):
    job_id: str
    stage: JobStage | Literal[""] = ""
    status: JobStatus | Literal[""] = ""
    attempts: int = 0
    submitter: str = ""
    group_id: str = ""
    task: str = ""
    worker: str = ""
    node: str = ""
    sandbox: str = ""
    error: str = ""
    last_error: str = ""
    failure: FailureKind | Literal[""] = Field(
        "", description="Whose fault a failed or cancelled job's end is (messages.FailureKind).")
    reward: float | None = None
    priority: int = 50
    submitted_at: float | None = None
    finished_at: float | None = None
    timings: dict[str, float] = Field(default_factory=dict, description="<stage>_started_at and similar.")
    ttl_s: int | None = None


_SCALARS = set(JobState.model_fields) - {"timings", "ttl_s"}


def parse_state(job_id: str, raw: dict[bytes, bytes], ttl: int | None = None) -> JobState:
    fields: dict = {"job_id": job_id, "timings": {}}
    for k, v in raw.items():
        key, val = k.decode(), v.decode(errors="replace")
        if key in _SCALARS:
            fields[key] = val if val != "" or key in ("error", "last_error", "group_id") else None
        elif key.endswith("_at"):
            fields["timings"][key] = float(val)
    fields = {k: v for k, v in fields.items() if v is not None}
    return JobState(**fields, ttl_s=ttl if ttl is not None and ttl >= 0 else None)


async def read_state(r: aioredis.Redis, keys: Keys, job_id: str) -> JobState | None:
    async with r.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.job(job_id))
        pipe.ttl(keys.job(job_id))
        raw, ttl = await pipe.execute()
    if not raw:
        return None
    return parse_state(job_id, raw, ttl)


def entry_token(stream: str, msg_id: str) -> str:
    """Which stream entry holds a job, as its state hash's msg_id says it: the stream and the
    entry id (ids are per stream; two streams' entries can have the same one)."""
    return f"{stream} {msg_id}"


class RunningMark(NamedTuple):
    """A job marked running: its id, the stage message it is (``entry_token``), the fields set
    and when the stage started it."""

    job_id: str
    entry: str
    fields: JobStateFields
    started: tuple[StageName, float] | None = None


_RUNNING = resources.files("rollstream.pipeline").joinpath("lua/running.lua").read_text()


class RunningMarks:
    """Marks jobs "running" in a stage, for observers (status, tests, the reaper). Workers
    send the marks of a read batch without waiting for them, off the hand-off's critical
    path; the script drops a mark that arrives after the job has moved on, so a job's
    state never goes back. The stage's start time also travels with the hand-off."""

    def __init__(self, r: aioredis.Redis, keys: Keys):
        self.r = r
        self.keys = keys
        self._script = r.register_script(_RUNNING)
        self._fast = FastRedis.from_client(r)

    async def aclose(self) -> None:
        if self._fast is not None:
            await self._fast.close()

    async def mark(self, marks: list[RunningMark]) -> None:
        """``marks``: one per job, in one round trip."""
        commands = [(self.keys.job(m.job_id), [m.entry, *hash_args(m.fields, m.started)]) for m in marks]
        if self._fast is not None:
            await self._fast.evalsha_many(_RUNNING, commands)
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for key, args in commands:
                await self._script(keys=[key], args=args, client=pipe)
            await pipe.execute()
