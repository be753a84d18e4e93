from __future__ import annotations

import asyncio
import time

import pytest


@pytest.fixture
def wait_until():
    async def _wait(predicate, timeout_s=30.0, what="condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = await predicate()
            if value:
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    return _wait
