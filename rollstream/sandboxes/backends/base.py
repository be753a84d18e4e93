"""The Sandbox backend interface: what a backend is given (a SandboxSpec and the sandbox's
SandboxLayout) and what it returns (a LaunchPlan the supervisor executes).

A backend is a command builder: it says how to start and stop the container and how
to run a process inside it. The supervisor (runtime/) executes those commands, so it
stays backend-agnostic and light; backends never run in the supervisor process. Each
backend lives in its own module (bwrap, singularity, docker, local), their shared parts in
common.py, and factory.py picks one from a spec.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Protocol, cast

from rollstream.sandbox_spec import SandboxSpec

from ..paths import child_path
from ..runtime.plan import Plan


@dataclass(frozen=True)
class SandboxLayout:
    """The host folders of one sandbox under the node's sandbox root."""

    dir: str

    @classmethod
    def of(cls, root_dir: str, sandbox_id: str) -> SandboxLayout:
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
    def door(self) -> str:
        """Where the run stage puts the job's door socket (agent/door_relay.py); bound read-only
        into this sandbox alone, at DOOR_DIR_INNER."""
        return os.path.join(self.dir, "door")

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
        for folder in (self.work, self.tmp, self.kernel, self.door):
            os.makedirs(folder)
        os.chmod(self.door, 0o755)  # the sandbox's uid walks in; only we write (the run stage's socket)
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
    start_timeout_s: float | None = None  # how long start_argv may run (None: the supervisor's 300 s)
    stop_argv: list[str] | None = None
    cleanup_argv: list[str] | None = None  # what a reaper runs when the supervisor died uncleanly
    # Prints the host pid of the container's first process and the container's id (docker
    # inspect): how the supervisor learns, from the engine, which pid namespace the shell is
    # in, to reach its terminal (runtime/bash_terminal.py).
    inspect_argv: list[str] | None = None
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

    def to_json_dict(self) -> Plan:
        return cast(Plan, asdict(self))


class SandboxBackend(Protocol):
    """One way of isolating tools: bwrap, singularity, docker or local."""

    name: str

    def available(self) -> bool:
        """True when this backend can run on this machine now."""
        ...

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        """The commands and settings of one sandbox."""
        ...
