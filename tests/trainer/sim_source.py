"""An in-process rollout source for sampler tests: each prompt names the rewards its G
rollouts get; results arrive after a short random delay, in any order."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class SimResult:
    job_id: str
    group_id: str
    status: str
    reward: float | None
    policy_version: int
    trajectory: object = None


class SimulatedSource:
    def __init__(self, seed: int = 0, max_delay_s: float = 0.003) -> None:
        self.random = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.queue: asyncio.Queue[SimResult] = asyncio.Queue()
        self.tasks: dict[str, list[asyncio.Task]] = {}
        self.submitted: dict[str, object] = {}
        self.cancelled: set[str] = set()
        self.finished_jobs: set[str] = set()
        self.policy_version = 0
        self._ids = itertools.count()

    async def submit_group(self, prompt, n: int) -> str:
        group_id = f"g{next(self._ids)}"
        self.submitted[group_id] = prompt
        rewards = prompt["rewards"]
        self.tasks[group_id] = [
            asyncio.ensure_future(self._run(group_id, i, rewards[i % len(rewards)], self.policy_version))
            for i in range(n)
        ]
        return group_id

    async def _run(self, group_id: str, i: int, reward, version: int) -> None:
        await asyncio.sleep(self.random.random() * self.max_delay_s)
        status = "failed" if reward is None else "completed"
        self.finished_jobs.add(f"{group_id}-{i}")
        await self.queue.put(SimResult(f"{group_id}-{i}", group_id, status, reward, version))

    async def results(self) -> AsyncIterator[SimResult]:
        while True:
            yield await self.queue.get()

    async def cancel_group(self, group_id: str) -> None:
        self.cancelled.add(group_id)
        for task in self.tasks.get(group_id, []):
            task.cancel()

    def running_groups(self) -> set[str]:
        return {g for g, tasks in self.tasks.items() if any(not t.done() for t in tasks)}
