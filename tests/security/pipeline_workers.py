"""The three stage workers as tasks in the test's event loop (tests/pipeline's serve_all,
cheaper than processes), for the pipeline security tests: ``async with stage_tasks(settings)``."""

from __future__ import annotations

import contextlib

from pipeline.conftest import serve_all, stop_all  # tests/pipeline (the tests folder is on sys.path)


@contextlib.asynccontextmanager
async def stage_tasks(settings, concurrency: int = 16):
    tasks = await serve_all(settings, concurrency)
    try:
        yield tasks
    finally:
        await stop_all(tasks)


def alive(tasks) -> list[str]:
    """What became of worker tasks that ended (an empty list while all serve)."""
    return [repr(t.exception()) if not t.cancelled() and t.exception() else "ended" for t in tasks if t.done()]
