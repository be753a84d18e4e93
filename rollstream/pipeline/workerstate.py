"""A worker's hash (``rs:worker:{name}``): what a live worker says of itself at each heartbeat
(workers/membership.py writes it) and what ``rollstream status``, a node's drain and the warm
pool read of it. Written and read through ``WorkerRecord`` alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from redis.typing import EncodableT, FieldT

from rollstream.messages import StageName


@dataclass(frozen=True)
class WorkerRecord:
    stage: StageName
    node: str
    pid: int = 0
    concurrency: int = 0
    inflight: int = 0
    processed: int = 0
    heartbeat_at: float = 0.0
    draining: bool = False
    event_loop: str = ""  # asyncio or uvloop

    def hash_fields(self) -> dict[FieldT, EncodableT]:
        """The hash's fields, as HSET writes them: numbers as numbers, ``draining`` as 0 or 1."""
        fields: dict[FieldT, EncodableT] = {}
        for name, value in asdict(self).items():
            fields[name] = int(value) if isinstance(value, bool) else value
        return fields

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> WorkerRecord | None:
        """The record from HGETALL's reply; None where the hash is gone (the worker expired) or
        carries no stage and node. Fields this version does not know are left out."""
        info = {k.decode(): v.decode() for k, v in raw.items()}
        if not info.get("stage") or "node" not in info:
            return None
        return cls(stage=info["stage"], node=info["node"],  # type: ignore[arg-type]  # a stage name on the wire
                   pid=int(info.get("pid") or 0), concurrency=int(info.get("concurrency") or 0),
                   inflight=int(info.get("inflight") or 0), processed=int(info.get("processed") or 0),
                   heartbeat_at=float(info.get("heartbeat_at") or 0.0), draining=info.get("draining") == "1",
                   event_loop=info.get("event_loop", ""))
