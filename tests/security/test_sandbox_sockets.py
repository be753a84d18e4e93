"""Hole 4: a host socket stays out of reach after its server restarts. A mask bound over the
socket covered the old inode only; a Redis that restarted made a new socket that a shell opened
before could reach. The socket's folder is now rebuilt inside without its sockets."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile

import pytest
from sandboxes.conftest import needs_bwrap, root_dir  # noqa: F401  (fixture)

from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.runtime.identity import HostIdentity
from rollstream.sandboxes.runtime.supervisor import Supervisor

pytestmark = needs_bwrap

PROBE = """
import socket, sys
try:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(3)
        s.connect(sys.argv[1])
        print("REACHED")
except OSError as error:
    print("FAILED", type(error).__name__)
"""


@pytest.fixture
def service_folder():
    """A folder (as a Redis data folder would be) holding a listening socket and a plain file."""
    folder = tempfile.mkdtemp(prefix="rs-svc-", dir="/var/tmp")
    os.chmod(folder, 0o755)
    with open(os.path.join(folder, "appendonly.aof"), "w") as handle:
        handle.write("data\n")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(folder, "redis.sock"))
    os.chmod(os.path.join(folder, "redis.sock"), 0o777)  # as the test Redis: anyone may connect
    listener.listen(8)
    yield folder, listener
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)


async def test_a_socket_recreated_after_the_sandbox_started_stays_unreachable(root_dir, service_folder):
    folder, listener = service_folder
    path = os.path.join(folder, "redis.sock")
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="sockrestart", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            await sb.write_file("probe.py", PROBE)
            before = await sb.bash(f"python3 probe.py {path}")
            assert before.output.startswith("FAILED"), before.output
            # The server restarts: its socket is unlinked and made again at the same path.
            listener.close()
            os.unlink(path)
            again = socket.socket(socket.AF_UNIX)
            again.bind(path)
            os.chmod(path, 0o777)
            again.listen(8)
            try:
                for session in ("main", "opened-after"):  # the shell from before, and a new one
                    after = await sb.bash(f"python3 probe.py {path}", session=session)
                    assert after.output.startswith("FAILED"), (session, after.output)
                with socket.socket(socket.AF_UNIX) as direct:  # the host reaches it: the probe would tell
                    direct.connect(path)
            finally:
                again.close()
            # The folder's other entries stay visible inside.
            assert (await sb.bash(f"cat {folder}/appendonly.aof")).output == "data\n"
    finally:
        await destroy_sandbox(handle)


class _VanishingOnFirstSpawn:
    """A spawner that removes a host folder right before bwrap's first start: the folder was
    there when the masks were checked, and is gone when bwrap mounts over it."""

    def __init__(self, spawner, folder: str, listener: socket.socket):
        self.spawner, self.folder, self.listener, self.starts = spawner, folder, listener, 0

    def __call__(self, function):
        self.starts += 1
        if self.starts == 1:
            self.listener.close()
            shutil.rmtree(self.folder)
        return self.spawner(function)


async def test_a_shell_starts_when_a_masked_folder_vanishes_before_bwrap_mounts_it(root_dir, service_folder):
    folder, listener = service_folder
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="sockvanish", root_dir=root_dir)
    try:
        with open(os.path.join(handle.dir, "plan.json")) as file:
            plan = json.load(file)
        assert folder in plan["bash_argv"], "the plan masks the service's folder"
        supervisor = Supervisor(plan)
        owner = os.stat(os.path.join(handle.dir, "data", "work")).st_uid
        if owner != os.geteuid():  # as the sandbox's own supervisor: bwrap under the sandbox's host uid
            supervisor.identity = HostIdentity(owner, -1, shutil.which("setpriv"))
        supervisor.spawner = racing = _VanishingOnFirstSpawn(supervisor.spawner, folder, listener)
        shell = await asyncio.to_thread(supervisor.session, "racing")
        try:
            assert racing.starts == 2  # bwrap failed on the vanished folder once; planned again
            assert shell.alive
        finally:
            shell.close()
    finally:
        await destroy_sandbox(handle)
