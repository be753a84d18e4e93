"""The LLM service of a run-worker process: the Redis balancer (which backend), the
token-in/token-out client (how to ask it; for the door's calls a pooled link), the tokenizer of
the served model, a health checker that ejects and readmits backends, and lease keep-alive. The run stage starts it;
tasks reach it as ``ctx.services.need_llm()`` (agent/services.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis

from rollstream.config import Settings
from rollstream.llm.backend_link import PooledVLLMClient
from rollstream.llm.balancer import Balancer, HealthChecker
from rollstream.llm.inference_client import CompletionBackend, VLLMClient, make_client
from rollstream.llm.session import LLMSession
from rollstream.pipeline.keys import Keys

log = logging.getLogger(__name__)


class LLMService:
    def __init__(self, r: aioredis.Redis, settings: Settings, worker_id: str | None = None):
        self.r = r
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.balancer = Balancer(r, namespace=settings.namespace, group_affinity_slack=settings.group_affinity_slack,
                                 lease_ttl_s=settings.lease_ttl_s, worker_id=worker_id)
        self.client = make_client(settings.inference_api, dead_peer_s=settings.inference_dead_peer_s)
        self._pooled: PooledVLLMClient | None = None  # the door's link, made on first use
        self._tokenizer: Any = None
        self._tasks: list[asyncio.Task] = []
        self._health: HealthChecker | None = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if not self.settings.model_dir:
                raise RuntimeError("run workers need the served model's tokenizer: pass --model-dir DIR or set "
                                   "ROLLSTREAM_MODEL_DIR (a folder with tokenizer files, e.g. a Qwen3 checkpoint)")
            from transformers import AutoTokenizer  # heavy: loaded by run workers only, on first use

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.settings.model_dir))
        return self._tokenizer

    def session(self, job_id: str, group_id: str | None, *, pooled: bool = False, max_backend_attempts: int = 3,
                request_timeout_s: float = 600.0, backend_wait_s: float = 120.0) -> LLMSession:
        """The job's session on this worker's balancer (so job and group affinity hold). A door's
        session is ``pooled``: its many short calls go over keep-alive connections
        (backend_link.py) where the backends speak the vLLM API."""
        return LLMSession(self._pooled_client() if pooled else self.client, job_id, group_id, balancer=self.balancer,
                          max_backend_attempts=max_backend_attempts, request_timeout_s=request_timeout_s,
                          backend_wait_s=backend_wait_s)

    def _pooled_client(self) -> CompletionBackend:
        if type(self.client) is not VLLMClient:  # another API (SGLang): its own client
            return self.client
        if self._pooled is None:
            self._pooled = PooledVLLMClient(model=self.client.model)
        return self._pooled

    async def policy_version(self) -> int:
        return int(await self.r.get(self.keys.policy_version) or 0)

    async def start(self) -> None:
        """Load the tokenizer (off the event loop) and start the background duties: lease
        renewal/reclaim and backend health checks."""
        if self.settings.model_dir:
            await asyncio.to_thread(lambda: self.tokenizer)
        self._health = HealthChecker(self.balancer)
        self._tasks = [asyncio.create_task(self.balancer.keep_alive()), asyncio.create_task(self._health.run())]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._health is not None:
            await self._health.aclose()
        if self._pooled is not None:
            await self._pooled.aclose()
        await self.client.aclose()
