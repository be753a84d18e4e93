"""The swe task beyond the gold/empty validation: what counts as the agent's change,
what it cannot game, and evals that hang or cannot apply."""

from __future__ import annotations

import pytest

from rollstream.errors import InvalidJob
from rollstream.tasks import swe_repos
from rollstream.tasks.swe import SweTask, load_instances, patch_paths

from .conftest import needs_bwrap
from .test_harness_swe import apply_in_sandbox

CALC = next(i for i in load_instances() if i["repo"] == "rollstream/minicalc")


@pytest.fixture
def instance(tmp_path_factory):
    return {**CALC, "repo_mirror": str(tmp_path_factory.getbasetemp() / "swe-mirror")}


async def bash(ep, command: str) -> str:
    repo = SweTask().repo_dir(ep.env.job.instance, ep.env.sandbox.workdir)
    async with ep.client() as sb:
        result = await sb.bash(f"cd {repo} && {command}")
    assert result.exit_code == 0, result.output
    return result.output


@needs_bwrap
async def test_the_checkout_is_at_base_commit_with_a_working_git(episode, instance):
    ep = await episode(SweTask(), instance)
    assert instance["base_commit"] in await bash(ep, "git rev-parse HEAD")
    assert (await bash(ep, "git status --porcelain")).strip() == ""


@needs_bwrap
async def test_committed_changes_and_new_files_count_as_the_agents_diff(episode, instance):
    ep = await episode(SweTask(), instance)
    await apply_in_sandbox(ep, instance["patch"])
    await bash(ep, "echo 'x = 1' > minicalc/extra.py && git add -A && git commit -qm fix")
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    assert "minicalc/extra.py" in patch_paths(ep.env.trajectory.extra["model_patch"])


@needs_bwrap
async def test_editing_the_tests_does_not_count(episode, instance):
    ep = await episode(SweTask(), instance)
    # An agent that "fixes" the issue by deleting the failing tests gets no credit.
    await bash(ep, "printf 'def test_nothing():\\n    pass\\n' > tests/test_calc.py && "
                   "printf 'def test_more():\\n    pass\\n' > tests/test_new.py")
    assert await ep.score() == 0.0
    assert ep.env.trajectory.extra["model_patch"] == ""


@needs_bwrap
async def test_a_fix_that_hangs_the_tests_scores_zero_within_the_eval_limit(episode, instance):
    ep = await episode(SweTask(), {**instance, "eval_timeout_s": 3})
    await bash(ep, "sed -i 's/^def evaluate(text):/def evaluate(text):\\n    while True: pass/' minicalc/calc.py")
    assert await ep.score() == 0.0
    assert "timed out" in ep.reason


@needs_bwrap
async def test_a_repository_missing_from_the_mirror_fails_init_with_what_to_do(episode, instance):
    with pytest.raises(swe_repos.MirrorError, match="not in the mirror"):
        await episode(SweTask(), {**instance, "repo": "someone/elsewhere"})


def test_shipped_repositories_build_to_the_commits_the_instances_name(tmp_path):
    for inst in load_instances():
        entry = swe_repos.locate(inst["repo"], tmp_path)
        assert swe_repos._git("rev-parse", "HEAD", cwd=entry) == inst["base_commit"]


def test_swe_bench_json_string_lists_are_accepted():
    import json

    SweTask().validate({**CALC, "FAIL_TO_PASS": json.dumps(CALC["FAIL_TO_PASS"]), "PASS_TO_PASS": "[]"})


@pytest.mark.parametrize("change", [{"repo": "no-slash"}, {"base_commit": "main"}, {"FAIL_TO_PASS": "not json"},
                                    {"FAIL_TO_PASS": [], "PASS_TO_PASS": []}, {"test_patch": 5}])
def test_malformed_swe_instances_are_rejected_at_submit(change):
    with pytest.raises(InvalidJob):
        SweTask().validate({**CALC, **change})


@needs_bwrap
async def test_build_and_install_debris_never_enters_the_model_patch(episode, instance):
    ep = await episode(SweTask(), instance)
    await apply_in_sandbox(ep, instance["patch"])
    await bash(ep, "mkdir -p minicalc.egg-info build/lib .eggs dist .mypy_cache .tox && "
                   "echo x > minicalc.egg-info/PKG-INFO && echo x > build/lib/calc.py && echo x > .eggs/README && "
                   "echo x > dist/minicalc-0.1.tar.gz && echo x > .mypy_cache/x && echo x > .coverage")
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    assert patch_paths(ep.env.trajectory.extra["model_patch"]) == ["minicalc/calc.py"]
