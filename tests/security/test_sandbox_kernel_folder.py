"""Issue 32, finding 1: the kernel's folder is the sandbox's `/run/rollstream`, writable by the
agent, and the root supervisor wrote `kernel.json` there by path: a symlink planted in its place
made root create or truncate any host file at each kernel (re)start. The supervisor now creates
the file afresh through a descriptor of the folder (never following an entry), and connects to
the kernel's sockets through descriptors of the very socket inodes, so a symlink swapped in for
one never points a reconnect at a host socket."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading

import pytest
from sandboxes.conftest import needs_bwrap, root_dir, sandbox, sb  # noqa: F401  (fixtures)

from rollstream.sandboxes.errors import ToolError

pytestmark = needs_bwrap


@pytest.fixture
def host_folder():
    """A host folder outside every sandbox root, where the attacker aims its symlinks."""
    folder = tempfile.mkdtemp(prefix="rs-victim-", dir="/var/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def _cell(sb, code: str):
    """The cell's result, or the error the tool call raised (the kernel could not start)."""
    try:
        return await sb.ipython(code)
    except ToolError as error:
        return error


async def test_agent_symlinked_kernel_json_never_writes_a_host_file(sb, host_folder):
    created = os.path.join(host_folder, "PWNED")
    existing = os.path.join(host_folder, "passwd")
    with open(existing, "w") as handle:
        handle.write("root:x:0:0::/root:/bin/bash\n")
    # The first cell starts the kernel: its connection file was to follow the planted symlink.
    planted = await sb.bash(f"ln -sf {created} /run/rollstream/kernel.json")
    assert planted.exit_code == 0, planted.output
    first = await _cell(sb, "1 + 1")
    assert not os.path.lexists(created), "root created the host file the agent's symlink named"
    assert first.result == "2", first
    # Each restart wrote it again: now aimed at a file that exists, the kernel killed first.
    died = await sb.ipython("import os; os._exit(1)")
    assert "died" in died.note, died
    planted = await sb.bash(f"ln -sf {existing} /run/rollstream/kernel.json")
    assert planted.exit_code == 0, planted.output
    restarted = await _cell(sb, "'x' in globals()")
    with open(existing) as handle:
        assert handle.read() == "root:x:0:0::/root:/bin/bash\n", "root overwrote the host file the symlink named"
    assert restarted.result == "False" and "restarted" in restarted.note, restarted
    assert not os.path.lexists(created)


async def test_agent_symlinked_kernel_socket_never_connects_root_to_a_host_socket(sb, host_folder):
    """zmq reconnects to a socket path on its own once the kernel is gone: with the path swapped
    for a symlink to a host socket (a Redis, the container engine), root connected there."""
    path = os.path.join(host_folder, "service.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    watcher = threading.Thread(target=accept, daemon=True)
    watcher.start()
    try:
        assert (await sb.ipython("1")).result == "1"
        swapped = await sb.bash(
            "cd /run/rollstream && for n in 1 2 3 4 5; do rm -f k-$n && ln -s " + path + " k-$n; done && ls -l"
        )
        assert swapped.exit_code == 0, swapped.output
        died = await sb.ipython("import os; os._exit(1)")
        assert "died" in died.note, died
        await asyncio.sleep(1.5)  # zmq retries a dropped connection every 0.1 s: ample time to follow the symlink
        assert accepted == [], "the supervisor connected to the host socket the agent's symlink named"
        fresh = await sb.ipython("2 + 2")
        assert fresh.result == "4" and "restarted" in fresh.note, fresh
        assert accepted == []
    finally:
        stop.set()
        watcher.join()
        listener.close()
        for connection in accepted:
            connection.close()
