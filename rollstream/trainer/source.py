"""The production RolloutSource: the sampler's three verbs (submit a group, read results,
cancel a group) on rollstream's AsyncClient, i.e. on the Redis pipeline. Each prompt is
a task instance; the job template (task, sampling, agent settings) comes from TrainConfig."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from rollstream.client import AsyncClient
from rollstream.messages import Job, Result
from rollstream.sampling import SamplingParams

log = logging.getLogger(__name__)


class ClientRolloutSource:
    """Submits groups of `task` jobs through `client` and streams their results."""

    def __init__(
        self,
        client: AsyncClient,
        task: str,
        sampling: dict[str, Any] | None = None,
        agent: dict[str, Any] | None = None,
        job_timeout_s: float = 600.0,
        poll_timeout_s: float = 5.0,
    ) -> None:
        self.client = client
        self.task = task
        self.sampling = SamplingParams.model_validate(sampling or {})
        self.agent = dict(agent or {})
        self.job_timeout_s = job_timeout_s
        self.poll_timeout_s = poll_timeout_s

    async def submit_group(self, prompt: dict[str, Any], n: int) -> str:
        job = Job(
            task=self.task,
            instance=prompt,
            sampling=self.sampling,
            agent=self.agent,
            timeout_s=self.job_timeout_s,
            submitter=self.client.submitter,
        )
        group_id, _ = await self.client.submit_group(job, n)
        return group_id

    async def results(self) -> AsyncIterator[Result]:
        # the client's iterator ends after a quiet poll; the sampler wants one without end
        while True:
            async for result in self.client.results(timeout_s=self.poll_timeout_s):
                if result.group_id is None:
                    log.debug("result without group ignored", extra={"job_id": result.job_id})
                    continue
                yield result

    async def cancel_group(self, group_id: str) -> None:
        await self.client.cancel(group_id=group_id)

    async def set_policy_version(self, version: int) -> None:
        await self.client.set_policy_version(version)
