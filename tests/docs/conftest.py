"""A live deployment for the docs tests, started from the README's own command lines: a
fresh home folder (so every default path is the one a new user gets), a working folder with
the checkout's examples/ and scripts/ beside it, and — as root — a network namespace of its
own, so the README's fixed ports (8000, 8321) cannot meet another test's servers."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .blocks import ROOT, all_blocks, commands, service_kind, strip_comment

VENV_BIN = Path(sys.executable).parent


@dataclass
class Deployment:
    home: Path
    work: Path
    env: dict[str, str]
    netns: list[str]  # prefix that runs a command in the deployment's network namespace
    services: dict[str, str] = field(default_factory=dict)  # kind -> the README line started
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 150.0,
            input_text: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*self.netns, *argv], cwd=self.work, env=env or self.env, text=True, errors="replace",
                              capture_output=True, timeout=timeout_s, input=input_text)

    def start(self, kind: str, line: str) -> None:
        command = strip_comment(line).rstrip("& ").strip()
        log = open(self.home / f"{kind}.log", "wb")  # noqa: SIM115 - the process writes it for its whole life
        self.procs.append(subprocess.Popen([*self.netns, "bash", "-c", f"exec {command}"], cwd=self.work,
                                           env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True))
        log.close()
        self.services[kind] = line

    def wait_for(self, what: str, shell_check: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.run(["bash", "-c", shell_check], timeout_s=30).returncode == 0:
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                                     for p in self.home.glob("*.log"))
                    raise AssertionError(f"a README service exited while waiting for {what}:\n{logs}")
            time.sleep(0.5)
        raise AssertionError(f"{what} not ready in {timeout_s} s")

    def stop(self) -> None:
        # up stops its workers and its Redis on SIGINT (Ctrl-C), as a user stops it.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT if proc is self.procs[0] else signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def service_lines() -> dict[str, str]:
    """For each kind of service, the README line to start it with: the one with most words
    (`rollstream up --model-dir ./arith-model` serves the quick start's echo jobs too)."""
    found: dict[str, str] = {}
    for block in all_blocks():
        if block.lang not in ("bash", "sh"):
            continue
        for command in commands(block.text):
            kind = service_kind(command)
            if kind and len(shlex.split(strip_comment(command).rstrip("& "))) > \
                    len(shlex.split(strip_comment(found.get(kind, "x")).rstrip("& "))):
                found[kind] = command
    return found


def _network_namespace() -> tuple[list[str], subprocess.Popen | None]:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        return [], None  # the host's network: the README's ports must be free
    holder = subprocess.Popen(["unshare", "--net", "--fork", "--kill-child", "sh", "-c",
                               "ip link set lo up && echo up && exec sleep infinity"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert holder.stdout.readline().strip() == "up", "could not bring up loopback in a network namespace"
    return ["nsenter", f"--net=/proc/{holder.pid}/ns/net"], holder


@pytest.fixture(scope="session")
def deployment(arith_model_dir):
    base = Path(tempfile.mkdtemp(prefix="rsd-", dir="/tmp"))  # short: sandbox sockets live below
    base.chmod(0o755)  # sandboxes run under an unprivileged uid that must reach their folder
    home, work = base / "home", base / "work"
    home.mkdir()
    work.mkdir()
    for name in ("examples", "scripts", "slurm", "docker", "bench"):
        (work / name).symlink_to(ROOT / name)
    # The README builds these with 'rollstream arith-model DIR', which reuses a built folder:
    # the suite's cached model stands in, so the command runs and finds it built.
    (work / "models").mkdir()
    for link in (work / "arith-model", work / "models" / "arith"):
        shutil.copytree(arith_model_dir, link, symlinks=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ROLLSTREAM_") and k not in ("REDIS_URL", "XDG_DATA_HOME", "VIRTUAL_ENV")}
    env.update(HOME=str(home), PATH=f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
               ROLLSTREAM_SANDBOX_ROOT=str(base / "sb"), PYTHONDONTWRITEBYTECODE="1")
    netns, holder = _network_namespace()
    dep = Deployment(home=home, work=work, env=env, netns=netns)
    lines = service_lines()
    sock = home / ".local/share/rollstream/redis/redis.sock"
    try:
        dep.start("up", lines["up"])
        dep.wait_for("the embedded Redis of rollstream up", f"redis-cli -s {sock} PING")
        # The model server and the API need only Redis: they start while the pools do.
        for kind in ("serve-model", "api"):
            if kind in lines:
                dep.start(kind, lines[kind])
        dep.wait_for("the three worker pools", f"test $(redis-cli -s {sock} ZCARD rs:workers) -ge 3")
        if "serve-model" in lines:  # it registers once it serves
            dep.wait_for("the model server", f"test $(redis-cli -s {sock} ZCARD rs:backends) -ge 1")
            # What it tells the user: where it serves, and that it joined the balancer.
            log = home / "serve-model.log"
            dep.wait_for("serve-model's 'registered' line", f"grep -q 'registered http://127.0.0.1:8000' {log}", 30)
            assert "on http://127.0.0.1:8000" in log.read_text()
        if "api" in lines:
            dep.wait_for("the API", "curl -sf http://127.0.0.1:8321/health")
        yield dep
    finally:
        dep.stop()
        if holder is not None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        shutil.rmtree(base, ignore_errors=True)
