"""The stages own a job's sandbox: init makes it from the task's spec and hands the task's
setup a connected client, eval's scoring reaches the very same sandbox, and whichever stage the
job leaves the node from destroys it; a retried attempt gets a fresh sandbox of its own, and a
task that declares no spec never gets one."""

from __future__ import annotations

import os

from rollstream.client import AsyncClient
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.tasks.base import TaskContext
from rollstream.tasks.echo import EchoTask
from rollstream.tasks.registry import register_task

from .conftest import serve_all, stop_all

SEEN: dict[str, list[str | None]] = {}  # job id -> the sandbox id of each attempt's init


@register_task
class _NoteInSandbox(EchoTask):
    """Echo with a (local, cheap) sandbox: setup leaves a note in it, score reads it back."""

    name = "test-note-in-sandbox"

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(backend="local", allow_unisolated=True)

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        SEEN.setdefault(env.job.job_id, []).append(env.sandbox.id)
        await ctx.sandbox.write_file("note.txt", f"attempt {env.attempt}")
        await super().setup(env, ctx)

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        note = (await ctx.sandbox.read_file("note.txt")).decode()
        return await super().score(env, ctx) if note == f"attempt {env.attempt}" else 0.0


@register_task
class _NoSandbox(EchoTask):
    name = "test-no-sandbox"

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        SEEN.setdefault(env.job.job_id, []).append(env.sandbox and env.sandbox.id)
        assert ctx.sandbox is None
        await super().setup(env, ctx)


async def test_the_stages_make_reach_and_destroy_each_attempts_sandbox(settings, sandbox_root):
    settings = settings.model_copy(update={"sandbox_root": sandbox_root})
    tasks = await serve_all(settings, concurrency=8)
    try:
        async with AsyncClient(settings=settings) as client:
            retried = await client.submit({"task": _NoteInSandbox.name,
                                           "instance": {"prompt": "p", "fail_in": "run", "fail_times": 1}})
            plain = await client.submit({"task": _NoSandbox.name, "instance": {"prompt": "p"}})
            results = {r.job_id: r for r in await client.collect(2, timeout_s=60)}
    finally:
        await stop_all(tasks)
    assert results[retried].status == "completed" and results[retried].reward == 1.0, results[retried]
    assert results[retried].attempts == 2
    first, second = SEEN[retried]
    assert first != second  # the retry started over in a sandbox of its own
    assert SEEN[plain] == [None] and results[plain].reward == 1.0
    assert [name for name in os.listdir(sandbox_root) if not name.startswith(".")] == []  # both destroyed
