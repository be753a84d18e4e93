"""Fixtures for the sandbox tests: a short sandbox root and live bubblewrap sandboxes."""

from __future__ import annotations

import json

import psutil
import pytest

from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.backends.bwrap import BwrapBackend

needs_bwrap = pytest.mark.skipif(not BwrapBackend().available(), reason="bubblewrap (bwrap) is not usable here")


@pytest.fixture
def root_dir(sandbox_root):
    return sandbox_root


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
    """Live (non-zombie) processes whose command line or working directory contains `text`.

    The working directory finds supervisors, which the fork server forks in their folder.
    """
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if text in " ".join(process.info["cmdline"] or []) or text in (process.info["cwd"] or ""):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def planned_bwrap_sandbox(root_dir: str, sandbox_id: str, **changes) -> tuple[SandboxLayout, dict]:
    """A bwrap sandbox's folder and plan.json as create_sandbox leaves them before it starts
    the supervisor (owner ``job-<id>``); ``changes`` replace fields of the plan."""
    layout = SandboxLayout.of(root_dir, sandbox_id)
    layout.make()
    plan = BwrapBackend().plan(SandboxSpec(backend="bwrap"), layout, sandbox_id, f"job-{sandbox_id}").to_json_dict()
    plan.update(changes)
    with open(layout.plan_path, "w") as handle:
        json.dump(plan, handle)
    return layout, plan
