"""A Harbor task whose solve.sh and test.sh act as root the way Terminal-Bench tasks do, on real
podman: tar restoring the owners it recorded and removing what another user owns (aider_polyglot's
solve.sh, run twice), a group's setgid folder, a step run as another user, another user's service
stopped. Its container keeps the root-task capabilities (SECURITY.md): the reference solution
scores 1 and no change 0; with the operator withholding them, the same solution scores 0. Root
that replaces bash, Python's sitecustomize and /tests/test.sh of its own container still scores 0:
verification starts from the pristine image.

The task folder is written here on the shared test environment (the same image as harbor_tasks/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollstream.sandbox_spec import ROOT_TASK_CAPABILITIES
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks import harbor
from rollstream.tasks.harbor import HarborTask
from rollstream.tasks.harbor_image import HarborImage

from . import harbor_fixtures
from .conftest import needs_bwrap
from .harbor_fixtures import SOLVE, copy_task, solution_tar

pytestmark = [needs_bwrap, pytest.mark.skipif(
    not DockerBackend().available(), reason="no container engine (podman's socket: scripts/install-podman)")]

SOLVE_SH = r"""#!/bin/bash
set -euo pipefail
mkdir -p /tmp/payload/files && echo 'answer 42' > /tmp/payload/files/answer.txt
chmod 0646 /tmp/payload/files/answer.txt
tar --owner=1000 --group=1000 -C /tmp -cf /tmp/payload.tar payload
for run in 1 2; do  # tar as root restores owners and modes; the second run removes uid 1000's folders
  rm -rf /app/payload
  tar -xf /tmp/payload.tar -C /app
done
mkdir -p /app/shared && chown 0:1000 /app/shared && chmod 2775 /app/shared  # root is not in group 1000
setpriv --reuid 1000 --regid 1000 --clear-groups sh -c 'id -u > /tmp/as-user'
setpriv --reuid 1000 --regid 1000 --clear-groups sleep 300 &
service=$!
sleep 0.2
kill "$service"
wait "$service" || [ $? = 143 ]  # ended by the SIGTERM
{ stat -c '%u:%g %a' /app/payload/files/answer.txt; stat -c '%a' /app/shared; cat /tmp/as-user; echo stopped; } \
  > /app/report.txt
"""

TEST_SH = r"""#!/bin/bash
# The verifier is root as well: it gives the report to uid 1000, makes it 0600 and still reads it.
mkdir -p /logs/verifier
expected=$'1000:1000 646\n2775\n1000\nstopped'
if chown 1000:1000 /app/report.txt && chmod 600 /app/report.txt && [ "$(cat /app/report.txt)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)


@pytest.fixture
def root_task(harbor_environment, tmp_path) -> Path:
    task = copy_task(harbor_environment / "hello-file", tmp_path / "root-owned-files")
    (task / "instruction.md").write_text("Unpack the payload as root keeping its owners, share a folder with "
                                         "group 1000, and write /app/report.txt.\n")
    (task / "solution" / "solve.sh").write_text(SOLVE_SH)
    (task / "tests" / "test.sh").write_text(TEST_SH)
    return task


def test_only_an_image_that_runs_as_root_gets_the_root_capabilities(harbor_environment, monkeypatch):
    for user, expected in (("", list(ROOT_TASK_CAPABILITIES)), ("root", list(ROOT_TASK_CAPABILITIES)),
                           ("0", list(ROOT_TASK_CAPABILITIES)), ("app", []), ("1000", [])):
        image = HarborImage(key="k", tag="localhost/rollstream/harbor:k", workdir="/app", user=user)
        monkeypatch.setattr(harbor, "cached", lambda key, image=image: image)
        spec = HarborTask().sandbox_spec({"path": str(harbor_environment / "hello-file")})
        assert spec.capabilities == expected, user


async def _solve(ep, task: Path):
    async with ep.client() as sb:
        await sb.write_file("/tmp/.rs-solution.tar", solution_tar(task))
        return await sb.bash(SOLVE, timeout_s=120)


async def test_a_root_task_that_chowns_scores_its_solution_one_and_no_change_zero_on_podman(episode, root_task):
    solved = await episode(HarborTask(), {"path": str(root_task)}, backend="docker")
    untouched = await episode(HarborTask(), {"path": str(root_task)}, backend="docker")
    ran = await _solve(solved, root_task)
    assert ran.exit_code == 0, ran.output
    assert await solved.score() == 1.0, solved.env.trajectory.extra["eval"]
    assert await untouched.score() == 0.0, untouched.env.trajectory.extra["eval"]


async def test_capabilities_the_operator_withholds_are_withheld_from_a_root_task(episode, root_task, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES", "[]")
    ep = await episode(HarborTask(), {"path": str(root_task)}, backend="docker")
    ran = await _solve(ep, root_task)
    assert ran.exit_code != 0 and "Cannot change ownership" in ran.output, ran.output
    assert await ep.score() == 0.0, ep.env.trajectory.extra["eval"]


async def test_a_root_agent_that_replaces_bash_and_python_outside_its_workdir_still_scores_zero(
        episode, harbor_environment):
    ep = await episode(HarborTask(), {"path": str(harbor_environment / "hello-file")}, backend="docker")
    forge = "mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; echo 'Hello, world!' > /app/hello.txt"
    async with ep.client() as sb:
        await sb.write_file("/tmp/fake-bash", f"#!/bin/bash.real\n{forge}\nexit 0\n")
        await sb.write_file("/tmp/sitecustomize.py", f"import os\nos.system({forge!r})\n")
        forged = await sb.bash(
            "cp /tmp/sitecustomize.py \"$(python3 -c 'import sitecustomize; print(sitecustomize.__file__)')\" && "
            "cp /bin/bash /bin/bash.real && cp /tmp/fake-bash /bin/bash.new && mv -f /bin/bash.new /bin/bash && "
            "chown 1000:1000 /bin/bash && mkdir -p /tests && cp /tmp/fake-bash /tests/test.sh && "
            "echo 1 > /logs/verifier/reward.txt && python3 -c 'pass' && cat /app/hello.txt && "
            # What it does inside the workdir counts: undone, so that only the forgeries outside remain.
            "rm /app/hello.txt")
        assert forged.exit_code == 0 and forged.output.strip() == "Hello, world!", forged.output
    assert await ep.score() == 0.0, ep.env.trajectory.extra["eval"]
