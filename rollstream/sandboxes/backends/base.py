"""The Sandbox backend interface and the factory that picks one from a SandboxSpec.

A backend is a command builder: it says how to start and stop the container and how
to run a process inside it. The supervisor (runtime/) executes those commands, so it
stays backend-agnostic and light; backends never run in the supervisor process.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from typing import Protocol

from ..errors import BackendUnavailable
from ..paths import child_path
from ..spec import SandboxLimits, SandboxSpec

KERNEL_DIR_INNER = "/run/rollstream"
BASH_ARGS = ["bash", "--noediting", "--noprofile", "--norc", "-i"]
# Runs as `python -c` (so it needs no file inside the image) in place of ipykernel_launcher.
# ipykernel flushes stdout and stderr after every cell by a round trip to its IO thread
# each, even when nothing was written: two thread wake-ups on the critical path of every
# call, several ms on a busy node. This skips a flush with nothing to send; any other
# ipykernel (attributes missing) keeps its own flush.
KERNEL_LAUNCHER = """
import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
try:
    from ipykernel.iostream import OutStream
    _flush = OutStream.flush

    def flush(self):
        if (getattr(self, "_flush_pending", True) or getattr(self, "_subprocess_flush_pending", True)
                or getattr(self, "_buffers", True)):
            _flush(self)

    OutStream.flush = flush
except Exception:
    pass
from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""
# What follows the interpreter when the kernel starts. History goes to an in-memory
# database: IPython's default commits every cell to sqlite on disk, which costs 10-20 ms
# per cell on a busy node and serves nobody in a throwaway sandbox. ipykernel sleeps
# 0.5 ms (a scheduler round, under load much more) after each cell so that output
# "arrives first"; we wait for the idle status, which follows all output, instead.
KERNEL_ARGS = [
    "-c",
    KERNEL_LAUNCHER,
    "-f",
    "{connection_file}",
    "--HistoryManager.enabled=False",
    "--IPythonKernel._execute_sleep=0",
]
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class SandboxLayout:
    """The host folders of one sandbox under the node's sandbox root."""

    dir: str

    @classmethod
    def of(cls, root_dir: str, sandbox_id: str) -> "SandboxLayout":
        """Refuses (PathEscape) an id that is not one plain folder name under `root_dir`."""
        return cls(child_path(os.path.abspath(root_dir), sandbox_id))

    @property
    def data(self) -> str:
        """Holds work/ and tmp/; the supervisor mounts a tmpfs of the disk limit here where it can."""
        return os.path.join(self.dir, "data")

    @property
    def work(self) -> str:
        return os.path.join(self.data, "work")

    @property
    def tmp(self) -> str:
        return os.path.join(self.data, "tmp")

    @property
    def kernel(self) -> str:
        return os.path.join(self.dir, "k")

    @property
    def socket_path(self) -> str:
        return os.path.join(self.dir, "s.sock")

    @property
    def plan_path(self) -> str:
        return os.path.join(self.dir, "plan.json")

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "supervisor.log")

    def make(self) -> None:
        os.makedirs(self.dir, mode=0o700)
        for folder in (self.work, self.tmp, self.kernel):
            os.makedirs(folder)
        # The sandbox user may map to another uid; /tmp must be world-writable like a real /tmp.
        os.chmod(self.tmp, 0o1777)


@dataclass
class LaunchPlan:
    """Everything the supervisor needs, as JSON; see runtime/supervisor.py for its use."""

    sandbox_id: str
    owner: str
    backend: str
    dir: str
    socket_path: str
    workdir_inner: str
    mounts: list[tuple[str, str]]  # (path inside, host path) the supervisor may read and write
    bash_argv: list[str]
    exec_prefix: list[str]  # argv prefix that runs a command inside the sandbox
    kernel_argv: list[str]
    kernel_dir_host: str
    kernel_dir_inner: str
    spawn_env: dict[str, str]  # environment of the processes the supervisor spawns
    spawn_cwd: str | None
    host_env: dict[str, str]  # environment for start_argv / stop_argv (container CLIs)
    rlimits: dict[str, int]
    output_bytes: int
    default_timeout_s: float
    default_no_output_timeout_s: float | None
    idle_timeout_s: float
    max_lifetime_s: float
    disk_bytes: int | None
    data_dir: str = ""  # mount point of the sandbox's tmpfs (work/ and tmp/ inside)
    max_processes: int | None = None  # cgroup pids.max
    memory_bytes: int | None = None  # cgroup memory limit for the whole sandbox
    cpus: float | None = None  # cgroup CPU quota
    # False where a container runtime (docker) holds the processes and their limits itself.
    confine_processes: bool = True
    start_argv: list[str] | None = None
    stop_argv: list[str] | None = None
    cleanup_argv: list[str] | None = None  # what a reaper runs when the supervisor died uncleanly
    created_at: float = 0.0
    ready_fd: int = -1
    remove_dir_on_exit: bool = True
    # True when every process the supervisor spawns is the root of its own pid namespace
    # (bwrap): killing that root kills all inside, so shutdown need not scan /proc.
    pid_namespace: bool = False
    # A setpriv binary when the supervisor runs as root: it starts every sandboxed process
    # under an unprivileged host uid of the sandbox's own (runtime/identity.py).
    unprivileged_via: str = ""
    extra: dict = field(default_factory=dict)

    def to_json_dict(self) -> dict:
        return asdict(self)


class SandboxBackend(Protocol):
    """One way of isolating tools: bwrap, singularity, docker or local."""

    name: str

    def available(self) -> bool:
        """True when this backend can run on this machine now."""
        ...

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        """The commands and settings of one sandbox."""
        ...


def sandbox_env(spec: SandboxSpec, path: str) -> dict[str, str]:
    """The environment inside: a short allow-list plus spec.env; nothing from the host."""
    env = {
        "PATH": path,
        "HOME": spec.workdir,
        "USER": "user",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "IPYTHONDIR": "/tmp/.ipython",
        "MPLCONFIGDIR": "/tmp/.config/matplotlib",
        "XDG_CACHE_HOME": "/tmp/.cache",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(spec.env)
    return env


def host_python_path() -> str:
    return f"{os.path.dirname(sys.executable)}:{STANDARD_PATH}"


def rlimits_for(limits: SandboxLimits) -> dict[str, int]:
    values = {
        "RLIMIT_AS": limits.memory_mb * 2**20 if limits.memory_mb else None,
        "RLIMIT_CPU": limits.cpu_time_s,
        "RLIMIT_NPROC": limits.max_processes,
        "RLIMIT_NOFILE": limits.max_open_files,
        "RLIMIT_FSIZE": limits.disk_mb * 2**20 if limits.disk_mb else None,
        "RLIMIT_CORE": 0,
    }
    return {name: value for name, value in values.items() if value is not None}


def ulimit_wrapped(argv: list[str], limits: SandboxLimits, before: str = "") -> list[str]:
    """Apply the limits inside a container runtime, where host rlimits would hit its CLI.

    `before` is a shell command run first (its errors ignored)."""
    flags = [before] if before else []
    if limits.memory_mb:
        flags.append(f"ulimit -v {limits.memory_mb * 1024}")
    if limits.cpu_time_s:
        flags.append(f"ulimit -t {limits.cpu_time_s}")
    if limits.max_processes:
        flags.append(f"ulimit -u {limits.max_processes}")
    if limits.disk_mb:
        flags.append(f"ulimit -f {limits.disk_mb * 1024}")
    flags.append(f"ulimit -n {limits.max_open_files}")
    script = "; ".join(f"{flag} 2>/dev/null" for flag in flags) + '; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *argv]


def base_plan(spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str, backend: str) -> dict:
    """The fields every backend fills the same way."""
    limits = spec.limits
    return dict(
        sandbox_id=sandbox_id,
        owner=owner,
        backend=backend,
        dir=layout.dir,
        socket_path=layout.socket_path,
        kernel_dir_host=layout.kernel,
        output_bytes=limits.output_bytes,
        default_timeout_s=limits.default_timeout_s,
        default_no_output_timeout_s=limits.default_no_output_timeout_s,
        idle_timeout_s=limits.idle_timeout_s,
        max_lifetime_s=limits.max_lifetime_s,
        disk_bytes=limits.disk_mb * 2**20 if limits.disk_mb else None,
        data_dir=layout.data,
        max_processes=limits.max_processes,
        memory_bytes=limits.memory_mb * 2**20 if limits.memory_mb else None,
        cpus=limits.cpus,
    )


def get_backend(name: str) -> SandboxBackend:
    from .bwrap import BwrapBackend
    from .docker import DockerBackend
    from .local import LocalBackend
    from .singularity import SingularityBackend

    backends = {
        "bwrap": BwrapBackend,
        "singularity": SingularityBackend,
        "docker": DockerBackend,
        "local": LocalBackend,
    }
    if name not in backends:
        raise BackendUnavailable(f"unknown sandbox backend {name!r}; use one of auto, {', '.join(backends)}")
    return backends[name]()


def select_backend(spec: SandboxSpec) -> SandboxBackend:
    """The backend a spec asks for, or for 'auto' the first isolating one that works here."""
    if spec.backend != "auto":
        backend = get_backend(spec.backend)
        if not backend.available():
            raise BackendUnavailable(
                f"sandbox backend {spec.backend!r} is not usable on this machine; install it "
                f"({_INSTALL_HINTS[spec.backend]}) or use backend='auto'"
            )
        return backend
    for name in ("bwrap", "singularity", "docker"):
        backend = get_backend(name)
        if backend.available():
            return backend
    raise BackendUnavailable(
        "no sandbox backend works on this machine; install bubblewrap (apt install bubblewrap), "
        "Apptainer/Singularity or Docker, or for development only use backend='local' with "
        "allow_unisolated=True"
    )


_INSTALL_HINTS = {
    "bwrap": "apt install bubblewrap",
    "singularity": "install Apptainer or SingularityCE so that 'apptainer' or 'singularity' is on PATH",
    "docker": "install Docker and start the engine; 'docker info' must succeed",
    "local": "always available",
}


def which(name: str) -> str | None:
    return shutil.which(name)
