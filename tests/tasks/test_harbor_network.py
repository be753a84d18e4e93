"""A Harbor task's ``[environment] allow_internet`` against the operator's grant (``task_internet``):
granted, the agent's and the verifier's sandboxes are podman containers on the engine's bridge
(a route out, a server on the bridge reached, the host's loopback services not); not granted, a
task that says it needs the network is refused before anything runs, one that only inherits
Harbor's default runs offline with a warning in its trajectory. Only our own servers are addressed,
on the podman bridge's host address: never the internet."""

from __future__ import annotations

import http.server
import secrets
import threading
from pathlib import Path

import pytest

from rollstream.messages import Envelope, Job
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor import HarborTask
from rollstream.tasks.harbor_folder import HarborTaskRefused
from rollstream.trajectory import Trajectory

from . import harbor_fixtures
from .conftest import needs_bwrap
from .harbor_fixtures import copy_task

pytestmark = needs_bwrap
needs_podman = pytest.mark.skipif(not DockerBackend().available(),
                                  reason="no container engine (podman's socket: scripts/install-podman)")
# The default route's gateway (the bridge's host address), from the kernel's table: no tool needed.
GATEWAY = ("python3 -c \"import socket,struct;r=[l.split() for l in open('/proc/net/route')][1:];"
           "d=[x for x in r if x[1]=='00000000'];print(d[0][0] if d else 'none',"
           "socket.inet_ntoa(struct.pack('<I',int(d[0][2],16))) if d else 'none')\"")
FETCH = "python3 -c \"import sys,urllib.request;print(urllib.request.urlopen(sys.argv[1],timeout=10).read().decode())\""


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)


def with_internet(source: Path, target: Path, allow: bool | None, test_sh: str | None = None) -> Path:
    folder = copy_task(source, target)
    toml = (folder / "task.toml").read_text()
    if allow is not None:
        toml = toml.replace("[environment]\n", f"[environment]\nallow_internet = {str(allow).lower()}\n")
    (folder / "task.toml").write_text(toml)
    if test_sh is not None:
        (folder / "tests" / "test.sh").write_text(test_sh)
    return folder


class _Token(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.server.token.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(address: str) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer((address, 0), _Token)
    server.token = secrets.token_hex(8)  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@needs_podman
async def test_granted_the_sandboxes_are_on_the_engines_bridge_and_reach_a_server_there_not_the_hosts_loopback(
        episode, harbor_environment, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_TASK_INTERNET", "true")
    folder = with_internet(harbor_environment / "hello-file", tmp_path / "online", True)
    # The node's backend is bwrap: a task given the network still runs in a container of its own.
    ep = await episode(HarborTask(), {"path": str(folder)}, backend="bwrap")
    assert ep.env.sandbox.backend == "docker"
    async with ep.client() as sb:
        interface, gateway = (await sb.bash(GATEWAY)).output.split()
        assert interface != "lo" and gateway != "none"
        bridge, loopback = serve(gateway), serve("127.0.0.1")
        try:
            url = f"http://{gateway}:{bridge.server_address[1]}/"
            fetched = await sb.bash(f"{FETCH} {url} | tee /app/hello.txt")
            assert fetched.output.strip() == bridge.token, fetched.output  # type: ignore[attr-defined]
            # The host's loopback services (Redis, the door, model servers) stay out of reach.
            reached = await sb.bash(f"{FETCH} http://{gateway}:{loopback.server_address[1]}/", timeout_s=60)
            assert reached.exit_code != 0 and loopback.token not in reached.output  # type: ignore[attr-defined]
            # The verifier's fresh sandbox has the network too: test.sh fetches the token again.
            (folder / "tests" / "test.sh").write_text(
                f"#!/bin/bash\nmkdir -p /logs/verifier\n[ \"$({FETCH} {url})\" = \"$(cat /app/hello.txt)\" ] "
                "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
            assert await ep.score() == 1.0, ep.env.trajectory.extra["eval"]
        finally:
            for server in (bridge, loopback):
                server.shutdown()
                server.server_close()


async def test_not_granted_a_task_that_says_it_needs_the_network_is_refused_before_it_runs(
        episode, harbor_environment, tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLSTREAM_TASK_INTERNET", raising=False)
    folder = with_internet(harbor_environment / "hello-file", tmp_path / "needs-net", True)
    with pytest.raises(HarborTaskRefused, match=r"allow_internet = true.*task_internet"):
        await episode(HarborTask(), {"path": str(folder)}, backend="bwrap")


async def test_not_granted_a_task_on_harbors_default_runs_offline_and_says_so(episode, harbor_environment,
                                                                             monkeypatch):
    monkeypatch.delenv("ROLLSTREAM_TASK_INTERNET", raising=False)

    class Scripted(HarborTask):
        async def agent_rollout(self, env, ctx):
            return Trajectory(num_turns=1)

    instance = {"path": str(harbor_environment / "hello-file")}  # task.toml leaves allow_internet out
    ep = await episode(Scripted(), instance, backend="bwrap")
    assert ep.env.sandbox.backend == "bwrap"
    async with ep.client() as sb:
        assert (await sb.bash(GATEWAY)).output.split() == ["none", "none"]
        interfaces = (await sb.bash("cat /proc/net/dev")).output
    assert [line.split(":")[0].strip() for line in interfaces.splitlines()[2:]] == ["lo"]
    trajectory = await Scripted().rollout(Envelope(job=Job(task="harbor", instance=instance)),
                                          TaskContext(node="n", work_dir=Path("/nonexistent")))
    assert any("ran offline" in w and "task_internet" in w for w in trajectory.extra["warnings"])


async def test_granted_a_task_that_says_false_stays_offline_and_a_job_cannot_move_a_networked_one_to_bwrap(
        harbor_environment, tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_TASK_INTERNET", "true")
    offline = with_internet(harbor_environment / "hello-file", tmp_path / "offline", False)
    spec = HarborTask().sandbox_spec({"path": str(offline)})
    assert spec.network is False and spec.backend == "auto"
    online = HarborTask().sandbox_spec({"path": str(harbor_environment / "hello-file")})
    assert online.network is True and online.backend == "docker"
    env = Envelope(job=Job(task="harbor", instance={"path": str(harbor_environment / "hello-file")},
                           sandbox={"backend": "bwrap"}))
    with pytest.raises(HarborTaskRefused, match="only backend 'docker'"):
        await HarborTask().prepare_environment(env, TaskContext(node="n", work_dir=tmp_path))

