"""Hole 2: a job may not choose how unconfined its code runs. Its `sandbox` overrides pass the
operator's policy (settings sandbox_job_overrides, sandbox_job_may_raise_limits) where init merges
them: limits only downwards, no backend, image, network or masks, never the `local` backend."""

from __future__ import annotations

import os
import uuid

import pytest
from sandboxes.conftest import needs_bwrap, root_dir  # noqa: F401  (fixture)

from rollstream.config import Settings
from rollstream.errors import InvalidJob
from rollstream.messages import Envelope, Job
from rollstream.sandboxes import SandboxSpec
from rollstream.sandboxes.policy import OverridePolicy, SandboxOverrideRefused
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.base import TaskContext
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

BASE = SandboxSpec(backend="bwrap", limits={"memory_mb": 1024, "cpus": 1.0})
# Every field that changes how (or whether) the job's code is confined.
CONFINEMENT_FIELDS = {
    "backend": "docker",
    "image": "/",
    "network": True,
    "hide_paths": [],
    "allow_unisolated": True,
    "python": "/bin/sh",
}


@pytest.mark.parametrize("field", sorted(CONFINEMENT_FIELDS))
def test_every_confinement_field_is_refused_naming_the_field_and_the_setting(field):
    with pytest.raises(SandboxOverrideRefused, match=rf"job\.sandbox\.{field}") as refused:
        OverridePolicy().apply(BASE, {field: CONFINEMENT_FIELDS[field]})
    assert "sandbox_job_overrides" in str(refused.value) or "operator" in str(refused.value)
    assert isinstance(refused.value, InvalidJob)  # failed at once, never retried


def test_local_and_unisolated_stay_refused_even_where_the_operator_allows_backend_overrides():
    policy = OverridePolicy(allowed=("backend", "allow_unisolated", "setup_commands"))
    with pytest.raises(SandboxOverrideRefused, match="allow_unisolated"):
        policy.apply(BASE, {"allow_unisolated": True})
    with pytest.raises(SandboxOverrideRefused, match="local"):
        policy.apply(BASE, {"backend": "local"})
    assert policy.apply(BASE, {"backend": "docker"}).backend == "docker"
    # A task whose own sandbox is local runs no setup command a job adds.
    local = SandboxSpec(backend="local", allow_unisolated=True)
    with pytest.raises(SandboxOverrideRefused, match="setup_commands"):
        policy.apply(local, {"setup_commands": ["id"]})


@pytest.mark.parametrize("field, higher", [("memory_mb", 4096), ("memory_mb", None), ("cpus", 8.0),
                                           ("max_processes", 100_000), ("output_bytes", 10**9),
                                           ("max_lifetime_s", 10**9), ("default_no_output_timeout_s", None)])
def test_limits_may_only_be_lowered_unless_the_operator_allows_raising(field, higher):
    with pytest.raises(SandboxOverrideRefused, match=rf"limits\.{field}.*sandbox_job_may_raise_limits"):
        OverridePolicy().apply(BASE, {"limits": {field: higher}})
    assert getattr(OverridePolicy(may_raise_limits=True).apply(BASE, {"limits": {field: higher}}).limits,
                   field) == higher


def test_lowered_limits_and_in_sandbox_fields_merge_with_the_tasks_spec():
    spec = OverridePolicy().apply(BASE, {"limits": {"memory_mb": 256}, "env": {"A": "1"},
                                         "files": {"a.txt": "x"}, "setup_timeout_s": 5})
    assert spec.limits.memory_mb == 256 and spec.limits.cpus == 1.0  # the rest kept
    assert spec.env == {"A": "1"} and spec.setup_timeout_s == 5 and spec.backend == "bwrap"
    with pytest.raises(SandboxOverrideRefused, match="valid sandbox spec"):
        OverridePolicy().apply(BASE, {"limits": {"memory_mb": "lots"}})
    with pytest.raises(SandboxOverrideRefused, match="not a sandbox field"):
        OverridePolicy().apply(BASE, {"privileged": True})


def test_the_operator_widens_the_policy_by_settings(monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_JOB_OVERRIDES", '["limits", "network"]')
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS", "true")
    policy = OverridePolicy.from_settings(Settings())
    assert policy.apply(BASE, {"network": True, "limits": {"cpus": 4.0}}).network is True
    with pytest.raises(SandboxOverrideRefused, match="env"):
        policy.apply(BASE, {"env": {"A": "1"}})
    assert OverridePolicy.from_settings(Settings(_env_file=None)).allowed  # a default is always set


class _ShellTask(AgentTask):
    name = "security-overrides"

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        return SandboxSpec(backend="bwrap")

    def prompt_messages(self, instance: dict) -> list[dict]:
        return []

    async def reward(self, env, sandbox) -> float:
        return 0.0


@needs_bwrap
async def test_a_job_asking_for_the_local_backend_runs_nothing_on_the_host(root_dir, tmp_path):
    marker = f"/tmp/rs-pwned-{uuid.uuid4().hex}"
    ctx = TaskContext(node="n", work_dir=tmp_path)
    job = Job(task="security-overrides", sandbox={"backend": "local", "allow_unisolated": True,
                                                  "setup_commands": [f"touch {marker}"]})
    env = Envelope(job=job)
    with pytest.raises(SandboxOverrideRefused):
        await set_up(_ShellTask(), env, ctx, NodeSandboxes(root=str(root_dir)))
    assert not os.path.exists(marker) and env.sandbox is None
