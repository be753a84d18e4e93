"""A Node.js CLI (Codex, unmodified) fixes the shipped SWE instance in **podman** through the whole
pipeline: its harness is installed onto the instance's environment image once, when the image is
built (`rollstream images build ... --harness`: a layer keyed by the image and the preset's install),
init starts the agent's sandbox from that layer, and eval scores the diff in a fresh sandbox of the
pristine environment image. The model is the CLI's bwrap SWE model: the podman episode renders the
same prompts but for Codex's random chunk id in its tool output, which the bwrap runs vary as well."""

from __future__ import annotations

import json

import model_cache
import pytest

from rollstream.agent.harness_images import ENGINE_BACKENDS, agent_spec, layer_tag
from rollstream.agent.presets import find_preset
from rollstream.errors import JobFailed
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import SweTask

from . import swe_podman_image
from .node_cli_cases import agent
from .node_clis import CODEX, run_job, write_lean_presets
from .sandbox_presets import assert_fixed_and_scored, swe_job

pytestmark = pytest.mark.timeout(1800)  # a first run builds the environment image and its harness layer, once


@pytest.fixture(scope="module")
def presets_dir(tmp_path_factory):
    return write_lean_presets(tmp_path_factory.mktemp("presets"))


@pytest.fixture(scope="module")
def instance():
    return swe_podman_image.instance()


@pytest.fixture(scope="module")
def built(presets_dir, tmp_path_factory):
    """The environment image and the CLI's layer on it (scripts/install-harnesses built them: cached)."""
    if not DockerBackend().available():
        pytest.fail("no container engine answers at DOCKER_HOST (scripts/install-podman sets up podman's)")
    return swe_podman_image.build(tmp_path_factory.mktemp("instances"), CODEX.lean, [presets_dir])


@pytest.fixture(scope="module")
def codex_swe_model_dir():
    return model_cache.load("codex_swe_model_dir")


def test_the_build_layers_the_cli_on_the_instances_environment_image(instance, built, presets_dir):
    env_image = swe_env.sandbox_image(swe_records.normalize(instance))
    lean = find_preset(CODEX.lean, [presets_dir])
    assert built["tag"] == env_image and built["harnesses"] == {CODEX.lean: layer_tag(lean, env_image)}
    # Named by the install: the shipped preset and its lean variant (other options, one install) share it.
    assert layer_tag(find_preset(CODEX.preset), env_image) == layer_tag(lean, env_image)


async def test_only_a_preset_job_on_an_engine_starts_from_the_layer(instance, built, presets_dir):
    spec = SweTask().sandbox_spec(instance)
    on_podman = spec.model_copy(update={"backend": ENGINE_BACKENDS[0]})
    harness = CODEX.lean
    assert (await agent_spec(spec, on_podman, harness, [presets_dir])).image == built["harnesses"][CODEX.lean]
    # bwrap (the host's install), a job that chose its image, a Python harness: the task's spec as it is.
    for resolved, job_harness in ((spec.model_copy(update={"backend": "bwrap"}), harness),
                                (on_podman.model_copy(update={"image": "localhost/other:1"}), harness),
                                (on_podman, "openai-chat"), (on_podman, None)):
        assert await agent_spec(spec, resolved, job_harness, [presets_dir]) == spec
    # A layer nobody built: the job fails at once with the command that builds it, never an install.
    unbuilt = spec.model_copy(update={"image": "localhost/rollstream/env:0000000000000000000f"})
    with pytest.raises(JobFailed, match=f"--harness {CODEX.lean}") as failed:
        await agent_spec(unbuilt, unbuilt.model_copy(update={"backend": "docker"}), harness, [presets_dir])
    assert not failed.value.retryable


async def test_codex_fixes_the_swe_instance_in_podman_and_eval_scores_its_diff(
        settings, worker_pool, sandbox_root, instance, built, presets_dir, codex_swe_model_dir, tmp_path):
    from rollstream.llm.server import served_model

    pool = worker_pool(model_dir=codex_swe_model_dir, sandbox_root=sandbox_root)
    pool.env["ROLLSTREAM_HARNESS_PRESET_DIRS"] = json.dumps([str(presets_dir)])
    # The job picks its backend and limits, not its image: init picks the layer, eval the environment.
    pool.env["ROLLSTREAM_SANDBOX_JOB_OVERRIDES"] = '["backend", "limits"]'
    pool.env["ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS"] = "1"
    pool.start_all(concurrency=1)
    job = swe_job(str(tmp_path / "swe-mirror"), agent(CODEX, max_context_tokens=CODEX.swe_context_tokens))
    job = {**job, "instance": {**job["instance"], "environment": swe_podman_image.ENVIRONMENT},
           "sandbox": {"backend": "docker", "limits": CODEX.limits}}
    with served_model(codex_swe_model_dir, device="cpu",
                      extra_args=["--max-model-len", str(CODEX.swe_context_tokens)]) as server:
        result = await run_job(settings, server, job)
    assert_fixed_and_scored(result)  # Codex ran (exit 0): the environment image alone has no Codex
