"""Issue #32, finding 3 (and finding 9's docker item): a SWE instance's `image` field bypassed
the override policy, so a job chose the host's root filesystem (`/.`) or any host folder as its
bwrap rootfs, skipping the masks of the host rootfs, or any image the Docker engine held, another
tenant's included. Every image a job's sandbox starts from now passes the operator's policy:
a reference on `sandbox_images`, or a path strictly beneath `sandbox_image_folders` (default
the image cache). And `docker run` reads the image after `--`, so a name is never an option."""

from __future__ import annotations

import json

import pytest
from sandboxes.conftest import needs_bwrap, root_dir  # noqa: F401  (fixture)

from rollstream.config import Settings
from rollstream.errors import InvalidJob
from rollstream.messages import Envelope, Job
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.policy import OverridePolicy, SandboxOverrideRefused
from rollstream.tasks.base import TaskContext
from rollstream.tasks.swe import SweTask, load_instances
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

INSTANCE = load_instances()[0]
HOST_FOLDERS = ["/.", "/", "/etc/..", "/usr", "/root", "//"]
FOREIGN_REFERENCES = ["docker.io/library/alpine:latest", "other-tenant/private-weights:latest",
                      "localhost/rollstream-evil/x:1", "localhost/rollstream/../../etc"]


@pytest.fixture
def images_dir(tmp_path, monkeypatch):
    """The operator's image cache, where `rollstream images` unpacks rootfs folders."""
    folder = tmp_path / "images"
    (folder / "python_3.11.rootfs").mkdir(parents=True)
    monkeypatch.setenv("ROLLSTREAM_IMAGES_DIR", str(folder))
    return folder


def instance_spec(image: str) -> SandboxSpec:
    return SweTask().sandbox_spec({**INSTANCE, "image": image})


@pytest.mark.parametrize("image", HOST_FOLDERS)
def test_an_instance_naming_a_host_folder_as_its_image_is_refused(image, images_dir):
    with pytest.raises(SandboxOverrideRefused, match="outside the operator's image folders") as refused:
        OverridePolicy().apply(instance_spec(image), None)
    assert isinstance(refused.value, InvalidJob)  # the job's fault: failure 'job', never retried


def test_a_symlink_to_the_host_root_inside_the_image_cache_is_refused(images_dir):
    (images_dir / "rootfs-link").symlink_to("/")
    (images_dir / "escape.rootfs").symlink_to("/etc")
    for name in ("rootfs-link", "escape.rootfs"):
        with pytest.raises(SandboxOverrideRefused, match="outside the operator's image folders"):
            OverridePolicy().apply(instance_spec(str(images_dir / name)), None)
    with pytest.raises(SandboxOverrideRefused):  # the cache folder itself is not an image either
        OverridePolicy().apply(instance_spec(str(images_dir)), None)


@pytest.mark.parametrize("image", FOREIGN_REFERENCES)
def test_an_instance_naming_an_image_the_operator_did_not_list_is_refused(image, images_dir):
    with pytest.raises(SandboxOverrideRefused, match="sandbox_images|'\\.\\.'"):
        OverridePolicy().apply(instance_spec(image).model_copy(update={"backend": "docker"}), None)


@pytest.mark.parametrize("image", ["-v/:/host", "--privileged", "./rootfs", ".", "a b"])
def test_an_image_that_is_an_option_or_a_relative_path_is_refused(image, images_dir):
    with pytest.raises(SandboxOverrideRefused, match="neither an absolute host path nor an image reference"):
        OverridePolicy().apply(SandboxSpec(image=image), None)


def test_an_image_override_stays_under_the_image_policy_where_the_operator_allows_image_overrides(images_dir):
    policy = OverridePolicy(allowed=("image",))
    with pytest.raises(SandboxOverrideRefused, match="job.sandbox.image='/'"):
        policy.apply(SandboxSpec(), {"image": "/"})
    image = "localhost/rollstream/env:abc"
    assert policy.apply(SandboxSpec(), {"image": image}).image == image


def test_rollstreams_own_images_and_the_cache_pass_and_the_operator_widens_the_list(images_dir, monkeypatch):
    assert OverridePolicy().apply(instance_spec("localhost/rollstream/env:0123abcd"), None).image
    assert OverridePolicy().apply(instance_spec(str(images_dir / "python_3.11.rootfs")), None).image
    assert OverridePolicy().apply(SweTask().sandbox_spec(INSTANCE), None).image is None  # the operator's host rootfs
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_IMAGES", json.dumps(["docker.io/swebench/"]))
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_IMAGE_FOLDERS", json.dumps(["/srv/rootfs"]))
    policy = OverridePolicy.from_settings(Settings())
    assert policy.apply(instance_spec("docker.io/swebench/sweb.eval.x86_64.a_1776_b-1:latest"), None).image
    with pytest.raises(SandboxOverrideRefused):
        policy.apply(instance_spec("localhost/rollstream/env:0123abcd"), None)
    with pytest.raises(SandboxOverrideRefused):  # the folders replace the cache
        policy.apply(instance_spec(str(images_dir / "python_3.11.rootfs")), None)


@needs_bwrap
async def test_a_job_asking_for_the_hosts_root_as_its_rootfs_gets_no_sandbox(images_dir, root_dir, tmp_path):  # noqa: F811
    env = Envelope(job=Job(task="swe", instance={**INSTANCE, "image": "/."}))
    sandboxes = NodeSandboxes(root=str(root_dir), backend="bwrap")
    try:
        with pytest.raises(SandboxOverrideRefused, match="image='/.'"):
            await set_up(SweTask(), env, TaskContext(node="n", work_dir=tmp_path), sandboxes)
    finally:
        await sandboxes.destroy(env)
    assert env.sandbox is None  # refused before any sandbox started


def test_docker_reads_the_image_after_the_end_of_options():
    layout = SandboxLayout.of("/tmp/rs-root", "j")
    argv = DockerBackend().run_argv(SandboxSpec(backend="docker", image="localhost/rollstream/python:bookworm"),
                                    layout, "j", "j", {})
    assert argv[-3:] == ["--", "localhost/rollstream/python:bookworm", "infinity"]
    with pytest.raises(ValueError, match="starts with '-'"):
        DockerBackend().run_argv(SandboxSpec(backend="docker", image="--privileged"), layout, "j", "j", {})
