"""Fixtures for the sandbox tests: a short sandbox root and live bubblewrap sandboxes."""

from __future__ import annotations

import shutil
import tempfile

import psutil
import pytest

from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends.bwrap import BwrapBackend

needs_bwrap = pytest.mark.skipif(not BwrapBackend().available(), reason="bubblewrap (bwrap) is not usable here")


@pytest.fixture
def root_dir():
    # Not pytest's tmp_path: Unix socket paths must stay under 108 bytes.
    path = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sandbox(root_dir):
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="t1", owner="test", root_dir=root_dir)
    yield handle
    await destroy_sandbox(handle)


@pytest.fixture
async def sb(sandbox):
    async with SandboxClient(sandbox.socket_path) as client:
        yield client


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line contains `text`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if process.status() != psutil.STATUS_ZOMBIE and text in " ".join(process.info["cmdline"] or []):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found
