"""Stage hand-off: forward a job to the next stream, finish it into its submitter's results
stream, dead-letter it, or hand it back, each as one atomic Lua script together with the
acknowledgement of the message it came from and the update of its state hash."""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis

from rollstream.messages import DeadLetter, Envelope, Result
from rollstream.pipeline.codec import pack
from rollstream.pipeline.keys import Keys

_SCRIPT = resources.files("rollstream.pipeline").joinpath("lua/transition.lua").read_text()


@dataclass(frozen=True)
class Source:
    """Where a message came from and who holds it."""

    stream: str
    group: str
    msg_id: str
    consumer: str = ""  # '' skips the ownership check


class Handoff:
    """The only place that moves jobs between streams."""

    def __init__(self, r: aioredis.Redis, keys: Keys, *, state_ttl_s: int,
                 results_maxlen: int, dead_maxlen: int):
        self.r = r
        self.keys = keys
        self.state_ttl_s = state_ttl_s
        self.results_maxlen = results_maxlen
        self.dead_maxlen = dead_maxlen
        self._script = r.register_script(_SCRIPT)

    async def _move(self, src: Source, job_id: str, state: dict, dests: list[tuple[str, int, bytes]],
                    *, ttl_s: int = 0, stat: str = "") -> bool:
        stage = src.group if src.group in ("init", "run", "eval") else "client"
        flat: list = []
        for k, v in state.items():
            flat += [k, "" if v is None else v]
        keys = [src.stream, self.keys.job(job_id), self.keys.stats(stage), *(d[0] for d in dests)]
        args: list = [src.group, src.msg_id, src.consumer, ttl_s, stat, len(state), *flat]
        for _, maxlen, payload in dests:
            args += [maxlen, payload]
        return bool(await self._script(keys=keys, args=args))

    async def forward(self, src: Source, env: Envelope, to_stream: str, to_stage: str) -> bool:
        """Acknowledge ``src`` and queue the job on the next stage's stream."""
        state = {"stage": to_stage, "status": "queued", "node": env.node or "", "attempts": env.attempt + 1}
        sandbox_id = str(env.sandbox.get("id", "")) if env.sandbox else ""
        if sandbox_id:
            state["sandbox"] = sandbox_id
        moved = await self._move(src, env.job.job_id, state, [(to_stream, 0, pack(env))], stat="forwarded")
        if moved and sandbox_id and src.group == "init":
            await self.r.sadd(self.keys.node_sandboxes(env.node or ""), sandbox_id)
        return moved

    async def sandbox_gone(self, env: Envelope) -> None:
        """The job's sandbox was destroyed: it no longer counts against its node."""
        if env.sandbox and env.node:
            await self.r.srem(self.keys.node_sandboxes(env.node), str(env.sandbox.get("id", "")))

    async def finish(self, src: Source, result: Result) -> bool:
        """Acknowledge ``src`` and deliver the job's one result."""
        state = {"stage": "done", "status": result.status, "finished_at": result.finished_at,
                 "error": result.error or "", "attempts": result.attempts}
        if result.reward is not None:
            state["reward"] = result.reward
        return await self._move(src, result.job_id, state,
                                [(self.keys.results(result.submitter), self.results_maxlen, pack(result))],
                                ttl_s=self.state_ttl_s, stat=result.status)

    async def dead_letter(self, src: Source, letter: DeadLetter, result: Result | None) -> bool:
        """Acknowledge ``src``, record the dead letter and, when the submitter is known,
        deliver a failed result so it never waits in silence."""
        dests = [(self.keys.dead, self.dead_maxlen, pack(letter))]
        state: dict = {"stage": "dead", "status": "failed", "error": letter.error, "finished_at": time.time()}
        if result is not None:
            dests.append((self.keys.results(result.submitter), self.results_maxlen, pack(result)))
        job_id = letter.job_id or f"undecodable-{src.msg_id}"
        if letter.job_id is None:
            state = {}
        return await self._move(src, job_id, state, dests, ttl_s=self.state_ttl_s if state else 0, stat="dead")

    async def requeue(self, src: Source, env: Envelope, stream: str, stage: str, reason: str) -> bool:
        """Acknowledge ``src`` and put the job on ``stream`` again (a retry, a restart from
        init, or work handed back by a worker that is shutting down)."""
        state = {"stage": stage, "status": "queued", "attempts": env.attempt + 1, "last_error": reason[:2000]}
        return await self._move(src, env.job.job_id, state, [(stream, 0, pack(env))], stat="requeued")
