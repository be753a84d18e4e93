"""The tests every Node.js CLI preset passes (imported by tests/harness/test_<cli>.py, which name
the CLI and its model with the fixtures ``cli`` and ``cli_model_dir``): the CLI, unmodified at its
pinned version, runs `--version` in a bubblewrap sandbox on its own Node.js; it completes an arith
episode through the whole pipeline in bubblewrap and in podman (two jobs at once), driven by a tiny model that learnt
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
    run_jobs,
    write_lean_presets,
)
from .sandbox_presets import assert_fixed_and_scored, swe_job

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


@pytest.fixture
def cli_server(preset_server, cli_model_dir):
    return preset_server.serving(cli_model_dir)


@pytest.fixture(scope="module")
def pool(module_pool, presets_dir, cli_model_dir):
    """The module's workers (its jobs' models share their tokenizer), told of the lean presets."""
    # The operator lets these jobs pick their sandbox's backend and image, and have LIMITS.
    return module_pool(cli_model_dir, {"ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(presets_dir)]),
                                       "ROLLSTREAM_SANDBOX_JOB_OVERRIDES": '["backend", "image", "limits"]',
                                       "ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS": "1"})


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


async def test_the_cli_in_bwrap_and_in_podman_completes_its_loop_and_its_answer_is_scored(
        module_settings, pool, cli, preset, cli_server):
    # One pool runs both jobs at once, each in the sandbox backend it asks for.
    sandboxes = [{"backend": "bwrap", "limits": cli.limits}]
    if DockerBackend().available():  # (a podman engine answers here: scripts/install-podman)
        image = build_image(preset, DEFAULT_BASE_IMAGE)  # once; its lean variant runs from the same prefix
        sandboxes.append({"backend": "docker", "image": image, "limits": cli.limits})
    results = await run_jobs(module_settings, cli_server, [arith.job(INSTANCE, sampling=GREEDY, agent=agent(cli),
                                                                     sandbox=sandbox) for sandbox in sandboxes])
    for result in results:
        assert_answered_and_scored(result, cli.tool, calls=len(cli.replies))


async def test_the_cli_on_a_model_that_emits_garbage_is_the_agents_failure_scored_once(
        module_settings, pool, cli, preset, arith_server):
    result = await run_job(module_settings, arith_server, arith.job(INSTANCE, agent=agent(cli, max_turns=2),
                                                                    sandbox={"limits": cli.limits}))
    assert result.status == "completed" and result.attempts == 1, result.error
    traj = result.trajectory
    assert traj.extra["door"]["requests"] >= 1 and result.reward == 0.0, traj.extra
    assert result.failure == "agent" or traj.finish_reason == "stop", (result.failure, traj.extra)



async def the_cli_fixes_a_shipped_swe_instance_in_bwrap_and_its_diff_is_scored(
        module_settings, pool, cli, preset, cli_swe_model_dir, preset_server, tmp_path):
    """(Collected by the modules of the CLIs whose SWE model tests/model_cache.py builds.)"""
    job = swe_job(str(tmp_path / "swe-mirror"), agent(cli, max_context_tokens=cli.swe_context_tokens))
    server = preset_server.serving(cli_swe_model_dir)
    result = await run_job(module_settings, server, {**job, "sandbox": {"limits": cli.limits}})
    assert_fixed_and_scored(result)


def _model_fixtures(name: str, model_fixture: str) -> tuple:
    """A fixture ``name`` that is the model of ``model_fixture``, named as tests/model_cache.py
    names it (conftest then builds that model before the tests start), and that one."""
    import inspect

    import model_cache

    def model():
        return model_cache.load(model_fixture)

    def model_dir(**fixtures):
        return fixtures[model_fixture]

    model_dir.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(model_fixture, inspect.Parameter.KEYWORD_ONLY)])
    return (pytest.fixture(scope="module", name=name)(model_dir),
            pytest.fixture(scope="module", name=model_fixture)(model))


def cli_fixtures(which, model_fixture: str, swe_model_fixture: str | None = None) -> tuple:
    """A test module's fixtures for the CLI ``which``: ``cli``, and ``cli_model_dir`` (and
    ``cli_swe_model_dir``) through its model's own fixture. Assign them to names of the module."""

    def cli():
        return which

    swe = _model_fixtures("cli_swe_model_dir", swe_model_fixture) if swe_model_fixture else ()
    return (pytest.fixture(scope="module", name="cli")(cli), *_model_fixtures("cli_model_dir", model_fixture), *swe)
