"""What a sandbox is made of (SandboxSpec, SandboxLimits), what a job may change of it
(SandboxOverrides) and how to reach a live one (SandboxHandle): the sandbox's part of the job's
vocabulary, at the bottom layer beside rollstream/messages.py.

Tasks declare a SandboxSpec; the init stage merges the job's overrides into it (the operator's
policy, sandboxes/policy.py), turns it into a SandboxHandle with `create_sandbox`, and the
handle travels in the envelope to the run and eval workers of the same node, which connect to
its supervisor's Unix socket by path.
"""

from __future__ import annotations

import os
import time
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator
from typing_extensions import TypedDict

BackendName = Literal["auto", "bwrap", "singularity", "docker", "local"]
SANDBOX_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# The Linux capabilities a container sandbox may keep for root inside (docker backend), and no
# others: what root in a Harbor/Terminal-Bench task expects of its container (SECURITY.md, "Root
# inside a container"). SYS_ADMIN, NET_ADMIN, NET_RAW, MKNOD, SYS_PTRACE, SYS_MODULE,
# DAC_READ_SEARCH and the rest cannot even be named.
ContainerCapability = Literal["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID", "KILL"]
ROOT_TASK_CAPABILITIES: tuple[ContainerCapability, ...] = get_args(ContainerCapability)


class SandboxLimits(BaseModel):
    """Resource limits of one sandbox; None switches a limit off."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(
        4096, description="address space per process (RLIMIT_AS) and, where a memory cgroup is ours, the "
        "whole sandbox's memory, its tmpfs files included; docker: --memory"
    )
    cpu_time_s: int | None = Field(3600, description="CPU seconds per process (RLIMIT_CPU)")
    max_processes: int | None = Field(
        512, description="processes of the whole sandbox (cgroup pids.max; without a writable cgroup "
        "RLIMIT_NPROC, which root ignores); docker: --pids-limit"
    )
    max_open_files: int = Field(4096, description="open files per process (RLIMIT_NOFILE)")
    disk_mb: int | None = Field(
        4096, description="largest file (RLIMIT_FSIZE) and total size of workdir + /tmp: a tmpfs of this "
        "size as root (ENOSPC), else usage checked every 5 s"
    )
    output_bytes: int = Field(65536, description="tool output kept per call (head and tail halves)")
    cpus: float | None = Field(None, description="CPU quota: cgroup cpu.max where ours; docker/singularity --cpus")
    default_timeout_s: float = Field(120.0, description="per-command wall time when a call names none")
    default_no_output_timeout_s: float | None = Field(
        60.0, description="interrupt a command silent this long (None: never)"
    )
    idle_timeout_s: float = Field(1800.0, description="supervisor exits after this long without a call")
    max_lifetime_s: float = Field(6 * 3600.0, description="supervisor exits this long after start, busy or not")


# When a container that depends on a service may start (compose's depends_on conditions).
DependencyCondition = Literal["service_started", "service_healthy", "service_completed_successfully"]


class HealthCheck(BaseModel):
    """A service's readiness probe (compose's ``healthcheck``), run by rollstream in the service's
    container: healthy at the first success, unhealthy after ``retries`` failures in a row once
    ``start_period_s`` is over."""

    model_config = ConfigDict(extra="forbid")

    test: list[str] = Field(min_length=1, description="argv run in the container; exit 0 is healthy")
    interval_s: float = Field(30.0, gt=0, le=3600, description="between probes")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="a probe running longer has failed")
    retries: int = Field(3, ge=1, le=1000, description="failures in a row that make it unhealthy")
    start_period_s: float = Field(0.0, ge=0, le=3600, description="failures in this time after start do not count")
    start_interval_s: float = Field(5.0, gt=0, le=3600, description="between probes in the start period")


class SidecarSpec(BaseModel):
    """A container started beside a docker sandbox, on a network of the sandbox's own, under its
    capability and limit policy (a Harbor compose task's service other than main)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$", description="the name the sandbox reaches it by")
    image: str = Field(pattern=r"^[A-Za-z0-9][\x21-\x7e]*$")
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    healthcheck: HealthCheck | None = None
    depends_on: dict[str, DependencyCondition] = Field(
        default_factory=dict, description="the containers it starts after (other services or main), and when")


class SandboxSpec(BaseModel):
    """How to build a sandbox; tasks declare one, the init stage creates it."""

    model_config = ConfigDict(extra="forbid")

    backend: BackendName = Field("auto", description="auto picks bwrap, then singularity, then docker")
    image: str | None = Field(
        None,
        description="bwrap: an unpacked rootfs folder (None: the host, read-only); singularity: a SIF "
        "path or docker:// URI; docker: an image name",
    )
    files: dict[str, str | bytes] = Field(default_factory=dict, description="path (in the workdir) -> content")
    setup_commands: list[str] = Field(default_factory=list, description="bash commands run once after start")
    setup_timeout_s: float = Field(600.0, description="time allowed for each setup command")
    network: bool = Field(False, description="give the sandbox network access")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment inside the sandbox")
    workdir: str = Field("/workspace", description="the sandbox's working directory, as seen inside")
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    python: str | None = Field(
        None, description="interpreter for the IPython kernel inside (default: this one on the host rootfs, "
        "else python3)"
    )
    hide_paths: list[str] = Field(
        default_factory=list, description="bwrap with the host rootfs: host paths to mask with an empty tmpfs"
    )
    allow_unisolated: bool = Field(
        False, description="required with backend='local', which runs tools on the host without isolation"
    )
    capabilities: list[ContainerCapability] = Field(
        default_factory=list, description="docker: capabilities root inside keeps (all others dropped), within "
        "the operator's ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES; the task's to declare, never a job's"
    )
    services: list[SidecarSpec] = Field(
        default_factory=list, description="docker: containers started beside the sandbox on its own network, "
        "reachable by name and removed with it; the task's to declare, never a job's"
    )
    depends_on: dict[str, DependencyCondition] = Field(
        default_factory=dict, description="docker with services: those the main container starts after, and when"
    )

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") in ("", "/tmp", "/proc", "/dev", "/run"):
            raise ValueError("workdir must be an absolute path such as /workspace, not / or a system folder")
        return os.path.normpath(value)


class SandboxHandle(BaseModel):
    """A live sandbox on this node (``Envelope.sandbox``); plain data. A handle read from a
    stream is not trusted: stages rebuild its paths from its id (sandboxes/lifecycle.checked_handle)."""

    id: str
    backend: str
    socket_path: str
    supervisor_pid: int
    workdir: str = Field(description="working directory as seen inside the sandbox")
    owner: str = ""
    created_at: float = Field(default_factory=time.time)
    dir: str = Field("", description="host folder holding the sandbox's files, socket and plan")
    host_workdir: str = Field("", description="host folder bound as the workdir")


class LimitsOverrides(TypedDict, total=False):
    """The ``SandboxLimits`` fields a job sets (``Job.sandbox["limits"]``); the rest stay the task's."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]

    memory_mb: int | None
    cpu_time_s: int | None
    max_processes: int | None
    max_open_files: int
    disk_mb: int | None
    output_bytes: int
    cpus: float | None
    default_timeout_s: float
    default_no_output_timeout_s: float | None
    idle_timeout_s: float
    max_lifetime_s: float


class SandboxOverrides(TypedDict, total=False):
    """What a job asks to change of its task's ``SandboxSpec`` (``Job.sandbox``). A mapping,
    not a model: only the fields the job names travel, and the init stage's policy
    (sandboxes/policy.py) decides which of them this node lets a job change."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]

    backend: BackendName
    image: str | None
    files: dict[str, str | bytes]
    setup_commands: list[str]
    setup_timeout_s: float
    network: bool
    env: dict[str, str]
    workdir: str
    limits: LimitsOverrides
    python: str | None
    hide_paths: list[str]
    allow_unisolated: bool
    capabilities: list[str]  # named only to be refused with the reason (policy.NEVER_FROM_A_JOB)
    services: list[dict]  # named only to be refused with the reason (policy.NEVER_FROM_A_JOB)
    depends_on: dict[str, str]  # named only to be refused with the reason (policy.NEVER_FROM_A_JOB)
