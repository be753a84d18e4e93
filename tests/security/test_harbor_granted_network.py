"""A Harbor task the operator granted the network (task_internet, for task.toml's allow_internet),
from the attacker's side: the agent in that sandbox goes after what listens on the host's loopback
(Redis, the door's TCP port, a model server: here a TCP server of the test's on 127.0.0.1) at every
address of the host it could name, the bridge's gateway included, and after the container engine's
socket. None of it answers: the sandbox is a podman container on the engine's bridge, in a network
namespace of its own, never bubblewrap's --share-net (the host's namespace). Only our own servers
are addressed, never the internet."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from pathlib import Path

import psutil
import pytest

from rollstream.messages import Envelope, Job
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.backends.docker import PODMAN_SOCKET, DockerBackend
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor import HarborTask
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

pytestmark = [pytest.mark.skipif(not BwrapBackend().available(), reason="bubblewrap (bwrap) is not usable here"),
              pytest.mark.skipif(not DockerBackend().available(),
                                 reason="no container engine (podman's socket: scripts/install-podman)")]

# Run inside the sandbox: try each address at the port; print what each gave.
PROBE = r'''
import json, os, socket, sys
port, out = int(sys.argv[1]), {}
gateway = [l.split() for l in open("/proc/net/route")][1:]
out["gateway"] = [socket.inet_ntoa(int(r[2], 16).to_bytes(4, "little")) for r in gateway if r[1] == "00000000"]
for host in sys.argv[2:] + out["gateway"]:
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port)); out[host] = "CONNECTED " + s.recv(64).decode(errors="replace")
    except OSError as e:
        out[host] = e.strerror or type(e).__name__
out["engine socket"] = os.path.exists("/run/podman/podman.sock")
print(json.dumps(out))
'''


HELLO = Path(__file__).resolve().parent.parent / "tasks" / "harbor_tasks" / "hello-file"


async def test_a_granted_sandbox_reaches_none_of_the_hosts_loopback_services(sandbox_root,
                                                                           tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_TASK_INTERNET", "true")
    monkeypatch.setenv("ROLLSTREAM_HARBOR_TASK_ROOTS", json.dumps([str(tmp_path)]))
    folder = Path(shutil.copytree(HELLO, tmp_path / "granted"))
    secret = b"loopback-only-service\n"

    async def answer(reader, writer):
        writer.write(secret)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    host_addresses = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                             if a.family == socket.AF_INET})
    env = Envelope(job=Job(task="harbor", instance={"path": str(folder)}))
    sandboxes = NodeSandboxes(root=str(sandbox_root), backend="bwrap")  # the node's: the grant moves it
    try:
        await set_up(HarborTask(), env, TaskContext(node="n", work_dir=tmp_path / "work"), sandboxes)
        assert env.sandbox is not None and env.sandbox.backend == "docker"
        async with SandboxClient(env.sandbox.socket_path) as sb:
            await sb.write_file("/tmp/probe.py", PROBE.encode())
            result = await sb.bash(f"python3 /tmp/probe.py {port} {' '.join(host_addresses)}", timeout_s=120)
        tried = json.loads(result.output.strip().splitlines()[-1])
    finally:
        server.close()
        await sandboxes.destroy(env)
    # The sandbox is networked (a default route: the bridge), and tried every host address and the gateway.
    assert tried["gateway"] and set(host_addresses + tried["gateway"]) <= set(tried), tried
    assert not [host for host, what in tried.items() if str(what).startswith("CONNECTED")], tried
    assert tried["engine socket"] is False, PODMAN_SOCKET
