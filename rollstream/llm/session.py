"""An LLM session of one job: the run stage's link between the agent loop, the Redis
balancer (which backend) and the token-in/token-out client (how to ask it). The job sticks
to one backend across turns; a failing backend is ejected and the turn retried elsewhere."""

from __future__ import annotations

import asyncio
import logging
import time

from rollstream.llm.balancer import Balancer, Lease, NoBackendAvailable
from rollstream.llm.inference_client import (
    BackendError,
    CompletionBackend,
    Generation,
    TokensCallback,
)
from rollstream.sampling import SamplingParams

log = logging.getLogger(__name__)


class LLMSession:
    """Generates model turns for one job. With a balancer, each turn takes a lease on a
    backend (the job's own while it is healthy, see llm/balancer.py) and gives it back
    when the turn ends; without one, every turn goes to `backend_url`."""

    def __init__(
        self,
        client: CompletionBackend,
        job_id: str,
        group_id: str | None = None,
        balancer: Balancer | None = None,
        backend_url: str | None = None,
        max_backend_attempts: int = 3,
        request_timeout_s: float = 600.0,
        backend_wait_s: float = 120.0,
    ) -> None:
        if balancer is None and backend_url is None:
            raise ValueError("LLMSession needs a balancer or a backend_url to send turns to")
        self.client = client
        self.job_id = job_id
        self.group_id = group_id
        self.balancer = balancer
        self.backend_url = backend_url
        self.max_backend_attempts = max_backend_attempts
        self.request_timeout_s = request_timeout_s
        self.backend_wait_s = backend_wait_s
        self.backends_used: list[str] = []  # in order, one entry per change of backend
        self.failures: list[str] = []
        self._finished: list[Lease] = []  # leases of turns generated with release_later, not given back yet

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokensCallback | None = None, *, release_later: bool = False) -> Generation:
        """One model turn. Retryable backend failures eject the backend and move the job to
        another one, up to max_backend_attempts; then the last BackendError is raised. With
        ``on_tokens`` the turn is streamed: it gets the tokens as the backend generates them
        (the same lease, affinity and retries; once a token was passed on, a failure is final,
        since what was delivered cannot be taken back). With ``release_later`` a turn that was
        generated keeps its backend slot until ``release_finished()``: the door gives it back once
        its answer is on its way, so the release's round trip to Redis is not on the answer's path."""
        delivered = False

        async def deliver(ids: list[int], logprobs: list[float]) -> None:
            nonlocal delivered
            delivered = True
            assert on_tokens is not None
            await on_tokens(ids, logprobs)

        last_error: BackendError | None = None
        for _attempt in range(self.max_backend_attempts):
            backend, lease = await self._take_backend()
            if not self.backends_used or self.backends_used[-1] != backend:
                self.backends_used.append(backend)
            generated = False
            try:
                if on_tokens is None:
                    gen = await self.client.generate(backend, prompt_ids, params, self.request_timeout_s)
                else:
                    gen = await self._stream(backend, prompt_ids, params, deliver)
                generated = True
                return gen
            except BackendError as exc:
                if not exc.retryable or delivered:
                    raise
                last_error = exc
                self.failures.append(str(exc))
                log.warning("turn failed on backend; ejecting it and retrying",
                            extra={"job_id": self.job_id, "backend": backend, "error": exc.reason})
                if self.balancer is not None:
                    await self.balancer.mark_down(backend)
            finally:
                if lease is not None:
                    if generated and release_later:
                        self._finished.append(lease)
                    else:
                        assert self.balancer is not None  # it gave the lease
                        await self.balancer.release(lease)
        assert last_error is not None
        raise last_error

    async def _stream(self, backend: str, prompt_ids: list[int], params: SamplingParams,
                      on_tokens: TokensCallback) -> Generation:
        stream = getattr(self.client, "generate_stream", None)
        if stream is not None:
            return await stream(backend, prompt_ids, params, on_tokens, self.request_timeout_s)
        # A client that cannot stream (SGLang's): the whole turn, passed on at once.
        gen = await self.client.generate(backend, prompt_ids, params, self.request_timeout_s)
        await on_tokens(gen.token_ids, gen.logprobs)
        return gen

    async def _take_backend(self) -> tuple[str, Lease | None]:
        """The backend of the next attempt: leased from the balancer, else the session's own URL."""
        if self.balancer is not None:
            lease = await self._acquire(self.balancer)
            return lease.backend, lease
        assert self.backend_url is not None  # __init__ requires one of the two
        return self.backend_url, None

    async def _acquire(self, balancer: Balancer) -> Lease:
        """A lease on a healthy backend, waiting up to backend_wait_s while none is: a backend
        that restarts (or a health checker that has not readmitted it yet) must not cost the
        job its attempts."""
        deadline = time.monotonic() + self.backend_wait_s
        pause = 0.2
        while True:
            try:
                return await balancer.acquire(self.job_id, self.group_id)
            except NoBackendAvailable:
                if time.monotonic() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)

    @property
    def backend(self) -> str | None:
        return self.backends_used[-1] if self.backends_used else None

    async def release_finished(self) -> None:
        """Give back the backend slots of the turns generated with ``release_later`` (one script)."""
        if self._finished:
            leases, self._finished = self._finished, []
            assert self.balancer is not None
            await self.balancer.release(*leases)

    async def close(self) -> None:
        """Forget the job's stickiness (its leases were given back turn by turn)."""
        await self.release_finished()
        if self.balancer is not None:
            await self.balancer.forget_job(self.job_id)
