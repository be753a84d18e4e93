"""What a sandbox is made of (SandboxSpec, SandboxLimits) and how to reach one (SandboxHandle).

Tasks declare a SandboxSpec; the init stage turns it into a SandboxHandle with
`create_sandbox`, and the handle travels through Redis (as a dict) to the run and eval
workers of the same node, which connect to its supervisor's Unix socket by path.
"""

from __future__ import annotations

import os
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BackendName = Literal["auto", "bwrap", "singularity", "docker", "local"]
SANDBOX_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def default_root_dir() -> str:
    """Where sandbox folders and sockets live: $ROLLSTREAM_SANDBOX_ROOT or a per-user /tmp folder.

    Socket paths under it may be of any length (runtime/unix_path.py reaches long ones).
    """
    return os.environ.get("ROLLSTREAM_SANDBOX_ROOT") or f"/tmp/rollstream-sb-{os.getuid()}"


def namespace_root_dir(namespace: str, sandbox_root: str | os.PathLike | None = None) -> str:
    """A deployment's sandbox folder: `sandbox_root` where one is configured, else one per
    namespace under the node's root, so that a reaper only ever judges sandboxes of its own jobs."""
    return str(sandbox_root) if sandbox_root else f"{default_root_dir()}/{namespace}"


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

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str) -> str:
        if not value.startswith("/") or value.rstrip("/") in ("", "/tmp", "/proc", "/dev", "/run"):
            raise ValueError("workdir must be an absolute path such as /workspace, not / or a system folder")
        return os.path.normpath(value)


class SandboxHandle(BaseModel):
    """A live sandbox on this node; plain data, so it can go through Redis as a dict."""

    id: str
    backend: str
    socket_path: str
    supervisor_pid: int
    workdir: str = Field(description="working directory as seen inside the sandbox")
    owner: str = ""
    created_at: float = Field(default_factory=time.time)
    dir: str = Field("", description="host folder holding the sandbox's files, socket and plan")
    host_workdir: str = Field("", description="host folder bound as the workdir")
