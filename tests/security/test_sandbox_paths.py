"""Hole 1, the path side: whatever a job id holds (an absolute path, '..', a prefix it shares with
other ids), the host folders and sandbox ids made from it stay inside their root and stay its
own — even for a job that skipped submit validation (a message written to a stream by hand).
(The id grammar at every door: test_pipeline_ids.py, test_api_ids.py.)"""

from __future__ import annotations

import os
import re

import pytest
from sandboxes.conftest import needs_bwrap, root_dir  # noqa: F401  (fixture)
from sandboxes.test_hostile_input import outside as victim  # noqa: F401  (fixture: a host folder no job may touch)

from rollstream.messages import Envelope, Job
from rollstream.sandbox_spec import SANDBOX_ID_PATTERN, SandboxHandle
from rollstream.sandboxes import SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.errors import SandboxError
from rollstream.sandboxes.paths import PathEscape, sandbox_id_for
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.base import TaskContext
from rollstream.tasks.echo import EchoTask
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

HOSTILE_IDS = ["/tmp/victim", "../../../../tmp/victim2", "..", ".", "a/../../b", "-rf", "a:b", "é" * 50,
               "a\x00b", "", "x" * 300, "job\n", "~root"]
SHARED_PREFIX = ["p" * 40 + suffix for suffix in ("a", "b", "c", "-1", "-2", "_long_tail_" * 5)]


def raw_envelope(job_id: str, **fields) -> Envelope:
    """A job as a raw XADD could carry it: no validation on the way in."""
    job = Job.model_construct(**{**Job(task="echo", instance={"prompt": "x"}).__dict__, "job_id": job_id})
    return Envelope.model_construct(**{**Envelope(job=Job(task="echo")).__dict__, "job": job, **fields})


async def test_echo_never_touches_a_folder_its_job_id_names(victim, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    ctx = TaskContext(node="n", work_dir=work)
    task = EchoTask()
    for job_id in [victim, os.path.relpath(victim, work), victim + "/../" + os.path.basename(victim), *HOSTILE_IDS]:
        env = raw_envelope(job_id)
        await task.setup(env, ctx)
        assert os.path.dirname(env.state["workdir"]) == str(work), job_id
        with open(os.path.join(env.state["workdir"], "made-by-the-job"), "w"):
            pass  # not empty: teardown takes its rmtree branch
        await task.teardown(env, ctx)
        assert os.listdir(work) == [], job_id
    assert os.listdir(victim) == ["secret.txt"]


async def test_echo_teardown_ignores_a_workdir_forged_in_the_message(victim, tmp_path):
    ctx = TaskContext(node="n", work_dir=tmp_path)
    await EchoTask().teardown(raw_envelope("j1", state={"workdir": victim}), ctx)
    assert os.listdir(victim) == ["secret.txt"]


def test_sandbox_ids_from_hostile_or_prefix_sharing_job_ids_are_plain_distinct_names(tmp_path):
    ids = [sandbox_id_for(job_id, attempt) for job_id in HOSTILE_IDS + SHARED_PREFIX for attempt in (0, 1)]
    assert len(set(ids)) == len(ids)
    for sandbox_id in ids:
        assert re.match(SANDBOX_ID_PATTERN, sandbox_id), sandbox_id
        assert os.path.dirname(SandboxLayout.of(str(tmp_path), sandbox_id).dir) == os.path.realpath(tmp_path)
    for bad in ["../x", "/tmp/x", "..", "a/b", ""]:
        with pytest.raises(PathEscape):
            SandboxLayout.of(str(tmp_path), bad)


class _ShellTask(AgentTask):
    name = "security-shell"

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(backend="bwrap", limits={"idle_timeout_s": 120})

    def prompt_messages(self, instance: dict) -> list[dict]:
        return []

    async def reward(self, env, sandbox) -> float:
        return 0.0


@needs_bwrap
async def test_jobs_whose_ids_share_forty_characters_get_their_own_sandboxes(root_dir):
    ctx = TaskContext(node="n", work_dir=root_dir)
    sandboxes = NodeSandboxes(root=str(root_dir))
    envs = [raw_envelope(job_id) for job_id in SHARED_PREFIX[:2]]
    try:
        for env in envs:
            await set_up(_ShellTask(), env, ctx, sandboxes)  # the second failed with "already exists" on a prefix cut
        assert len({env.sandbox.id for env in envs}) == 2
    finally:
        for env in envs:
            await sandboxes.destroy(env)
    assert [name for name in os.listdir(root_dir) if not name.startswith(".")] == []


@needs_bwrap
async def test_a_forged_sandbox_handle_never_points_teardown_or_tools_at_a_host_path(root_dir, victim):
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="forged", root_dir=root_dir)
    sandboxes = NodeSandboxes(root=str(root_dir))
    try:
        for forged in ({"dir": victim}, {"socket_path": "/tmp/redis.sock"}, {"id": "../" + os.path.basename(victim)}):
            env = raw_envelope("j1", sandbox=SandboxHandle.model_validate({**handle.model_dump(), **forged}))
            with pytest.raises(SandboxError, match="refus"):
                await sandboxes.destroy(env)  # what the stage a job leaves the node from does
            with pytest.raises(SandboxError, match="refus"):
                async with sandboxes.connected(env):  # what run and eval do before the task's hooks
                    pass
        assert os.listdir(victim) == ["secret.txt"]
        assert os.path.exists(handle.socket_path)  # the real sandbox was not touched either
    finally:
        await destroy_sandbox(handle)
