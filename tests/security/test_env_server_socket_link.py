"""Attacker: code inside the job's sandbox (an OpenEnv environment's own code, or what it runs
for the agent) replaces the environment server's socket in the sandbox's /tmp with a symlink to
a host socket (here: one the test listens on, standing in for Redis or the container engine), so
that the run worker's next request goes to the host service. The worker opens the folder and the
socket without following links and refuses what is not a socket, and once it holds the socket it
connects through that very inode, so a later swap changes nothing."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest

from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.tasks.sandbox_server import SOCKET_NAME, EnvironmentBroken, SandboxServer


def _listening(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    return server


def _server(tmp_path) -> tuple[SandboxServer, str]:
    layout = SandboxLayout(str(tmp_path / "sandbox"))
    os.makedirs(os.path.join(layout.tmp, "rs-env"))
    sandbox = SimpleNamespace(socket_path=layout.socket_path)  # only where its folders are is read
    return SandboxServer(sandbox, "rs-env", "environment 'x'"), os.path.join(layout.tmp, "rs-env")


def test_a_symlink_planted_for_the_servers_socket_is_refused(tmp_path):
    host_service = _listening(str(tmp_path / "host.sock"))
    server, folder = _server(tmp_path)
    os.symlink(tmp_path / "host.sock", os.path.join(folder, SOCKET_NAME))
    with pytest.raises(EnvironmentBroken, match="is not a socket"):
        server.socket_path()
    host_service.close()


def test_a_symlinked_server_folder_is_not_followed(tmp_path):
    host_service = _listening(str(tmp_path / SOCKET_NAME))
    server, folder = _server(tmp_path)
    os.rmdir(folder)
    os.symlink(tmp_path, folder)  # the folder itself now points at the host's
    with pytest.raises(EnvironmentBroken, match="is not a folder"):
        server.socket_path()
    host_service.close()


def test_a_socket_swapped_after_it_was_opened_does_not_redirect_the_worker(tmp_path):
    server, folder = _server(tmp_path)
    real = _listening(os.path.join(folder, SOCKET_NAME))
    path = server.socket_path()
    host_service = _listening(str(tmp_path / "host.sock"))
    os.unlink(os.path.join(folder, SOCKET_NAME))
    os.symlink(tmp_path / "host.sock", os.path.join(folder, SOCKET_NAME))
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    accepted, _ = real.accept()  # the server the worker opened takes the connection, not the host's
    host_service.setblocking(False)
    with pytest.raises(BlockingIOError):
        host_service.accept()
    for s in (client, accepted, real, host_service):
        s.close()
