"""Reading a job's state hash (stage, status, attempts, worker, node, timings, error), which
the hand-off scripts and workers write and ``GET /v1/jobs/{id}`` / ``rollstream status`` read."""

from __future__ import annotations

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from rollstream.pipeline.keys import Keys


class JobState(BaseModel):
    job_id: str
    stage: str = ""
    status: str = ""
    attempts: int = 0
    submitter: str = ""
    group_id: str = ""
    task: str = ""
    worker: str = ""
    node: str = ""
    sandbox: str = ""
    error: str = ""
    last_error: str = ""
    reward: float | None = None
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
