"""A Harbor task whose environment has a compose file: the service ``main`` is the agent's
container, every other service a sidecar on a network of the sandbox's own (podman), reached by
its name, built from its own context and started fresh for eval's sandbox; a sidecar that exits or
does not build ends the job with its reason; nothing is left behind (containers, networks). The
task folders are written here: a tiny HTTP sidecar on Debian's python3 serving a value the agent
must copy into its workdir, which test.sh checks against the sidecar."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope, Job
from rollstream.sandbox_spec import SandboxSpec, SidecarSpec
from rollstream.sandboxes.backends.docker import DockerBackend, client_env, network_name, sidecar_name
from rollstream.sandboxes.errors import SandboxStartError
from rollstream.sandboxes.paths import sandbox_id_for
from rollstream.sandboxes.policy import OverridePolicy, SandboxOverrideRefused
from rollstream.sandboxes.reaper import teardown
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor import HarborTask

from . import harbor_fixtures
from .conftest import needs_bwrap

pytestmark = [needs_bwrap, pytest.mark.skipif(not DockerBackend().available(),
                                              reason="no container engine (podman's socket: scripts/install-podman)")]

SERVER = """import http.server, os
SECRET = "kv-" + os.environ["SEED"] * 2
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = SECRET.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""
FETCH = "python3 -c \"import urllib.request;print(urllib.request.urlopen('http://kv:8000/',timeout=10).read().decode())\""
TEST_SH = f"""#!/bin/bash
mkdir -p /logs/verifier
want=$(for i in 1 2 3 4 5 6 7 8 9 10; do {FETCH} 2>/dev/null && break; sleep 1; done)
[ -n "$want" ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$want" ] && echo 1 > /logs/verifier/reward.txt \\
  || echo 0 > /logs/verifier/reward.txt
"""


def write_task(root: Path, name: str, compose: str, sidecar_dockerfile: str | None = None) -> Path:
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "solution").mkdir()
    (folder / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60.0\n[environment]\n'
                                      'allow_internet = false\nmemory_mb = 512\n')
    (folder / "instruction.md").write_text("Write what the service kv answers on port 8000 to /app/answer.txt.\n")
    (folder / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\n")
    (folder / "environment" / "docker-compose.yaml").write_text(compose)
    if sidecar_dockerfile is not None:
        (folder / "environment" / "kv").mkdir()
        (folder / "environment" / "kv" / "Dockerfile").write_text(sidecar_dockerfile)
        (folder / "environment" / "kv" / "server.py").write_text(SERVER)
    (folder / "tests" / "test.sh").write_text(TEST_SH)
    (folder / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{FETCH} > /app/answer.txt\n")
    return folder


def leftovers(sandbox_id: str) -> list[str]:
    """The containers and networks of the sandbox the engine still has."""
    def listed(*argv: str) -> list[str]:
        out = subprocess.run(["docker", *argv], capture_output=True, text=True, env=client_env(), check=True).stdout
        return out.split()
    return (listed("ps", "--all", "--quiet", "--filter", f"label=rollstream.sandbox={sandbox_id}")
            + [n for n in listed("network", "ls", "--format", "{{.Name}}") if n == network_name(sandbox_id)])


def container_id(name: str) -> str:
    return subprocess.run(["docker", "inspect", "--format", "{{.Id}}", name], capture_output=True, text=True,
                          env=client_env()).stdout.strip()


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)


@pytest.fixture(scope="module")
def compose_tasks(harbor_environment, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compose")
    write_task(root, "kv-built", "services:\n  main:\n    environment:\n      ROLE: agent\n  kv:\n    build: ./kv\n"
               "    environment:\n      SEED: abc\n    depends_on: [main]\n",
               "FROM python:3.12-slim\nCOPY server.py /srv/server.py\nCMD [\"python3\", \"/srv/server.py\"]\n")
    write_task(root, "kv-exits", "services:\n  kv:\n    image: python:3.12-slim\n"
               "    command: sh -c 'echo the kv store lost its data; exit 3'\n")
    write_task(root, "kv-broken", "services:\n  kv:\n    build: ./kv\n", "FROM python:3.12-slim\nRUN exit 7\n")
    return root


@pytest.mark.parametrize("solve", [True, False])
async def test_the_agent_reaches_its_sidecar_by_name_and_the_verifier_a_fresh_one(episode, compose_tasks, solve):
    folder = compose_tasks / "kv-built"
    ep = await episode(HarborTask(), {"path": str(folder)}, backend="bwrap")  # the node's: compose moves it
    first = ep.env.sandbox.id
    assert ep.env.sandbox.backend == "docker"
    async with ep.client() as sb:
        if solve:
            result = await sb.bash(f"echo $ROLE; for i in 1 2 3 4 5 6 7 8 9 10; do {FETCH} > /app/answer.txt "
                                   "&& break; sleep 1; done; cat /app/answer.txt")
            assert result.output.split() == ["agent", "kv-abcabc"], result.output
        # The sandbox's network is internal: the sidecar, and nothing beyond.
        routes = await sb.bash("grep -c '^[a-z0-9]*\t00000000' /proc/net/route")
        assert routes.output.strip() == "0", routes.output
    agents_sidecar = container_id(sidecar_name(first, "kv"))
    assert await ep.score() == (1.0 if solve else 0.0), ep.env.trajectory.extra["eval"]
    assert container_id(sidecar_name(ep.env.sandbox.id, "kv")) not in ("", agents_sidecar)  # eval's own
    await ep.teardown()
    assert leftovers(first) == []


async def test_a_killed_supervisors_sidecars_and_network_are_reaped(episode, compose_tasks):
    ep = await episode(HarborTask(), {"path": str(compose_tasks / "kv-built")}, backend="docker")
    sandbox = ep.env.sandbox
    assert len(leftovers(sandbox.id)) == 3  # main, kv, the network
    os.kill(sandbox.supervisor_pid, signal.SIGKILL)  # as a worker's node losing it would
    await asyncio.to_thread(teardown, sandbox.dir)
    assert leftovers(sandbox.id) == []


async def test_a_sidecar_that_exits_or_does_not_build_ends_the_job_with_its_reason_leaving_nothing(
        episode, compose_tasks):
    job = Job(task="harbor", instance={"path": str(compose_tasks / "kv-exits")})
    # Infrastructure: the sandbox did not start (the stage retries it, as any start that failed).
    with pytest.raises(SandboxStartError, match=r"service kv exited \(exit code 3\); its last output: the kv store"):
        await episode(HarborTask(), job.instance, backend="docker", job=job)
    assert leftovers(sandbox_id_for(job.job_id, 0)) == []
    with pytest.raises(JobFailed, match=r"(?s)did not build: service kv: .*exit 7") as broken:
        await episode(HarborTask(), {"path": str(compose_tasks / "kv-broken")}, backend="docker")
    assert broken.value.failure == "task"


async def test_compose_keys_that_reach_the_host_and_a_bwrap_backend_are_refused(compose_tasks, tmp_path):
    folder = write_task(tmp_path, "kv-host", "services:\n  kv:\n    image: python:3.12-slim\n"
                        "    volumes: ['/:/host']\n    privileged: true\n")
    with pytest.raises(InvalidJob, match=r"services.kv sets \['privileged', 'volumes'\]"):
        HarborTask().validate({"path": str(folder)})
    # A sidecar's image passes the operator's image list as the sandbox's does; services are never a job's.
    unlisted = SandboxSpec(backend="docker", image="localhost/rollstream/harbor:x",
                           services=[SidecarSpec(name="db", image="docker.io/library/postgres:15")])
    with pytest.raises(SandboxOverrideRefused, match="services.db.image='docker.io/library/postgres:15' is not among"):
        OverridePolicy().apply(unlisted, None)
    with pytest.raises(SandboxOverrideRefused, match="services cannot come from a job"):
        OverridePolicy(allowed=("limits", "services")).apply(unlisted.model_copy(update={"services": []}),
                                                             {"services": [{"name": "db", "image": "x"}]})
    env = Envelope(job=Job(task="harbor", instance={"path": str(compose_tasks / "kv-built")},
                           sandbox={"backend": "bwrap"}))
    with pytest.raises(InvalidJob, match="compose file's services.*only backend 'docker'"):
        await HarborTask().prepare_environment(env, TaskContext(node="n", work_dir=tmp_path))
