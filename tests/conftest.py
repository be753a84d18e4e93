"""Shared fixtures: a real redis-server for the whole session (unix socket, no fakes), a
fresh namespace per test so tests never see each other's keys, fast pipeline settings,
and worker pools as real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import model_cache
import pytest
import redis as redis_sync
from pipeline_env import FAST, settings_env

from rollstream.config import Settings

# One intra-op thread for torch here and in every process the tests start (workers, model
# servers, the docs' blocks): on 2 cores, two threads spin-wait on each other whenever another
# process holds a core (the tiny model's update step: 6.4 s with two threads, 0.04 s with one).
# Set before any test module imports torch, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", str(sock),
         "--unixsocketperm", "777", "--save", "", "--appendonly", "no", "--dir", str(folder),
         "--maxclients", "10000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis_sync.Redis(unix_socket_path=str(sock))
    for _ in range(500):
        try:
            client.ping()
            break
        except (redis_sync.ConnectionError, FileNotFoundError):
            time.sleep(0.01)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start; is it installed? (apt-get install redis-server)")
    return proc, f"unix://{sock}"


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real redis-server started for this test session."""
    folder = Path(tempfile.mkdtemp(prefix="rs-redis-"))
    proc, url = _start_redis(folder)
    yield url
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def settings(redis_url, namespace, tmp_path) -> Settings:
    """Pipeline settings with short timeouts, on the session Redis, in a private namespace."""
    return Settings(redis_url=redis_url, namespace=namespace, data_dir=tmp_path / "data", node="n1", **FAST)


@pytest.fixture
def cli_env(settings) -> dict[str, str]:
    """The test's settings as the environment of a `rollstream` command."""
    return settings_env(settings)


def _new_sandbox_root() -> str:
    """In /tmp, not under pytest's 0700 tmp_path, because each sandbox's processes run under a
    host uid of their own that must reach its folder."""
    path = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    os.chmod(path, 0o711)
    return path


async def _remove_sandbox_root(path: str) -> None:
    from rollstream.sandboxes import reaper
    from rollstream.sandboxes.supervisor_spawn import stop_fork_server

    await stop_fork_server(path)  # started by the first sandbox made in this root
    reaper.reap_finished_children()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sandbox_root():
    """A sandbox root for one test (see _new_sandbox_root)."""
    path = _new_sandbox_root()
    yield path
    await _remove_sandbox_root(path)


@pytest.fixture(scope="module")
def module_sandbox_root():
    """A sandbox root for the worker pools a module's tests share (see _new_sandbox_root)."""
    path = _new_sandbox_root()
    yield path
    asyncio.run(_remove_sandbox_root(path))  # after the module's tests: no event loop runs here


@pytest.fixture
def wait_until():
    """``await wait_until(async_predicate, timeout_s, what)``: its first truthy value, or an
    AssertionError naming ``what``."""
    async def _wait(predicate, timeout_s=30.0, what="condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = await predicate()
            if value:
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    return _wait


@pytest.fixture
def worker_pool(settings, tmp_path):
    """Factory of real worker processes with the test's settings; all stopped at the end."""
    from rollstream.workers.pool import WorkerPool

    pools = []

    def make(**overrides) -> WorkerPool:
        s = settings.model_copy(update=overrides)
        pool = WorkerPool(redis_url=s.redis_url, namespace=s.namespace, node=s.node, data_dir=s.data_dir,
                          env=settings_env(s), log_dir=tmp_path / f"logs-{len(pools)}")
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.stop(timeout_s=15)


@pytest.fixture(scope="module")
def shared_pool(redis_url, tmp_path_factory, module_sandbox_root):
    """Worker pools that a module's tests share, for tests whose pools would be alike: each pool
    is three real worker processes in a namespace of its own, with the module's sandbox root.
    ``shared_pool(key, env=..., concurrency=..., **settings) -> Settings`` starts the pool named
    ``key`` on first use (later calls return its settings); all are stopped after the module.
    Each test still gets its own results stream (a client is a submitter of its own)."""
    from rollstream.pipeline.keys import Keys
    from rollstream.workers.pool import WorkerPool

    made: dict[str, tuple[Settings, WorkerPool]] = {}

    def get(key: str, *, env: dict[str, str] | None = None, concurrency: int = 64, **overrides) -> Settings:
        if key not in made:
            s = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}", node="n1",
                         data_dir=tmp_path_factory.mktemp(f"{key}-data"), sandbox_root=module_sandbox_root,
                         **{**FAST, **overrides})
            pool = WorkerPool(redis_url=redis_url, namespace=s.namespace, node=s.node, data_dir=s.data_dir,
                              env={**settings_env(s), **(env or {})}, log_dir=tmp_path_factory.mktemp(f"{key}-logs"))
            made[key] = (s, pool)
            pool.start_all(concurrency=concurrency)
            # Tests time their jobs from submission: hand the pool over once every stage serves.
            r = redis_sync.Redis.from_url(redis_url)
            try:
                deadline = time.monotonic() + 120
                while r.zcard(Keys(s.namespace).workers) < 3:
                    pool.check_alive()
                    assert time.monotonic() < deadline, f"the {key} pool's workers did not register in 120 s"
                    time.sleep(0.05)
            finally:
                r.close()
        return made[key][0]

    yield get
    for _settings, pool in made.values():
        pool.stop(timeout_s=15)


@pytest.fixture(scope="session")
def arith_model_dir() -> Path:
    """The tiny model warmed up on the arith tool-call format (from the model cache)."""
    return model_cache.load("arith_model_dir")


@pytest.fixture(scope="session")
def arith_server(arith_model_dir):
    """Base URL of a built-in server process serving the arith model."""
    from rollstream.llm.server import served_model

    with served_model(arith_model_dir, device="cpu") as url:
        yield url


@contextlib.contextmanager
def serve_asgi(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port (in a thread) until the block ends;
    yields the base URL once /health answers."""
    import httpx
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(500):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.02)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def asgi_server():
    """``with asgi_server(app) as base_url:`` serves an ASGI app for the block (serve_asgi)."""
    return serve_asgi


def pytest_collection_finish(session):
    """Build the models the selected tests need and the cache lacks, before the first test:
    outside every per-test timeout (scripts/test builds them all before pytest starts)."""
    if session.config.option.collectonly:
        return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    model_cache.build_missing(needed, say=reporter.write_line if reporter else print)


def pytest_configure(config):
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture(scope="session", autouse=True)
def swe_mirrors_in_test_folders(tmp_path_factory):
    """The suite's operator lets SWE jobs name mirrors in pytest's temporary folders (and the
    default mirror): the setting a node sets for its own mirrors, inherited by worker processes."""
    from rollstream.config import default_swe_mirror

    allowed = [str(tmp_path_factory.getbasetemp()), str(default_swe_mirror())]
    os.environ["ROLLSTREAM_SWE_REPO_MIRRORS"] = json.dumps(allowed)
    yield
    os.environ.pop("ROLLSTREAM_SWE_REPO_MIRRORS", None)
