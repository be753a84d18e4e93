"""Per-job result waiting for the verl agent loop: verl runs one agent-loop coroutine per
sample, so one shared ``AsyncClient`` per event loop submits every job and a single reader
task hands each ``Result`` from the submitter's results stream to the coroutine awaiting it."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import uuid
import weakref
from collections.abc import Callable

from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.errors import RollstreamError
from rollstream.messages import Job, Result

log = logging.getLogger(__name__)


class RolloutWaitTimeout(RollstreamError):
    """A job's result did not arrive in time; the job was cancelled."""


def default_submitter(prefix: str = "verl") -> str:
    """A submitter name unique to this process (its results stream is private to it); a valid
    id whatever the host is called (the host part is cut to 32 characters)."""
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname().split(".")[0])[:32] or "host"
    return f"{prefix}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ResultRouter:
    """Submits jobs and resolves one future per job id from a single results reader.

    Futures are registered before the job is queued, so a result that comes back
    faster than the submitting coroutine resumes is never missed."""

    def __init__(self, settings: Settings, *, submitter: str | None = None):
        self.settings = settings
        self.client = AsyncClient(settings=settings, submitter=submitter or default_submitter())
        self._waiting: dict[str, asyncio.Future[Result]] = {}
        self._reader: asyncio.Task | None = None
        self.failure: BaseException | None = None
        # Called with every result before its waiter resumes (trajectory logging, tests).
        self.observers: list[Callable[[Result], None]] = []

    @property
    def submitter(self) -> str:
        return self.client.submitter

    @property
    def healthy(self) -> bool:
        return self.failure is None and not (self._reader is not None and self._reader.done())

    async def start(self) -> ResultRouter:
        await self.client.__aenter__()  # fails fast, saying what to do, when Redis is not there
        self._reader = asyncio.create_task(self._read(), name=f"rollstream-results-{self.submitter}")
        return self

    async def _read(self) -> None:
        try:
            async for result in self.client.results(timeout_s=None):
                for observe in self.observers:
                    try:
                        observe(result)
                    except Exception:  # an observer's bug must not stop result delivery
                        log.exception("result observer failed on job %s", result.job_id)
                future = self._waiting.pop(result.job_id, None)
                if future is None or future.done():
                    # Its coroutine gave up (timeout, cancellation): the job was cancelled already.
                    log.info("dropping result of job %s: nobody waits for it", result.job_id)
                    continue
                future.set_result(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis gone: every waiter must hear it, not hang
            self.failure = exc
            log.error("rollstream results reader of %s stopped: %s", self.submitter, exc)
            waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                if not future.done():
                    future.set_exception(RollstreamError(
                        f"lost the rollstream results stream ({exc}); check REDIS_URL and that Redis is up"))

    async def run_job(self, job: Job, *, timeout_s: float) -> Result:
        """Queue ``job`` and return its result. Cancels the job if the caller is cancelled
        or no result comes within ``timeout_s``."""
        if not self.healthy:
            raise RollstreamError(f"rollstream results reader is down ({self.failure}); "
                                  "a new router is made on the next call")
        job = job.model_copy(update={"submitter": self.submitter})
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting[job.job_id] = future
        try:
            await self.client.submit(job)
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            await self._cancel(job.job_id)
            raise RolloutWaitTimeout(
                f"no result for rollstream job {job.job_id} (task {job.task}) after {timeout_s:.0f}s; the job "
                "was cancelled. Check 'rollstream status' for dead workers or backends, or raise wait_timeout_s"
            ) from None
        except asyncio.CancelledError:
            await asyncio.shield(self._cancel(job.job_id))
            raise
        finally:
            self._waiting.pop(job.job_id, None)

    async def _cancel(self, job_id: str) -> None:
        try:
            await self.client.cancel(job_id=job_id)
        except Exception as exc:  # the original error matters more than a failed cancel
            log.warning("could not cancel rollstream job %s: %s", job_id, exc)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        await self.client.close()


# One router per (event loop, Redis, namespace): verl makes a new agent-loop object for
# every sample, and all of a worker's samples run on the same loop.
_routers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], ResultRouter]] = \
    weakref.WeakKeyDictionary()
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


async def shared_router(settings: Settings, *, submitter_prefix: str = "verl") -> ResultRouter:
    """The router of the running event loop for these settings, started on first use
    (and made anew if its reader died)."""
    loop = asyncio.get_running_loop()
    lock = _locks.setdefault(loop, asyncio.Lock())
    key = (settings.redis_url or "", settings.namespace)
    async with lock:
        routers = _routers.setdefault(loop, {})
        router = routers.get(key)
        if router is None or not router.healthy:
            if router is not None:
                await router.close()
            router = await ResultRouter(settings, submitter=default_submitter(submitter_prefix)).start()
            routers[key] = router
        return router


async def close_routers() -> None:
    """Close the running loop's routers (tests, and trainers that shut down cleanly)."""
    routers = _routers.pop(asyncio.get_running_loop(), {})
    for router in routers.values():
        await router.close()
