"""A Harbor task whose environment has a compose file: the service ``main`` is the agent's
container, every other service a sidecar on a network of the sandbox's own (podman), every one
reaching every other by name (main's included), built from its own context and started fresh for
eval's sandbox, in depends_on's order (main once a service it needs is healthy); a sidecar that
exits, stays unhealthy or does not build ends the job with its reason; nothing is left behind
(containers, networks). The task folders are written here: tiny HTTP services on Debian's python3
(one serving a value the agent must copy into its workdir, which test.sh checks against it; one
slow to start; a proxy that calls back to a server the agent runs in main)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope, Job
from rollstream.sandbox_spec import HealthCheck, SandboxSpec, SidecarSpec
from rollstream.sandboxes.backends.docker import DockerBackend, client_env, container_name, network_name, sidecar_name
from rollstream.sandboxes.errors import SandboxServiceFailed, SandboxStartError
from rollstream.sandboxes.lifecycle import create_sandbox
from rollstream.sandboxes.paths import sandbox_id_for
from rollstream.sandboxes.policy import OverridePolicy, SandboxOverrideRefused
from rollstream.sandboxes.reaper import teardown
from rollstream.tasks import harbor_compose
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


PROXY = """import http.server, urllib.request
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = urllib.request.urlopen("http://main:8000/", timeout=5).read()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8001), H).serve_forever()
"""
PROBE = "import urllib.request; urllib.request.urlopen('http://localhost:8000/', timeout=2)"
SLIM = "python:3.12-slim"


def compose(services: dict) -> str:
    return yaml.safe_dump({"services": services})


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
    # kv listens 2 s after it starts, and says so only then; main waits for it.
    write_task(root, "kv-slow", compose({
        "main": {"depends_on": {"kv": {"condition": "service_healthy"}}},
        "kv": {"image": SLIM, "command": ["python3", "-c", "import time; time.sleep(2)\n" + SERVER],
               "environment": {"SEED": "xyz"},
               "healthcheck": {"test": ["CMD", "python3", "-c", PROBE], "interval": "300ms", "retries": 60}}}))
    # proxy starts after main and answers with what main serves on port 8000, asked by main's name.
    write_task(root, "main-proxied", compose({"proxy": {"image": SLIM, "command": ["python3", "-c", PROXY],
                                                        "depends_on": ["main"]}}))
    write_task(root, "kv-never-healthy", compose({
        "main": {"depends_on": {"kv": {"condition": "service_healthy"}}},
        "kv": {"image": SLIM, "command": "sleep 600", "healthcheck": {
            "test": ["CMD-SHELL", "echo the store is still loading; exit 1"], "interval": "200ms", "retries": 3}}}))
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
    # The task's: its own service stopped (another attempt would see it stop again).
    with pytest.raises(JobFailed, match=r"service kv exited \(exit code 3\); its last output: the kv store") as exited:
        await episode(HarborTask(), job.instance, backend="docker", job=job)
    assert (exited.value.failure, exited.value.retryable) == ("task", False)
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
    with pytest.raises(SandboxOverrideRefused, match="depends_on cannot come from a job"):
        OverridePolicy(allowed=("limits", "depends_on")).apply(unlisted, {"depends_on": {"db": "service_started"}})
    # Waits that cannot be met are refused at submit, not found out at init.
    for services, refusal in [
        ({"kv": {"image": SLIM, "depends_on": ["db"]}, "db": {"image": SLIM, "depends_on": ["kv"]}},
         r"depends_on make a circle among \['db', 'kv'\]"),
        ({"main": {"depends_on": {"kv": {"condition": "service_healthy"}}}, "kv": {"image": SLIM}},
         "main waits for kv to be healthy, but kv has no healthcheck"),
        ({"kv": {"image": SLIM, "depends_on": {"main": {"condition": "service_healthy"}}}},
         "only service_started can be waited for"),
        ({"kv": {"image": SLIM, "depends_on": ["db"]}}, "kv depends on 'db', which is not another service"),
        ({"kv": {"image": SLIM, "healthcheck": {"test": "true", "interval": 5}}}, "is 5, not a duration"),
        ({"kv": {"image": SLIM, "depends_on": {"main": {"condition": "service_ready"}}}}, "waits for 'service_ready'"),
    ]:
        with pytest.raises(InvalidJob, match=refusal):
            HarborTask().validate({"path": str(write_task(tmp_path, f"t{len(list(tmp_path.iterdir()))}",
                                                          compose(services)))})
    env = Envelope(job=Job(task="harbor", instance={"path": str(compose_tasks / "kv-built")},
                           sandbox={"backend": "bwrap"}))
    with pytest.raises(InvalidJob, match="compose file's services.*only backend 'docker'"):
        await HarborTask().prepare_environment(env, TaskContext(node="n", work_dir=tmp_path))


def test_healthchecks_and_depends_on_read_as_compose_writes_them():
    found = harbor_compose.parse(compose({
        "main": {"depends_on": {"db": {"condition": "service_healthy", "restart": True}, "init": {
            "condition": "service_completed_successfully"}}},
        "db": {"image": SLIM, "depends_on": ["init"], "healthcheck": {
            "test": "pg_isready -U app", "interval": "1m30s", "timeout": "500ms", "start_period": "2s", "retries": 5}},
        "init": {"image": SLIM, "healthcheck": {"test": ["NONE"]}},
        "web": {"image": SLIM, "healthcheck": {"test": ["CMD", "curl", "-f", "http://localhost/"], "disable": True}}}),
        "compose.yaml")
    assert found.main_depends_on == {"db": "service_healthy", "init": "service_completed_successfully"}
    db, init, web = found.sidecars
    assert db.depends_on == {"init": "service_started"} and init.healthcheck is None and web.healthcheck is None
    assert db.healthcheck == HealthCheck(test=["/bin/sh", "-c", "pg_isready -U app"], interval_s=90, timeout_s=0.5,
                                         start_period_s=2, retries=5)


async def test_main_starts_once_the_service_it_depends_on_is_healthy(episode, compose_tasks):
    ep = await episode(HarborTask(), {"path": str(compose_tasks / "kv-slow")}, backend="docker")
    async with ep.client() as sb:
        first = await sb.bash(FETCH)  # one try, no retry: kv answers already
    assert first.exit_code == 0 and first.output.strip() == "kv-xyzxyz", first.output
    started = {name: started_at(container) for name, container in
               (("kv", sidecar_name(ep.env.sandbox.id, "kv")), ("main", container_name(ep.env.sandbox.id)))}
    assert started["main"] - started["kv"] >= 2.0, started  # kv's 2 s of loading came first


async def test_a_sidecar_reaches_main_by_its_service_name(episode, compose_tasks):
    ep = await episode(HarborTask(), {"path": str(compose_tasks / "main-proxied")}, backend="docker")
    fetch_proxy = FETCH.replace("kv:8000", "proxy:8001")
    async with ep.client() as sb:
        names = await sb.bash("getent hosts main proxy | wc -l; mkdir -p /tmp/www && echo served-by-main > "
                              "/tmp/www/index.html && cd /tmp/www && (setsid python3 -m http.server 8000 "
                              ">/dev/null 2>&1 &)")
        assert names.output.split() == ["2"], names.output
        answer = await sb.bash(f"for i in $(seq 40); do {fetch_proxy} 2>/dev/null && break; sleep 0.25; done")
    assert answer.output.strip() == "served-by-main", answer.output  # main's server, through the sidecar


async def test_a_never_healthy_sidecar_fails_the_job_as_the_tasks_and_main_never_starts(episode, compose_tasks):
    since = int(time.time()) - 1
    job = Job(task="harbor", instance={"path": str(compose_tasks / "kv-never-healthy")})
    with pytest.raises(JobFailed, match=r"service kv is unhealthy: its healthcheck failed 3 times in a row; its "
                                        r"last output: the store is still loading") as unhealthy:
        await episode(HarborTask(), job.instance, backend="docker", job=job)
    assert (unhealthy.value.failure, unhealthy.value.retryable) == ("task", False)
    sandbox_id = sandbox_id_for(job.job_id, 0)
    assert leftovers(sandbox_id) == [] and engine_events(container_name(sandbox_id), since) == []


async def test_a_service_still_starting_when_the_setup_time_ends_fails_the_start_as_the_nodes(sandbox_root):
    # The node's: its healthcheck's own budget was not spent (a loaded node may be slow); retried.
    slow = HealthCheck(test=["false"], interval_s=0.2, start_period_s=600)
    spec = SandboxSpec(backend="docker", image="localhost/rollstream/python:bookworm", setup_timeout_s=2,
                       depends_on={"db": "service_healthy"},
                       services=[SidecarSpec(name="db", image="localhost/rollstream/python:bookworm",
                                             command=["sleep", "600"], healthcheck=slow)])
    with pytest.raises(SandboxStartError, match=r"service db did not become healthy within the sandbox's setup "
                                                r"timeout \(2 s\)") as late:
        await create_sandbox(spec, sandbox_id="h-late-0", root_dir=sandbox_root)
    assert not isinstance(late.value, SandboxServiceFailed) and leftovers("h-late-0") == []


def started_at(container: str) -> float:
    """When the engine started the container (seconds since the epoch; engines write UTC, to the ns)."""
    text = subprocess.run(["docker", "inspect", "--format", "{{.State.StartedAt}}", container], capture_output=True,
                          text=True, env=client_env(), check=True).stdout.strip()
    stamp, _, fraction = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp() + float(f"0.{fraction or 0}")


def engine_events(container: str, since: int) -> list[str]:
    """What the container engine did with a container of that name since then."""
    out = subprocess.run(["docker", "events", "--since", str(since), "--until", str(int(time.time()) + 1),
                          "--filter", f"container={container}", "--format", "{{.Status}}"],
                         capture_output=True, text=True, env=client_env(), timeout=60, check=True).stdout
    return out.split()
