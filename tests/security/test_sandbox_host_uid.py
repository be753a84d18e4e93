"""Hole 3: nothing in a bubblewrap sandbox is root on the host. Under a root supervisor bwrap used
to map the sandbox's user to host uid 0, so /etc/shadow and a 0600 file in a 0700 folder were
readable inside; every sandboxed process now runs under an unprivileged host uid of its own,
which owns the workdir (so the sandbox and the editor can both keep writing there)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from sandboxes.conftest import needs_bwrap, root_dir, sandbox, sb  # noqa: F401  (fixtures)

from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.backends.bwrap import BwrapBackend

pytestmark = needs_bwrap


@pytest.fixture
def root_only_file():
    """A 0600 file in a 0700 folder on the host, outside every sandbox root."""
    folder = tempfile.mkdtemp(prefix="rs-private-", dir="/var/tmp")
    os.chmod(folder, 0o700)
    path = os.path.join(folder, "secret")
    with open(path, "w") as handle:
        handle.write("host secret\n")
    os.chmod(path, 0o600)
    yield path
    shutil.rmtree(folder, ignore_errors=True)


async def test_root_only_host_files_are_unreadable_while_the_workdir_stays_writable(sb, sandbox, root_only_file):
    for target in ("/etc/shadow", root_only_file):
        result = await sb.bash(f"cat {target}")
        assert result.exit_code != 0 and "host secret" not in result.output and "root:" not in result.output, \
            (target, result.output)
        assert "Permission denied" in result.output or "No such file" in result.output, result.output
    result = await sb.bash("echo made > made.txt && echo tmp > /tmp/t && cat made.txt /tmp/t && id -u")
    assert result.exit_code == 0 and result.output.startswith("made\ntmp\n"), result.output
    # Seen from the host, what the sandbox wrote belongs to an unprivileged uid, never root.
    owner = os.stat(os.path.join(sandbox.host_workdir, "made.txt")).st_uid
    assert owner != 0 or os.geteuid() != 0


async def test_files_the_editor_creates_stay_writable_from_inside(sb):
    await sb.edit("create", "sub/dir/notes.txt", file_text="one\n")
    await sb.write_file("data.bin", b"x")
    result = await sb.bash("echo two >> sub/dir/notes.txt && echo y > data.bin && touch sub/dir/new "
                           "&& cat sub/dir/notes.txt")
    assert result.exit_code == 0 and result.output == "one\ntwo\n", result.output


async def test_two_sandboxes_run_under_different_host_uids(root_dir):
    handles = [await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"uid{i}", root_dir=root_dir)
               for i in range(2)]
    try:
        owners = []
        for handle in handles:
            async with SandboxClient(handle.socket_path) as client:
                assert (await client.bash("touch mine")).exit_code == 0
            owners.append(os.stat(os.path.join(handle.host_workdir, "mine")).st_uid)
        assert len(set(owners)) == 2 or os.geteuid() != 0, owners
    finally:
        for handle in handles:
            await destroy_sandbox(handle)


def test_bwrap_on_the_host_gets_none_of_the_jobs_environment(tmp_path):
    """The job's env reaches the sandbox by --setenv only: on the host, LD_PRELOAD=<a file in
    the workdir> would have run the job's code in bwrap itself, outside every namespace."""
    layout = SandboxLayout.of(str(tmp_path), "envsb")
    layout.make()
    spec = SandboxSpec(backend="bwrap", env={"LD_PRELOAD": f"{layout.work}/evil.so", "BASH_ENV": "/x"})
    plan = BwrapBackend().plan(spec, layout, "envsb", "test")
    assert "LD_PRELOAD" not in plan.spawn_env and "BASH_ENV" not in plan.spawn_env
    assert plan.bash_argv[plan.bash_argv.index("LD_PRELOAD") - 1] == "--setenv"
