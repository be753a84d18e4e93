"""The Docker backend: one long-lived container per sandbox, tools through `docker exec`.

The supervisor starts the container (`docker run -d ... sleep infinity`) and removes it
on shutdown; containers carry a rollstream.sandbox label so a reaper finds leftovers.
Every capability is dropped but those the task declares for its root (`SandboxSpec.capabilities`,
Harbor's root tasks) and the operator allows (`ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES`);
`no-new-privileges` always. The network is none, or with `spec.network` the engine's bridge,
never the host's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import subprocess

from rollstream.sandbox_spec import ROOT_TASK_CAPABILITIES, SandboxSpec

from ..image_cache import resolve_image
from ..runtime.env_settings import env_name, env_setting
from .base import LaunchPlan, SandboxLayout
from .common import (
    BASH_ARGS,
    DOOR_DIR_INNER,
    KERNEL_ARGS,
    KERNEL_DIR_INNER,
    STANDARD_PATH,
    base_plan,
    sandbox_env,
    ulimit_wrapped,
    which,
)
from .docker_services import MAIN, services_script

log = logging.getLogger(__name__)

LABEL = "rollstream.sandbox"
# The docker CLI needs its own configuration from the host environment, and nothing else.
_CLIENT_ENV = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH",
               "DOCKER_TLS_VERIFY")


PODMAN_SOCKET = "/run/podman/podman.sock"


def client_env() -> dict[str, str]:
    """The docker CLI's environment: the host's docker settings, and where no Docker
    daemon socket exists but podman serves the Docker API (scripts/install-podman), that."""
    env = {key: os.environ[key] for key in _CLIENT_ENV if key in os.environ}
    if "DOCKER_HOST" not in env and not os.path.exists("/var/run/docker.sock") and os.path.exists(PODMAN_SOCKET):
        env["DOCKER_HOST"] = f"unix://{PODMAN_SOCKET}"
    return env


def _rlimit_flags(max_open_files: int) -> list[str]:
    """--ulimit for nofile and nproc, within what the engine may grant.

    Naming any --ulimit makes podman fill the others from its own defaults (nofile
    1048576), which a root without CAP_SYS_RESOURCE cannot set: both are always given,
    clamped to this host's hard limits. nproc counts every process of the uid on the
    host, so it is not the sandbox's process limit (that is --pids-limit).
    """
    nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc_hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = max_open_files if nofile_hard == resource.RLIM_INFINITY else min(max_open_files, nofile_hard)
    # podman lowers its own nproc to 32768 at start; no container may exceed that.
    nproc = 32768 if nproc_hard == resource.RLIM_INFINITY else min(nproc_hard, 32768)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def allowed_capabilities() -> tuple[str, ...]:
    """The capabilities the operator lets a container's root keep (where its task asks):
    ``ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES``, a JSON list within ROOT_TASK_CAPABILITIES."""
    text = env_setting("SANDBOX_CONTAINER_CAPABILITIES")
    if text is None:
        return ROOT_TASK_CAPABILITIES
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{env_name('SANDBOX_CONTAINER_CAPABILITIES')}={text!r} is not a JSON list of capability "
                         f"names such as [\"CHOWN\", \"FOWNER\"]")
    unknown = sorted(set(names) - set(ROOT_TASK_CAPABILITIES))
    if unknown:
        raise ValueError(f"{env_name('SANDBOX_CONTAINER_CAPABILITIES')} names {unknown}: a sandbox's root keeps at "
                         f"most {list(ROOT_TASK_CAPABILITIES)} (SECURITY.md, root inside a container)")
    return tuple(n for n in ROOT_TASK_CAPABILITIES if n in names)


def capability_flags(spec: SandboxSpec) -> list[str]:
    """--cap-drop ALL, then --cap-add for each capability the task asks for and the operator allows."""
    allowed = allowed_capabilities()
    kept = [name for name in ROOT_TASK_CAPABILITIES if name in spec.capabilities and name in allowed]
    withheld = sorted(set(spec.capabilities) - set(kept))
    if withheld:
        log.info("container sandbox: capabilities %s withheld by %s", withheld,
                 env_name("SANDBOX_CONTAINER_CAPABILITIES"))
    return ["--cap-drop", "ALL", *(flag for name in kept for flag in ("--cap-add", name))]


def container_name(sandbox_id: str) -> str:
    return f"rs-{sandbox_id}"


def sidecar_name(sandbox_id: str, service: str) -> str:
    return f"rs-{sandbox_id}-s-{service}"


def network_name(sandbox_id: str) -> str:
    """The network of a sandbox with sidecars: its own, named after it, removed with it."""
    return f"rs-net-{sandbox_id}"


def policy_flags(spec: SandboxSpec, sandbox_id: str, owner: str) -> list[str]:
    """What every container of a sandbox gets, the main one and its sidecars: its labels (how a
    reaper finds it), the capability set, no-new-privileges, rlimits and the cgroup limits."""
    limits = spec.limits
    argv = ["--label", f"{LABEL}={sandbox_id}", "--label", f"rollstream.owner={owner}", *capability_flags(spec),
            "--security-opt", "no-new-privileges", *_rlimit_flags(limits.max_open_files)]
    if limits.memory_mb:
        argv += ["--memory", f"{limits.memory_mb}m"]
    if limits.max_processes:
        argv += ["--pids-limit", str(limits.max_processes)]
    if limits.cpus:
        argv += ["--cpus", str(limits.cpus)]
    if limits.cpu_time_s:
        argv += ["--ulimit", f"cpu={limits.cpu_time_s}:{limits.cpu_time_s}"]
    return argv


@functools.lru_cache(maxsize=1)
def _engine_answers() -> bool:
    binary = which("docker")
    if binary is None:
        return False
    try:
        return subprocess.run([binary, "info"], capture_output=True, env=client_env(), timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class DockerBackend:
    name = "docker"

    def available(self) -> bool:
        return _engine_answers()

    def run_argv(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str, env: dict) -> list[str]:
        if not spec.image:
            raise ValueError("backend='docker' needs an image, e.g. image='python:3.11-slim'")
        if spec.image.startswith("-"):
            raise ValueError(
                f"backend='docker' image {spec.image!r} starts with '-': an option, not an image reference"
            )
        argv = [
            which("docker") or "docker", "run", "--detach",
            "--name", container_name(sandbox_id),
            "--hostname", "sandbox",
            *policy_flags(spec, sandbox_id, owner),
            "--volume", f"{layout.work}:{spec.workdir}",
            "--volume", f"{layout.tmp}:/tmp",
            "--volume", f"{layout.kernel}:{KERNEL_DIR_INNER}",
            "--volume", f"{layout.door}:{DOOR_DIR_INNER}:ro",
            "--workdir", spec.workdir,
        ]
        # With the network: the engine's bridge, named, so an engine whose default is the host's
        # namespace (containers.conf netns="host") still gives the sandbox a namespace of its own.
        argv += ["--network", "bridge" if spec.network else "none"]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        # `--` ends the options: whatever the image is named, it is read as the image.
        return argv + ["--entrypoint", "sleep", "--", spec.image, "infinity"]

    def exec_prefix(self, spec: SandboxSpec, sandbox_id: str, env: dict, tty: bool) -> list[str]:
        argv = [which("docker") or "docker", "exec", "--interactive"]
        if tty:
            argv.append("--tty")
        argv += ["--workdir", spec.workdir]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        return argv + [container_name(sandbox_id)]

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        spec = spec.model_copy(update={"image": resolve_image(spec.image, "docker")})
        env = sandbox_env(spec, STANDARD_PATH)
        host_env = client_env()
        name = container_name(sandbox_id)
        docker = which("docker") or "docker"
        start = self.run_argv(spec, layout, sandbox_id, owner, env)
        cleanup = [docker, "rm", "--force", name]
        start_timeout_s = None
        if spec.services:
            containers = {MAIN: name, **{s.name: sidecar_name(sandbox_id, s.name) for s in spec.services}}
            start, cleanup, start_timeout_s = services_script(
                docker, spec, containers, network_name(sandbox_id), f"{LABEL}={sandbox_id}",
                policy_flags(spec, sandbox_id, owner), start)
        return LaunchPlan(
            **base_plan(spec, layout, sandbox_id, owner, self.name),
            workdir_inner=spec.workdir,
            mounts=[(spec.workdir, layout.work), ("/tmp", layout.tmp)],
            # `exec -t` gives bash the container's own pty, whose echo and "\n" -> "\r\n" are on;
            # the supervisor's framing expects what its host pty gives (both off), so the shell
            # turns them off before bash starts. Ctrl-C still reaches the container's pty.
            bash_argv=self.exec_prefix(spec, sandbox_id, env, tty=True)
            + ulimit_wrapped(BASH_ARGS, spec.limits, before="stty -echo -onlcr"),
            exec_prefix=self.exec_prefix(spec, sandbox_id, env, tty=False),
            kernel_argv=ulimit_wrapped([spec.python or "python3", *KERNEL_ARGS], spec.limits),
            kernel_dir_inner=KERNEL_DIR_INNER,
            spawn_env=host_env,
            spawn_cwd=layout.dir,
            host_env=host_env,
            rlimits={},  # limits apply inside the container; host rlimits would only bind the CLI
            confine_processes=False,  # dockerd holds the processes: --pids-limit, --memory, --cpus
            start_argv=start,
            start_timeout_s=start_timeout_s,
            stop_argv=cleanup,
            cleanup_argv=cleanup,
            inspect_argv=[docker, "inspect", "--format", "{{.State.Pid}} {{.Id}}", name],
        )
