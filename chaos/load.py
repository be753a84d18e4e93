"""Load for a soak run, through both doors a trainer uses: the Python client (straight to
Redis) and the HTTP API. Each loader submits jobs with ids it chose itself, so a submission
retried after a fault cannot double a job, and reads its results until every job is seen."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import httpx
import redis

from chaos.ledger import Ledger
from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.errors import RedisRefusesWrites
from rollstream.messages import Result
from rollstream.tasks import arith

log = logging.getLogger(__name__)

RETRY_S = 0.2  # pause before retrying a call that hit a restarting Redis or API


def echo_jobs(n: int, tag: str) -> list[dict]:
    return [{"job_id": f"{tag}-echo-{i}-{uuid.uuid4().hex[:6]}", "task": "echo",
             "instance": {"prompt": f"{tag} {i}"}} for i in range(n)]


def arith_jobs(n: int, tag: str, seed: int = 0) -> list[dict]:
    return [arith.job(inst, job_id=f"{tag}-arith-{i}-{uuid.uuid4().hex[:6]}")
            for i, inst in enumerate(arith.make_instances(n, seed=seed))]


class PythonLoad:
    """Submits through ``AsyncClient`` and reads its results stream."""

    channel = "python"

    def __init__(self, settings: Settings, ledger: Ledger, submitter: str = "soak-python", chunk: int = 500):
        self.settings, self.ledger, self.submitter, self.chunk = settings, ledger, submitter, chunk
        self.retries = 0

    async def run(self, jobs: list[dict], *, deadline: float, pace_s: float = 0.0) -> None:
        for job in jobs:
            self.ledger.expect(job["job_id"], self.channel)
        client = AsyncClient(settings=self.settings, submitter=self.submitter)
        try:
            reader = asyncio.create_task(self._read(client, {j["job_id"] for j in jobs}, deadline))
            for start in range(0, len(jobs), self.chunk):
                await self._submit(client, jobs[start:start + self.chunk], deadline)
                if pace_s:
                    await asyncio.sleep(pace_s)
            await reader
        finally:
            try:
                await client.close()
            except (redis.RedisError, OSError):
                pass

    async def _submit(self, client: AsyncClient, batch: list[dict], deadline: float) -> None:
        while True:
            try:
                await client.submit_many(batch)
                return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, RedisRefusesWrites,
                    OSError) as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not submit through the Python client: {exc}") from exc
                self.retries += 1
                await asyncio.sleep(RETRY_S)

    async def _read(self, client: AsyncClient, mine: set[str], deadline: float) -> None:
        while any(self.ledger.received[j] == 0 for j in mine) and time.monotonic() < deadline:
            try:
                async for result in client.results(timeout_s=2.0):
                    self.ledger.record(result)
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, RedisRefusesWrites, OSError):
                self.retries += 1
                await asyncio.sleep(RETRY_S)


class HttpLoad:
    """Submits with POST /v1/jobs/batch and long-polls GET /v1/results/{submitter},
    acknowledging each page with the cursor of the previous one."""

    channel = "http"

    def __init__(self, api_url: str, token: str, ledger: Ledger, submitter: str = "soak-http", chunk: int = 200):
        self.api_url, self.ledger, self.submitter, self.chunk = api_url, ledger, submitter, chunk
        self.headers = {"Authorization": f"Bearer {token}"}
        self.retries = 0

    async def run(self, jobs: list[dict], *, deadline: float, pace_s: float = 0.0) -> None:
        jobs = [{**j, "submitter": self.submitter} for j in jobs]
        for job in jobs:
            self.ledger.expect(job["job_id"], self.channel)
        async with httpx.AsyncClient(base_url=self.api_url, headers=self.headers, timeout=30) as http:
            reader = asyncio.create_task(self._read(http, {j["job_id"] for j in jobs}, deadline))
            for start in range(0, len(jobs), self.chunk):
                chunk = jobs[start:start + self.chunk]
                await self._call(http, "POST", "/v1/jobs/batch", deadline, json={"jobs": chunk})
                if pace_s:
                    await asyncio.sleep(pace_s)
            await reader

    async def _call(self, http: httpx.AsyncClient, method: str, path: str, deadline: float, **kw) -> httpx.Response:
        while True:
            try:
                resp = await http.request(method, path, **kw)
                if resp.status_code < 500:
                    if resp.status_code >= 400:
                        raise RuntimeError(f"{method} {path} → {resp.status_code}: {resp.text[:300]}")
                    return resp
                problem = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.TransportError as exc:  # the API is restarting
                problem = repr(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method} {path} kept failing: {problem}")
            self.retries += 1
            await asyncio.sleep(RETRY_S)

    async def _read(self, http: httpx.AsyncClient, mine: set[str], deadline: float) -> None:
        cursor = None
        done_cursors: set[str] = set()
        while any(self.ledger.received[j] == 0 for j in mine) and time.monotonic() < deadline:
            params = {"wait_s": 2.0, "max": 500}
            if cursor:
                params["ack"] = cursor
            page = (await self._call(http, "GET", f"/v1/results/{self.submitter}", deadline, params=params)).json()
            # A page whose acknowledgement was lost (the API restarted) comes again with the
            # same cursor: it was counted already.
            if page["cursor"] and page["cursor"] not in done_cursors:
                for item in page["results"]:
                    self.ledger.record(Result.model_validate(item))
                done_cursors.add(page["cursor"])
            cursor = page["cursor"] or cursor
        if cursor:  # acknowledge the last page
            await self._call(http, "GET", f"/v1/results/{self.submitter}", deadline,
                             params={"wait_s": 0, "max": 1, "ack": cursor})
