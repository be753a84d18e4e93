"""Environment images: what each backend runs for an image (image_cache.py), the build steps
of a recipe, the Singularity commands (no Apptainer here: their construction), and the cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from rollstream.sandboxes import SandboxSpec, image_cache, images
from rollstream.sandboxes.backends import SandboxLayout
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.backends.singularity import SingularityBackend
from rollstream.sandboxes.env_images import (
    ENV_PREFIX,
    EnvBuildFailed,
    EnvRecipe,
    build_env_image,
    containerfile,
    image_exists,
)
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import load_instances
from rollstream.workers import image_jobs

TAG = "localhost/rollstream/env:0123456789abcdef0123"
RECIPE = EnvRecipe(python="3.11", pre_install=["apt-get install -y libxml2"], pip_packages=["pytest==8.3.3"],
                   repo="pypi/parse", commit="a" * 40, repo_dir="/workspace/parse")


def test_bwrap_runs_the_cached_rootfs_of_an_image_and_says_how_to_make_a_missing_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_IMAGES_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="rollstream images pull --backend bwrap"):
        image_cache.resolve_image(TAG, "bwrap")
    os.makedirs(image_cache.rootfs_path(TAG))
    rootfs = tmp_path / "localhost_rollstream_env_0123456789abcdef0123.rootfs"
    assert image_cache.resolve_image(TAG, "bwrap") == str(rootfs)
    assert image_cache.resolve_image(str(tmp_path), "bwrap") == str(tmp_path)  # a folder is a rootfs already


def test_singularity_runs_a_cached_sif_else_the_docker_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_IMAGES_DIR", str(tmp_path))
    assert image_cache.resolve_image("swebench/sweb.eval.x86_64.a_1776_b-1:latest", "singularity") == \
        "docker://swebench/sweb.eval.x86_64.a_1776_b-1:latest"
    Path(image_cache.sif_path(TAG)).write_bytes(b"sif")
    layout = SandboxLayout(str(tmp_path / "sb"))
    spec = SandboxSpec(backend="singularity", image=TAG)
    plan = SingularityBackend("/usr/bin/apptainer").plan(spec, layout, "s1", "")
    assert plan.start_argv[-2:] == [image_cache.sif_path(TAG), "rs-s1"]


def test_docker_refuses_a_rootfs_folder_or_sif(tmp_path):
    with pytest.raises(ValueError, match="image reference"):
        image_cache.resolve_image(str(tmp_path), "docker")
    assert image_cache.resolve_image(TAG, "docker") == TAG


def test_sif_from_an_engine_image_uses_an_oci_archive_or_the_docker_daemon():
    argv = images.sif_build_argv(TAG, "/images/env.sif", "/images/env.oci.tar")
    assert argv[1:] == ["build", "--force", "/images/env.sif", "oci-archive:///images/env.oci.tar"]
    assert images.sif_build_argv(TAG, "/images/env.sif")[-1] == f"docker-daemon://{TAG}"


def test_recipe_build_checks_python_installs_into_a_venv_and_drops_the_checkout():
    steps = containerfile(RECIPE)
    assert steps.startswith(f"FROM {RECIPE.base_image}\n")
    assert "COPY repo /workspace/parse\n" in steps
    assert "recipe wants Python 3.11" in steps
    parts = ("apt-get install -y libxml2", f"python3 -m venv --system-site-packages {ENV_PREFIX}",
             "pip install -q pytest==8.3.3", "cd /workspace/parse", RECIPE.install, "rm -rf /workspace/parse")
    order = [steps.index(part) for part in parts]
    assert order == sorted(order)


def test_recipe_tag_is_its_content():
    assert RECIPE.tag == EnvRecipe(**RECIPE.model_dump()).tag
    assert RECIPE.tag != EnvRecipe(**{**RECIPE.model_dump(), "install": "pip install ."}).tag


@pytest.mark.skipif(not DockerBackend().available(), reason="no Docker engine answers here (scripts/install-podman)")
def test_a_built_environment_is_reused_not_rebuilt(tmp_path):
    shipped = Path(__file__).resolve().parents[2] / "rollstream" / "data" / "swe" / "pypi_instances.jsonl"
    instance = load_instances(shipped)[0]
    if not image_exists(swe_env.sandbox_image(swe_records.normalize(instance))):
        pytest.fail("the shipped environment images are not built; run scripts/install-podman")
    again = swe_env.build_for_instances([instance, {**instance, "instance_id": "sibling"}], tmp_path, ("docker",))
    assert [(e["built"], e["instances"]) for e in again] == [(False, [instance["instance_id"], "sibling"])]


@pytest.mark.skipif(not DockerBackend().available(), reason="no Docker engine answers here (scripts/install-podman)")
def test_images_build_queues_one_request_per_instance_that_a_worker_runs(tmp_path, redis_url):
    from typer.testing import CliRunner

    from rollstream.cli.images import app

    shipped = Path(__file__).resolve().parents[2] / "rollstream" / "data" / "swe" / "pypi_instances.jsonl"
    instance = load_instances(shipped)[0]
    if not image_exists(swe_env.sandbox_image(swe_records.normalize(instance))):
        pytest.fail("the shipped environment images are not built; run scripts/install-podman")
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text(json.dumps(instance) + "\n")
    result = CliRunner().invoke(app, ["build", str(jsonl), "--backend", "docker", "--redis", redis_url])
    assert result.exit_code == 0, result.output
    (request_id,) = re.findall(r"queued image request (\S+)", result.output)
    assert image_jobs.ImageWorker(redis_url).work(burst=True) == 1
    outcome = image_jobs.result(redis_url, request_id)
    assert outcome is not None and outcome["status"] == "finished", outcome
    built = outcome["result"]
    assert [(e["built"], e["instances"]) for e in built] == [(False, [instance["instance_id"]])]


def _git_project(folder: Path) -> tuple[str, str]:
    folder.mkdir()
    (folder / "setup.py").write_text("raise SystemExit('not installed in these tests')\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "setup.py"], ["git", "commit", "-q", "-m", "x"]):
        subprocess.run(argv, cwd=folder, check=True, env=env)
    return str(folder), subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, check=True, capture_output=True,
                                       text=True).stdout.strip()


@pytest.mark.skipif(not DockerBackend().available(), reason="no Docker engine answers here (scripts/install-podman)")
def test_a_recipe_naming_a_patch_level_python_builds_on_a_base_image_of_that_minor_version(tmp_path):
    repo, commit = _git_project(tmp_path / "project")
    recipe = EnvRecipe(python="3.11.7", repo="pypi/patchlevel", commit=commit, repo_dir="/workspace/patchlevel",
                       install="python -c 'import sys; assert sys.version_info[:2] == (3, 11)'")
    try:
        built = build_env_image(recipe, repo, ("docker",), str(tmp_path / "images"), network="none", force=True)
        assert built.built and image_exists(recipe.tag)
    finally:
        subprocess.run(["docker", "rmi", "--force", recipe.tag], capture_output=True)


@pytest.mark.skipif(not DockerBackend().available(), reason="no Docker engine answers here (scripts/install-podman)")
@pytest.mark.parametrize("fields, step, said", [
    ({"python": "3.9"}, "step 1/6: check the base image has Python 3.9",
     "recipe wants Python 3.9, the base image has 3.11"),
    ({"install": "echo the project needs libfoo-dev >&2; exit 7"}, "step 4/5: echo the project needs libfoo-dev",
     "the project needs libfoo-dev"),
])
def test_a_failed_build_names_its_failing_step_and_that_steps_own_output(tmp_path, fields, step, said):
    repo, commit = _git_project(tmp_path / "project")
    recipe = EnvRecipe(repo="pypi/broken", commit=commit, repo_dir="/workspace/broken", **fields)
    with pytest.raises(EnvBuildFailed) as failure:
        build_env_image(recipe, repo, ("docker",), str(tmp_path / "images"), network="none", force=True)
    message = str(failure.value)
    assert step in message and said in message.splitlines()[-1], message
    assert "DEPRECATED" not in message and "legacy builder" not in message
    assert not image_exists(recipe.tag)
