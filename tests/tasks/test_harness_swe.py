"""Harness validation of the shipped SWE-style instances, as SWE-bench does it: with a
real sandbox, the gold patch scores 1 and an empty patch scores 0."""

from __future__ import annotations

import pytest

from rollstream.tasks.swe import SweTask, load_instances

from .conftest import needs_bwrap

INSTANCES = load_instances()
pytestmark = needs_bwrap


@pytest.fixture
def mirror(tmp_path_factory):
    # One mirror for the module's tests: the shipped repositories are built into it once.
    return str(tmp_path_factory.getbasetemp() / "swe-mirror")


async def apply_in_sandbox(ep, patch: str) -> None:
    """Stand in for the agent: edit the checkout so that it holds ``patch``."""
    repo = SweTask().repo_dir(ep.env.job.instance, ep.env.sandbox.workdir)
    async with ep.client() as sb:
        await sb.write_file("/tmp/agent.patch", patch)
        result = await sb.bash(f"cd {repo} && git apply /tmp/agent.patch && rm /tmp/agent.patch")
        assert result.exit_code == 0, result.output


def test_at_least_three_instances_are_shipped():
    assert len(INSTANCES) >= 3
    assert len({i["repo"] for i in INSTANCES}) >= 3


@pytest.mark.parametrize("instance", INSTANCES, ids=[i["instance_id"] for i in INSTANCES])
async def test_gold_patch_scores_one(episode, instance, mirror):
    ep = await episode(SweTask(), {**instance, "repo_mirror": mirror})
    await apply_in_sandbox(ep, instance["patch"])
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    assert "resolved" in ep.reason


@pytest.mark.parametrize("instance", INSTANCES, ids=[i["instance_id"] for i in INSTANCES])
async def test_empty_patch_scores_zero(episode, instance, mirror):
    ep = await episode(SweTask(), {**instance, "repo_mirror": mirror})
    assert await ep.score() == 0.0
    assert "FAIL_TO_PASS 0/" in ep.reason
