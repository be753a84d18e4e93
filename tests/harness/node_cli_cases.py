"""The tests every Node.js CLI preset passes (imported by tests/harness/test_<cli>.py, which name
the CLI and its model with the fixtures ``cli`` and ``cli_model_dir``): the CLI, unmodified at its
pinned version, runs `--version` in a bubblewrap sandbox on its own Node.js; it completes an arith
episode through the whole pipeline in bubblewrap and in podman, driven by a tiny model that learnt
the door's renderings of its calls, and eval scores the answer it printed; on the arith model,
which knows nothing of the CLI, its failure is the agent's, scored, once."""

from __future__ import annotations

import json

import pytest

from rollstream.agent.presets import build_image, find_preset, install_on_host
from rollstream.sandboxes import (
    SandboxClient,
    SandboxSpec,
    create_sandbox,
    destroy_sandbox,
)
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
from rollstream.tasks import arith

from .node_clis import (
    INSTANCE,
    assert_answered_and_scored,
    run_job,
    write_lean_presets,
)

GREEDY = {"temperature": 0.0, "max_tokens": 96}


def agent(cli, **changes) -> dict:
    return {"harness": cli.lean, "max_turns": 4, "max_tokens_per_turn": 96, "max_context_tokens": 4096,
            "max_wall_time_s": 300, **changes}


@pytest.fixture(scope="module")
def preset(cli):
    preset = find_preset(cli.preset)
    install_on_host(preset)  # a no-op where scripts/install-harnesses installed it
    return preset


@pytest.fixture(scope="module")
def presets_dir(tmp_path_factory):
    return write_lean_presets(tmp_path_factory.mktemp("presets"))


@pytest.fixture(scope="module")
def cli_server(cli_model_dir):
    from rollstream.llm.server import served_model

    with served_model(cli_model_dir, device="cpu") as url:
        yield url


def _pool(worker_pool, model_dir, sandbox_root, presets_dir, backend: str | None = None):
    pool = worker_pool(model_dir=model_dir, sandbox_root=sandbox_root)
    pool.env["ROLLSTREAM_HARNESS_PRESET_DIRS"] = json.dumps([str(presets_dir)])
    pool.env["ROLLSTREAM_SANDBOX_JOB_OVERRIDES"] = '["image", "limits"]'
    pool.env["ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS"] = "1"  # the operator lets these jobs have LIMITS
    if backend == "docker":
        pool.env["ROLLSTREAM_SANDBOX_BACKEND"] = "docker"
    pool.start_all(concurrency=2)
    return pool


async def test_the_cli_runs_on_its_own_node_in_a_bwrap_sandbox(cli, preset, sandbox_root):
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="cli-version", owner="test",
                                  root_dir=sandbox_root)
    try:
        async with SandboxClient(handle.socket_path) as sandbox:
            # No node on the sandbox's PATH but the preset's own (the host's is not Node 22).
            program = " ".join(preset.argv[:cli.program_args])
            result = await sandbox.bash(f"PATH={preset.prefix}/node_modules/.bin:/usr/bin:/bin; node --version; "
                                        f"HOME=/tmp {program} --version", timeout_s=120)
    finally:
        await destroy_sandbox(handle)
    assert result.exit_code == 0, result.output
    node, *said = result.output.strip().splitlines()  # (Codex warns before its version)
    assert node == f"v{preset.node}" and preset.version in said[-1], result.output


async def test_the_cli_in_bwrap_completes_its_loop_and_its_answer_is_scored(
        settings, worker_pool, sandbox_root, cli, preset, presets_dir, cli_model_dir, cli_server):
    _pool(worker_pool, cli_model_dir, sandbox_root, presets_dir)
    result = await run_job(settings, cli_server, arith.job(INSTANCE, sampling=GREEDY, agent=agent(cli),
                                                           sandbox={"limits": cli.limits}))
    assert_answered_and_scored(result, cli.tool, calls=len(cli.replies))


@pytest.mark.skipif(not DockerBackend().available(), reason="no Docker API (podman) engine answers here")
async def test_the_cli_in_podman_completes_its_loop_and_its_answer_is_scored(
        settings, worker_pool, sandbox_root, cli, preset, presets_dir, cli_model_dir, cli_server):
    image = build_image(preset, DEFAULT_BASE_IMAGE)  # once; its lean variant runs from the same prefix
    _pool(worker_pool, cli_model_dir, sandbox_root, presets_dir, backend="docker")
    result = await run_job(settings, cli_server, arith.job(INSTANCE, sampling=GREEDY, agent=agent(cli),
                                                           sandbox={"image": image, "limits": cli.limits}))
    assert_answered_and_scored(result, cli.tool, calls=len(cli.replies))


async def test_the_cli_on_a_model_that_emits_garbage_is_the_agents_failure_scored_once(
        settings, worker_pool, sandbox_root, cli, preset, presets_dir, arith_model_dir, arith_server):
    _pool(worker_pool, arith_model_dir, sandbox_root, presets_dir)
    result = await run_job(settings, arith_server, arith.job(INSTANCE, agent=agent(cli, max_turns=2),
                                                             sandbox={"limits": cli.limits}))
    assert result.status == "completed" and result.attempts == 1, result.error
    traj = result.trajectory
    assert traj.extra["door"]["requests"] >= 1 and result.reward == 0.0, traj.extra
    assert result.failure == "agent" or traj.finish_reason == "stop", (result.failure, traj.extra)



def cli_fixtures(which, model_fixture: str) -> tuple:
    """A test module's fixtures for the CLI ``which``: ``cli``, and ``cli_model_dir`` through its
    model's own fixture, named as tests/model_cache.py names it (conftest then builds that model
    before the tests start). Assign them to names of the module."""
    import inspect

    import model_cache

    def cli():
        return which

    def model():
        return model_cache.load(model_fixture)

    def cli_model_dir(**fixtures):
        return fixtures[model_fixture]

    cli_model_dir.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(model_fixture, inspect.Parameter.KEYWORD_ONLY)])
    return (pytest.fixture(scope="module", name="cli")(cli),
            pytest.fixture(scope="module", name="cli_model_dir")(cli_model_dir),
            pytest.fixture(scope="module", name=model_fixture)(model))
