"""Harness validation of the real shipped instances (public projects' consecutive releases,
scripts/build_swe_pypi_instances.py), each in its own environment image and through the
whole task (init from the image, the agent's edit, eval as the SWE-bench harness scores):
the gold patch scores 1 and an empty patch 0, every instance on bwrap and two on podman.

The environment images are built before the suite (scripts/install-podman runs
`rollstream images build`), never inside a test's time limit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollstream.sandboxes import images
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import image_exists
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import SweTask, load_instances

from .test_harness_swe import apply_in_sandbox

PYPI_INSTANCES = load_instances(
    Path(__file__).resolve().parents[2] / "rollstream" / "data" / "swe" / "pypi_instances.jsonl")
BUILD_HINT = "scripts/install-podman (rollstream images build rollstream/data/swe/pypi_instances.jsonl --now)"


def _runnable(backend: str, inst: dict) -> str | None:
    """Why `inst` cannot run on `backend` here, or None."""
    tag = swe_env.sandbox_image(swe_records.normalize(inst))
    if backend == "bwrap":
        if not BwrapBackend().available():
            return "bubblewrap is not usable here"
        if not os.path.isdir(images.rootfs_path(tag)):
            return f"the environment rootfs is not built; run {BUILD_HINT}"
        return None
    if not DockerBackend().available():
        return "no Docker engine answers here (scripts/install-podman sets up podman's)"
    if not image_exists(tag):
        return f"the environment image is not built; run {BUILD_HINT}"
    return None


def test_at_least_ten_real_instances_with_recipes_are_shipped():
    assert len(PYPI_INSTANCES) >= 10
    assert len({i["repo"] for i in PYPI_INSTANCES}) >= 10
    for inst in PYPI_INSTANCES:
        assert inst["FAIL_TO_PASS"] and inst["environment"]["pip_packages"]
    plugins = {p.split("==")[0] for i in PYPI_INSTANCES for p in i["environment"]["pip_packages"]}
    assert {"pytest-cov", "pytest-asyncio"} <= plugins  # projects that need pytest plugins


# Podman runs the same image that bwrap's rootfs is exported from, through the same task code:
# every instance on bwrap (the default backend), and on podman the two whose recipes differ most
# (a plain project with a test dependency; an old pytest with pytest-asyncio and --cov in its config).
DOCKER_INSTANCES = ("pypi__packaging-24.1", "pypi__async_timeout-4.0.3")


def _cases():
    for inst in PYPI_INSTANCES:
        yield pytest.param("bwrap", inst, id=f"bwrap-{inst['instance_id']}")
    for inst in PYPI_INSTANCES:
        if inst["instance_id"] in DOCKER_INSTANCES:
            yield pytest.param("docker", inst, id=f"docker-{inst['instance_id']}")


def test_every_instance_named_for_podman_is_shipped():
    assert set(DOCKER_INSTANCES) <= {inst["instance_id"] for inst in PYPI_INSTANCES}


@pytest.mark.parametrize("backend, instance", list(_cases()))
async def test_gold_scores_one_and_empty_scores_zero(episode, backend, instance, tmp_path):
    why_not = _runnable(backend, instance)
    if why_not:
        pytest.fail(why_not)  # scripts/test builds them (scripts/install-podman)
    ep = await episode(SweTask(), {**instance, "repo_mirror": str(tmp_path / "mirror")}, backend=backend)
    assert ep.env.sandbox.backend == backend
    await apply_in_sandbox(ep, instance["patch"])
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    report = ep.env.trajectory.extra["eval"]
    assert set(report["tests"]) == set(instance["FAIL_TO_PASS"]) | set(instance["PASS_TO_PASS"])
    assert set(report["tests"].values()) == {"passed"}

    # The empty patch, in the same sandbox: the checkout back at base_commit, nothing changed.
    repo = SweTask().repo_dir(instance, ep.env.sandbox.workdir)
    async with ep.client() as sb:
        reset = await sb.bash(f"cd {repo} && git reset -q --hard {instance['base_commit']} && git clean -qfdx")
        assert reset.exit_code == 0, reset.output
    assert await ep.score() == 0.0
    assert "FAIL_TO_PASS 0/" in ep.reason
    assert ep.env.trajectory.extra["model_patch"] == ""


async def test_autoload_turned_off_by_the_instance_falls_back_when_the_project_needs_a_plugin(episode, tmp_path):
    # async-timeout's setup.cfg passes --cov: without pytest-cov loaded pytest stops with a usage error.
    instance = next(i for i in PYPI_INSTANCES if i["repo"] == "pypi/async_timeout")
    why_not = _runnable("bwrap", instance)
    if why_not:
        pytest.fail(why_not)  # scripts/test builds them (scripts/install-podman)
    ep = await episode(SweTask(), {**instance, "repo_mirror": str(tmp_path / "mirror"),
                                   "env": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}}, backend="bwrap")
    await apply_in_sandbox(ep, instance["patch"])
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    assert "usage error" in ep.reason and "plugin autoload on" in ep.reason
