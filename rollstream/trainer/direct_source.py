"""A RolloutSource without the pipeline: single-turn completions straight from an inference
server's /v1/completions (token ids in, token ids + logprobs out), scored in-process. For
benchmarks and smoke tests of the trainer; real training goes through trainer/source.py."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from rollstream.trajectory import Trajectory

RewardFn = Callable[[dict[str, Any], list[int]], float]


@dataclass
class DirectResult:
    """Has the fields of messages.Result that the sampler and the loop read."""

    job_id: str
    group_id: str
    status: str
    reward: float | None
    policy_version: int
    trajectory: Trajectory | None
    error: str | None = None
    failure: str | None = None


class DirectServerSource:
    """Prompts are dicts with `prompt_ids` (list of token ids); `reward_fn(prompt, response_ids)`
    scores each completion. Jobs of a group run concurrently, at most `concurrency` at once."""

    def __init__(
        self,
        base_url: str,
        reward_fn: RewardFn,
        sampling: dict[str, Any] | None = None,
        concurrency: int = 16,
        timeout_s: float = 120.0,
        seed: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.reward_fn = reward_fn
        self.sampling = {"temperature": 1.0, "max_tokens": 16, **(sampling or {})}
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._slots = asyncio.Semaphore(concurrency)
        self._queue: asyncio.Queue[DirectResult] = asyncio.Queue()
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._ids = itertools.count()
        self.policy_version = 0
        # With a seed, each job's sampling is seeded from it and the job's place in the
        # run (group number, member), so a run samples the same completions from the same
        # weights however the server batches them.
        self.seed = seed

    async def submit_group(self, prompt: dict[str, Any], n: int) -> str:
        number = next(self._ids)
        group_id = f"direct-{number}"
        for done in [g for g, tasks in self._tasks.items() if all(t.done() for t in tasks)]:
            del self._tasks[done]
        self._tasks[group_id] = [
            asyncio.create_task(self._rollout(group_id, f"{group_id}-{i}", prompt, self._job_seed(number, i)))
            for i in range(n)
        ]
        return group_id

    def _job_seed(self, group_number: int, member: int) -> int | None:
        if self.seed is None:
            return None
        return (self.seed * 1_000_003 + group_number * 1_009 + member) % 2**63

    async def _rollout(self, group_id: str, job_id: str, prompt: dict[str, Any], seed: int | None = None) -> None:
        try:
            async with self._slots:
                body = {"prompt": prompt["prompt_ids"], "logprobs": 0, "return_token_ids": True, **self.sampling}
                if seed is not None:
                    body["seed"] = seed
                response = await self._http.post(f"{self.base_url}/v1/completions", json=body)
                response.raise_for_status()
                data = response.json()
            choice = data["choices"][0]
            ids = list(choice["token_ids"])
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            version = int(data.get("policy_version", self.policy_version))
            trajectory = Trajectory(
                prompt_ids=list(prompt["prompt_ids"]), response_ids=ids, loss_mask=[1] * len(ids),
                logprobs=logprobs, policy_version=version, num_turns=1,
                finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            )
            reward = float(self.reward_fn(prompt, ids))
            trajectory.reward = reward
            await self._queue.put(DirectResult(job_id, group_id, "completed", reward, version, trajectory))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed rollout is a result, never silence
            await self._queue.put(DirectResult(job_id, group_id, "failed", None, self.policy_version, None, repr(exc),
                                               failure="infrastructure"))

    async def results(self) -> AsyncIterator[DirectResult]:
        while True:
            yield await self._queue.get()

    async def cancel_group(self, group_id: str) -> None:
        for task in self._tasks.pop(group_id, []):
            task.cancel()

    async def set_policy_version(self, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        for group_id in list(self._tasks):
            await self.cancel_group(group_id)
        await self._http.aclose()
