"""Hole 7: a real redis-server whose AOF disk (a small tmpfs) fills up answers every write with
MISCONF. Workers wait it out (no worker dies), /health and the status snapshot say what is
wrong, the client is told that Redis refuses writes (not that there is no Redis), and once
the disk has room again every job in flight ends with exactly one result, by itself."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from chaos.diskfull import SmallDisk, aof_write_failing, cannot_mount
from rollstream.api.app import asgi
from rollstream.client import AsyncClient
from rollstream.errors import RedisRefusesWrites
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import snapshot

from .pipeline_workers import alive, stage_tasks

pytestmark = pytest.mark.skipif(cannot_mount() is not None, reason=cannot_mount() or "")


@pytest.fixture
def redis_on_small_disk(tmp_path):
    """The embedded redis-server (AOF on) with its data folder on a 2 MB tmpfs; yields (url, disk)."""
    with SmallDisk(tmp_path / "disk", size_mb=2) as disk:
        server = EmbeddedRedis(tmp_path / "redis", appendonly=True, extra_args=["--dir", str(disk.path)])
        server.start()
        try:
            yield server.url, disk
        finally:
            server.stop()


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        await asyncio.sleep(0.1)


async def test_workers_outlive_a_full_redis_disk_and_every_job_gets_one_result(
        redis_on_small_disk, settings, asgi_server):
    url, disk = redis_on_small_disk
    settings = settings.model_copy(update={"redis_url": url})
    keys = Keys(settings.namespace)
    n = 12
    with asgi_server(asgi(settings, token="t")) as api:
        async with AsyncClient(settings=settings, submitter="full") as client, stage_tasks(settings) as tasks:
            # Jobs in every stage when the disk fills: some just queued, some running.
            ids = await client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}", "run_s": 0.5 * (i % 4)}}
                                            for i in range(n)])
            disk.fill()
            await _until(lambda: asyncio.to_thread(aof_write_failing, url), 20, "Redis noticed the full disk")
            with pytest.raises(RedisRefusesWrites, match="MISCONF") as refused:
                await client.submit({"task": "echo", "instance": {"prompt": "late"}})
            assert "disk" in str(refused.value)
            async with httpx.AsyncClient(base_url=api, timeout=10) as http:
                health = await http.get("/health")
                assert health.status_code == 503 and "MISCONF" in health.text and "disk" in health.text
                status = (await http.get("/v1/status", headers={"Authorization": "Bearer t"})).json()
                refused = await http.post("/v1/jobs", headers={"Authorization": "Bearer t"},
                                          json={"task": "echo", "instance": {"prompt": "late"}})
                assert refused.status_code == 503 and "MISCONF" in refused.text and refused.headers["retry-after"]
                page = await http.get("/v1/results/full", headers={"Authorization": "Bearer t"}, params={"wait_s": 0})
                assert page.status_code == 503 and "MISCONF" in page.text
            assert "MISCONF" in status["redis_problem"]
            assert "MISCONF" in (await snapshot(client.r, keys)).redis_problem
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollstream", "status", "--redis", url, "--namespace", settings.namespace,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            shown = (await cli.communicate())[0].decode()
            assert cli.returncode == 0 and "MISCONF" in shown, shown  # what an operator sees
            await asyncio.sleep(3.0)  # every worker meets refusals: reads, heartbeats, hand-offs
            assert alive(tasks) == []
            disk.free()
            await _until(lambda: asyncio.to_thread(lambda: not aof_write_failing(url)), 20, "Redis writes again")
            results = await client.collect(n, timeout_s=60)
            assert sorted(r.job_id for r in results) == sorted(ids)  # each exactly once
            assert all(r.status == "completed" for r in results), [r.error for r in results if not r.ok]
            late = await client.submit({"task": "echo", "instance": {"prompt": "after"}})
            assert [r.job_id for r in await client.collect(1, timeout_s=20)] == [late]
            assert [r async for r in client.results(timeout_s=1.0)] == []
            assert alive(tasks) == []
        async with httpx.AsyncClient(base_url=api, timeout=10) as http:
            assert (await http.get("/health")).status_code == 200
