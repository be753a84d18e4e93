"""Finding 7 of the second security pass: a hostile agent forges its own SWE reward. Eval
used to run the tests in the agent's live sandbox, its processes alive, with ``/tmp/.rs-eval``
(where the agent may write) on PYTHONPATH and the agent's ``.git`` driving the eval's git.
Each agent here never fixes the issue (the gold patch is not applied) and plays one trick, as
bash commands and file writes in its own sandbox; each must end with reward 0. The honest
gold patch, in a sandbox full of the same tricks, still scores 1."""

from __future__ import annotations

import pytest
from tasks.conftest import episode, needs_bwrap, node_sandboxes, task_ctx  # noqa: F401  (fixtures)
from tasks.test_harness_swe import apply_in_sandbox

from rollstream.tasks.swe import SweTask, load_instances, patch_paths

pytestmark = needs_bwrap

CALC = next(i for i in load_instances() if i["repo"] == "rollstream/minicalc")
CALC_TESTS = CALC["FAIL_TO_PASS"] + CALC["PASS_TO_PASS"]

# Python that, loaded into the eval's pytest process, rewrites the report to all-passed at exit
# (after the report plugin wrote it).
FORGE_AT_EXIT = '''
import atexit, json, os

def _forge():
    path = os.environ.get("ROLLSTREAM_SWE_REPORT")
    if path and os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
        report["outcomes"] = {test: "passed" for test in report["outcomes"]}
        report["exitstatus"] = 0
        with open(path, "w") as f:
            json.dump(report, f)

atexit.register(_forge)
'''

# A stand-in for pytest: "passes" every test function it finds in the files it is given.
FAKE_PYTEST = '''
import json, os, re, sys

outcomes = {}
for arg in sys.argv[1:]:
    if arg.endswith(".py") and os.path.exists(arg):
        for name in re.findall(r"^def (test_\\w+)", open(arg).read(), re.M):
            outcomes[f"{arg}::{name}"] = "passed"
with open(os.environ["ROLLSTREAM_SWE_REPORT"], "w") as f:
    json.dump({"outcomes": outcomes, "exitstatus": 0}, f)
print(len(outcomes), "passed")
'''

# A conftest.py that turns every failing test into a pass (named as if run from the checkout,
# should pytest's rootdir be the folder above it).
PASSING_CONFTEST = '''
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.nodeid = report.nodeid.removeprefix("minicalc/")
'''

# The report plugin eval copies in before the tests, rewritten to report every test passed.
FORGED_PLUGIN = '''
import json, os
_seen = set()
def pytest_runtest_logreport(report):
    _seen.add(report.nodeid)
def pytest_collectreport(report):
    pass
def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["ROLLSTREAM_SWE_REPORT"], "w") as f:
        json.dump({"outcomes": {t: "passed" for t in _seen}, "exitstatus": 0}, f)
'''

# Left running by the agent: waits for eval to copy its report plugin in, then replaces it.
BACKGROUND_REWRITER = '''
import os, time
target = "/tmp/.rs-eval/rs_swe_report.py"
forged = open("/workspace/.forged_plugin.py").read()
deadline = time.time() + 600
while time.time() < deadline:
    try:
        if open(target).read() != forged:
            with open(target + ".new", "w") as f:
                f.write(forged)
            os.replace(target + ".new", target)
    except OSError:
        pass
    time.sleep(0.0005)
'''


@pytest.fixture
def instance():
    return dict(CALC)  # the shipped repository, from the node's default mirror


async def agent(ep, *commands: str, files: dict[str, str] | None = None) -> None:
    """The agent's turn: files written with the editor's create, then bash commands in its
    own session, in the checkout."""
    repo = SweTask().repo_dir(ep.env.job.instance, ep.env.sandbox.workdir)
    async with ep.client() as sb:
        for path, content in (files or {}).items():
            await sb.write_file(path, content)
        for command in commands:
            result = await sb.bash(f"cd {repo} && {command}", timeout_s=30)
            assert result.exit_code == 0, (command, result.output)


async def assert_not_resolved(ep) -> None:
    reward = await ep.score()
    report = ep.env.trajectory.extra["eval"]
    assert reward == 0.0, report
    assert "resolved" not in report["reason"], report


async def test_sitecustomize_planted_on_the_eval_pythonpath_does_not_forge_the_reward(episode, instance):
    ep = await episode(SweTask(), instance)
    await agent(ep, "mkdir -p /tmp/.rs-eval", files={"/tmp/.rs-eval/sitecustomize.py": FORGE_AT_EXIT,
                                                       "/tmp/.rs-eval/usercustomize.py": FORGE_AT_EXIT})
    await assert_not_resolved(ep)


async def test_a_git_hook_that_plants_sitecustomize_while_eval_runs_git_does_not_forge_the_reward(episode, instance):
    # core.fsmonitor names a program that git runs on `git add`: the agent's code runs inside
    # eval, after any clean-up of the eval folder, and replaces what eval relies on.
    hook = "#!/bin/sh\nmkdir -p /tmp/.rs-eval && cp /workspace/.forge.py /tmp/.rs-eval/sitecustomize.py\nexit 1\n"
    ep = await episode(SweTask(), instance)
    await agent(ep, "chmod +x /workspace/.fsmonitor && git config core.fsmonitor /workspace/.fsmonitor",
                files={"/workspace/.fsmonitor": hook, "/workspace/.forge.py": FORGE_AT_EXIT})
    await assert_not_resolved(ep)


async def test_a_pytest_that_shadows_the_real_one_from_the_repository_does_not_forge_the_reward(episode, instance):
    # `python -m pytest` imports pytest from the checkout first: a package there replaces it.
    ep = await episode(SweTask(), instance)
    await agent(ep, files={"/workspace/minicalc/pytest/__init__.py": "",
                           "/workspace/minicalc/pytest/__main__.py": FAKE_PYTEST})
    await assert_not_resolved(ep)


async def test_a_conftest_and_pytest_ini_beside_the_repository_do_not_forge_the_reward(episode, instance):
    # Outside the checkout (in the workdir above it), where eval's reset and clean never look:
    # a pytest.ini there makes pytest's rootdir the workdir, so its conftest.py loads.
    ep = await episode(SweTask(), instance)
    await agent(ep, files={"/workspace/pytest.ini": "[pytest]\n", "/workspace/conftest.py": PASSING_CONFTEST})
    await assert_not_resolved(ep)


async def test_edited_tests_and_a_planted_conftest_in_the_checkout_do_not_forge_the_reward(episode, instance):
    ep = await episode(SweTask(), instance)
    await agent(ep, "git add -A && git commit -qm 'tests the agent likes'", files={
        "/workspace/minicalc/tests/test_calc.py": "def test_addition():\n    pass\n",
        "/workspace/minicalc/tests/conftest.py": PASSING_CONFTEST,
        "/workspace/minicalc/conftest.py": PASSING_CONFTEST})
    await assert_not_resolved(ep)


async def test_a_background_process_that_rewrites_the_report_plugin_does_not_forge_the_reward(episode, instance):
    ep = await episode(SweTask(), instance)
    await agent(ep, "setsid nohup python3 /workspace/.rewriter.py > /dev/null 2>&1 < /dev/null &",
                files={"/workspace/.rewriter.py": BACKGROUND_REWRITER, "/workspace/.forged_plugin.py": FORGED_PLUGIN})
    await assert_not_resolved(ep)
    # A root node with a cgroup per sandbox (as here) kills them before it reads the checkout.
    assert ep.env.trajectory.extra["verification"]["processes_killed_first"] is True


async def test_the_gold_patch_still_scores_one_in_a_sandbox_full_of_forgeries(episode, instance):
    hook = "#!/bin/sh\nmkdir -p /tmp/.rs-eval && cp /workspace/.forge.py /tmp/.rs-eval/sitecustomize.py\nexit 1\n"
    ep = await episode(SweTask(), instance)
    await apply_in_sandbox(ep, instance["patch"])
    await agent(ep, "chmod +x /workspace/.fsmonitor && git config core.fsmonitor /workspace/.fsmonitor",
                "setsid nohup python3 /workspace/.rewriter.py > /dev/null 2>&1 < /dev/null &",
                files={"/workspace/.fsmonitor": hook, "/workspace/.forge.py": FORGE_AT_EXIT,
                       "/workspace/.rewriter.py": BACKGROUND_REWRITER, "/workspace/.forged_plugin.py": FORGED_PLUGIN,
                       "/workspace/pytest.ini": "[pytest]\n", "/workspace/conftest.py": PASSING_CONFTEST})
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    report = ep.env.trajectory.extra["eval"]
    assert set(report["tests"]) == set(CALC_TESTS) and set(report["tests"].values()) == {"passed"}


async def test_symlinks_in_the_checkout_are_refused_and_named_never_followed(episode, instance):
    # Read from the host by root, a followed symlink would hand the verifier /etc/shadow.
    ep = await episode(SweTask(), instance)
    await apply_in_sandbox(ep, instance["patch"])
    await agent(ep, "ln -s /etc/shadow minicalc/secret.py && ln -s /etc minicalc/etc")
    assert await ep.score() == 0.0
    reason = ep.reason
    assert "symlinks or submodules refused" in reason and "minicalc/secret.py" in reason and "minicalc/etc" in reason
    assert "root:" not in ep.env.trajectory.extra["model_patch"]


async def test_special_files_in_the_checkout_are_refused_and_named(episode, instance):
    ep = await episode(SweTask(), instance)
    await apply_in_sandbox(ep, instance["patch"])
    await agent(ep, "mkfifo minicalc/pipe && python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"")
    assert await ep.score() == 0.0
    assert "special files refused: minicalc/pipe (FIFO), sock (socket)" in ep.reason


async def test_what_the_agent_left_outside_its_checkout_is_named_and_left_behind(episode, instance):
    ep = await episode(SweTask(), instance)
    agent_sandbox = ep.env.sandbox
    await apply_in_sandbox(ep, instance["patch"])
    await agent(ep, files={"/workspace/pytest.ini": "[pytest]\n", "/workspace/conftest.py": PASSING_CONFTEST})
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    verification = ep.env.trajectory.extra["verification"]
    assert verification["left_behind"] == ["conftest.py", "pytest.ini"]
    assert ep.env.sandbox.id == agent_sandbox.id and ep.env.sandbox.supervisor_pid != agent_sandbox.supervisor_pid


async def test_an_image_checkout_outside_the_workdir_is_verified_fresh_despite_a_git_hook(episode, instance):
    # A published image's checkout (SWE-bench's /testbed) lies beyond the host's reach: its diff
    # comes from the agent's own git, which runs the agent's hook; the tests still run fresh.
    from rollstream.messages import Job
    from rollstream.tasks import swe_repos

    bundle = swe_repos.bundle(CALC["repo"], CALC["base_commit"], swe_repos.default_mirror()).read_bytes()
    image_like = {**instance, "repo_dir": "/tmp/testbed"}
    ep = await episode(SweTask(), image_like, job=Job(task="swe", instance=image_like, sandbox={
        "files": {"base.bundle": bundle}, "setup_commands": ["git clone -q /workspace/base.bundle /tmp/testbed"]}))
    hook = "#!/bin/sh\nmkdir -p /tmp/.rs-eval && cp /workspace/.forge.py /tmp/.rs-eval/sitecustomize.py\nexit 1\n"
    await agent(ep, "chmod +x /workspace/.fsmonitor && git config core.fsmonitor /workspace/.fsmonitor",
                files={"/workspace/.fsmonitor": hook, "/workspace/.forge.py": FORGE_AT_EXIT})
    await assert_not_resolved(ep)
    assert "FAIL_TO_PASS 0/2" in ep.reason

    await apply_in_sandbox(ep, instance["patch"])  # now in the fresh sandbox, which the next score replaces
    assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
    assert patch_paths(ep.env.trajectory.extra["model_patch"]) == ["minicalc/calc.py"]


async def test_a_python_replaced_in_a_container_sandbox_does_not_forge_the_reward(episode):
    # Under docker/podman the agent is root in a writable container: it swaps the environment's
    # python for a shim that loads its own sitecustomize.py into every test run.
    from tasks.test_swe_pypi_instances import PYPI_INSTANCES, _runnable

    instance = next(i for i in PYPI_INSTANCES if i["repo"] == "pypi/cachetools")
    why_not = _runnable("docker", instance)
    if why_not:
        pytest.fail(why_not)  # scripts/test builds the images (scripts/install-podman)
    ep = await episode(SweTask(), instance, backend="docker")
    shim = '#!/bin/sh\nPYTHONPATH=/root/forge${PYTHONPATH:+:$PYTHONPATH} exec /opt/rs-env/bin/python3 "$@"\n'
    await agent(ep, "rm /opt/rs-env/bin/python && mv /workspace/.shim /opt/rs-env/bin/python && "
                    "chmod +x /opt/rs-env/bin/python && mkdir -p /root/forge && mv /workspace/.forge.py "
                    "/root/forge/sitecustomize.py && python -c 'import sitecustomize'",
                files={"/workspace/.shim": shim, "/workspace/.forge.py": FORGE_AT_EXIT})
    await assert_not_resolved(ep)
    assert ep.env.trajectory.extra["verification"]["processes_killed_first"] is False  # no cgroup of ours there
