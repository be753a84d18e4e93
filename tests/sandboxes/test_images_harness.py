"""Harness layers beyond `images build --now` on podman: a queued build with --harness (the image
worker layers the preset after the environment, under the tag the --now path builds; an unknown
preset is refused before anything is built), and the layer on bwrap and Singularity (its rootfs,
its SIF made from the layered image): a preset job there starts from it, or fails saying how to
build it. No apptainer here: the SIF's commands are checked as built, as test_images_env.py does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollstream.agent.harness_images import agent_spec, layer_tag
from rollstream.agent.presets import find_preset
from rollstream.cli.images import app
from rollstream.errors import JobFailed
from rollstream.sandboxes import SandboxSpec
from rollstream.sandboxes.backends import SandboxLayout
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.backends.singularity import SingularityBackend
from rollstream.sandboxes.env_images import image_exists
from rollstream.sandboxes.image_cache import resolve_image, rootfs_path, sif_path
from rollstream.sandboxes.images import sif_build_argv
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import load_instances
from rollstream.workers import image_jobs

SHIPPED = Path(__file__).resolve().parents[2] / "rollstream" / "data" / "swe" / "pypi_instances.jsonl"
ENV_IMAGE = "localhost/rollstream/env:0123456789abcdef0123"
APPTAINER = "/usr/bin/apptainer"


def _queue(tmp_path: Path, redis_url: str, instance: dict, *args: str) -> str:
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text(json.dumps(instance) + "\n")
    result = CliRunner().invoke(app, ["build", str(jsonl), "--backend", "docker", "--redis", redis_url, *args])
    assert result.exit_code == 0, result.output
    (request_id,) = re.findall(r"queued image request (\S+)", result.output)
    return request_id


def test_a_queued_build_naming_an_unknown_preset_is_refused_before_anything_is_built(tmp_path, redis_url):
    instance = load_instances(SHIPPED)[0]
    said = CliRunner().invoke(app, ["build", str(SHIPPED), "--harness", "no-such-harness", "--redis", redis_url])
    assert said.exit_code != 0 and "no harness preset 'no-such-harness'" in said.output
    # Queued by hand (a preset the submitter's folders know, the worker's do not): refused, nothing built
    # (the worker's mirror is empty: a build would have failed, not been refused).
    request_id = image_jobs.enqueue(redis_url, image_jobs.EnvironmentsRequest(instances=[instance],
                                                                              harnesses=["no-such-harness"]))
    assert image_jobs.ImageWorker(redis_url, mirror=str(tmp_path / "empty")).work(burst=True) == 1
    outcome = image_jobs.result(redis_url, request_id)
    assert outcome is not None and outcome["status"] == "refused", outcome
    assert "no harness preset 'no-such-harness'" in outcome["error"]


def test_a_queued_build_with_harness_layers_the_preset_under_the_tag_the_now_path_builds(tmp_path, redis_url):
    from harness.swe_podman_image import instance as swe_podman_instance

    if not DockerBackend().available():
        pytest.fail("no container engine answers at DOCKER_HOST (scripts/install-podman sets up podman's)")
    instance = swe_podman_instance()
    env_image = swe_env.sandbox_image(swe_records.normalize(instance))
    layer = layer_tag(find_preset("codex"), env_image)
    if not (image_exists(env_image) and image_exists(layer)):
        pytest.fail("the SWE environment and its harness layers are not built; run scripts/install-harnesses")
    request_id = _queue(tmp_path, redis_url, instance, "--harness", "codex")
    assert image_jobs.ImageWorker(redis_url).work(burst=True) == 1
    outcome = image_jobs.result(redis_url, request_id)
    assert outcome is not None and outcome["status"] == "finished", outcome
    [entry] = outcome["result"]
    # The layer the --now path built (scripts/install-harnesses): one cache key, one tag, not rebuilt.
    assert entry["tag"] == env_image and entry["built"] is False and entry["harnesses"] == {"codex": layer}


async def test_a_preset_job_on_bwrap_or_singularity_starts_from_its_layers_rootfs_or_sif_or_fails_saying_how(
        tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_IMAGES_DIR", str(tmp_path))
    spec = SandboxSpec(image=ENV_IMAGE)
    layer = layer_tag(find_preset("codex"), ENV_IMAGE)
    for backend in ("bwrap", "singularity"):
        with pytest.raises(JobFailed, match=f"--backend {backend} --harness codex") as failed:
            await agent_spec(spec, spec.model_copy(update={"backend": backend}), "codex")
        assert not failed.value.retryable  # the operator builds it once; a retry would fail alike
    # The layer's artifacts, where `images build --backend bwrap --backend singularity --harness codex` puts them.
    Path(rootfs_path(layer)).mkdir()
    Path(sif_path(layer)).touch()
    for backend in ("bwrap", "singularity"):
        layered = await agent_spec(spec, spec.model_copy(update={"backend": backend}), "codex")
        assert layered.image == layer, backend
        # Eval keeps the task's spec: the pristine environment image.
        assert spec.image == ENV_IMAGE
    assert resolve_image(layer, "bwrap") == rootfs_path(layer)  # bwrap's root: the layer's rootfs
    plan = SingularityBackend(binary=APPTAINER).plan(SandboxSpec(image=layer), SandboxLayout(str(tmp_path / "sb")),
                                                     "job-1", "owner")
    assert plan.start_argv[:3] == [APPTAINER, "instance", "start"] and plan.start_argv[-2] == sif_path(layer)
    # The SIF is made from the layered image (saved as an OCI archive), as from any environment image.
    assert sif_build_argv(layer, sif_path(layer), "/tmp/x.oci.tar")[1:] == [
        "build", "--force", sif_path(layer), "oci-archive:///tmp/x.oci.tar"]
    # A job that chose its image, or names no preset, runs the task's spec as it is.
    on_bwrap = spec.model_copy(update={"backend": "bwrap"})
    assert await agent_spec(spec, on_bwrap.model_copy(update={"image": "/srv/rootfs"}), "codex") == spec
    assert await agent_spec(spec, on_bwrap, None) == spec
