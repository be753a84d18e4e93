"""The TRL adapter's link to rollstream: one AsyncClient living on a private event loop in
a background thread, so TRL's synchronous hooks (``rollout_func``, trainer callbacks) can
await Redis without owning or blocking an event loop of their own (notebooks run one)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollstream.client import AsyncClient
from rollstream.config import Settings, load_settings

log = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundLoop:
    """An asyncio loop running forever in a daemon thread; ``run`` blocks the caller until
    a coroutine finishes there. Objects bound to the loop (Redis connections) stay valid
    across calls, which ``asyncio.run`` per call would break."""

    def __init__(self, name: str = "rollstream-trl") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundLoop.run called from its own loop thread; await the coroutine instead")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_s)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class RollstreamConnection:
    """The AsyncClient a TRL run submits through, and the loop it lives on. The rollout
    function and the weight-sync callback share one, so both talk to the same namespace."""

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None,
                 submitter: str | None = None) -> None:
        self.settings = settings or load_settings(redis_url=redis_url)
        self.background = BackgroundLoop()
        try:
            self.client: AsyncClient = self.background.run(self._open(redis_url, submitter))
        except BaseException:
            self.background.close()
            raise

    async def _open(self, redis_url: str | None, submitter: str | None) -> AsyncClient:
        client = AsyncClient(redis_url, settings=self.settings, submitter=submitter)
        await client.__aenter__()  # fails fast, with what to do, when Redis is not there
        return client

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.background.run(coro, timeout_s)

    def close(self) -> None:
        if self.background.loop.is_closed():
            return
        try:
            self.background.run(self.client.close(), timeout_s=10)
        except Exception:  # closing must not hide the error that made the caller close
            log.warning("closing the rollstream client failed", exc_info=True)
        self.background.close()
