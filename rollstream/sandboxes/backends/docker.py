"""The Docker backend: one long-lived container per sandbox, tools through `docker exec`.

The supervisor starts the container (`docker run -d ... sleep infinity`) and removes it
on shutdown; containers carry a rollstream.sandbox label so a reaper finds leftovers.
"""

from __future__ import annotations

import functools
import os
import subprocess

from ..spec import SandboxSpec
from .base import (
    BASH_ARGS,
    KERNEL_ARGS,
    KERNEL_DIR_INNER,
    LaunchPlan,
    SandboxLayout,
    STANDARD_PATH,
    base_plan,
    sandbox_env,
    ulimit_wrapped,
    which,
)

LABEL = "rollstream.sandbox"
# The docker CLI needs its own configuration from the host environment, and nothing else.
_CLIENT_ENV = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY")


def container_name(sandbox_id: str) -> str:
    return f"rs-{sandbox_id}"


@functools.lru_cache(maxsize=1)
def _engine_answers() -> bool:
    binary = which("docker")
    if binary is None:
        return False
    try:
        return subprocess.run([binary, "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class DockerBackend:
    name = "docker"

    def available(self) -> bool:
        return _engine_answers()

    def run_argv(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str, env: dict) -> list[str]:
        if not spec.image:
            raise ValueError("backend='docker' needs an image, e.g. image='python:3.11-slim'")
        limits = spec.limits
        argv = [
            which("docker") or "docker", "run", "--detach",
            "--name", container_name(sandbox_id),
            "--label", f"{LABEL}={sandbox_id}",
            "--label", f"rollstream.owner={owner}",
            "--hostname", "sandbox",
            "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges",
            "--ulimit", f"nofile={limits.max_open_files}:{limits.max_open_files}",
            "--volume", f"{layout.work}:{spec.workdir}",
            "--volume", f"{layout.tmp}:/tmp",
            "--volume", f"{layout.kernel}:{KERNEL_DIR_INNER}",
            "--workdir", spec.workdir,
        ]
        if not spec.network:
            argv += ["--network", "none"]
        if limits.memory_mb:
            argv += ["--memory", f"{limits.memory_mb}m"]
        if limits.max_processes:
            argv += ["--pids-limit", str(limits.max_processes)]
        if limits.cpus:
            argv += ["--cpus", str(limits.cpus)]
        if limits.cpu_time_s:
            argv += ["--ulimit", f"cpu={limits.cpu_time_s}:{limits.cpu_time_s}"]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        return argv + ["--entrypoint", "sleep", spec.image, "infinity"]

    def exec_prefix(self, spec: SandboxSpec, sandbox_id: str, env: dict, tty: bool) -> list[str]:
        argv = [which("docker") or "docker", "exec", "--interactive"]
        if tty:
            argv.append("--tty")
        argv += ["--workdir", spec.workdir]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        return argv + [container_name(sandbox_id)]

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        env = sandbox_env(spec, STANDARD_PATH)
        host_env = {key: os.environ[key] for key in _CLIENT_ENV if key in os.environ}
        name = container_name(sandbox_id)
        docker = which("docker") or "docker"
        return LaunchPlan(
            **base_plan(spec, layout, sandbox_id, owner, self.name),
            workdir_inner=spec.workdir,
            mounts=[(spec.workdir, layout.work), ("/tmp", layout.tmp)],
            bash_argv=self.exec_prefix(spec, sandbox_id, env, tty=True) + ulimit_wrapped(BASH_ARGS, spec.limits),
            exec_prefix=self.exec_prefix(spec, sandbox_id, env, tty=False),
            kernel_argv=ulimit_wrapped(
                [spec.python or "python3", *KERNEL_ARGS], spec.limits
            ),
            kernel_dir_inner=KERNEL_DIR_INNER,
            spawn_env=host_env,
            spawn_cwd=layout.dir,
            host_env=host_env,
            rlimits={},  # limits apply inside the container; host rlimits would only bind the CLI
            confine_processes=False,  # dockerd holds the processes: --pids-limit, --memory, --cpus
            start_argv=self.run_argv(spec, layout, sandbox_id, owner, env),
            stop_argv=[docker, "rm", "--force", name],
            cleanup_argv=[docker, "rm", "--force", name],
        )
