"""What every backend's LaunchPlan shares: the bash and kernel command lines (with the
kernel's launcher script), the environment inside, the limits as rlimits or ulimit, and
the plan fields every backend fills the same way."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from rollstream.sandbox_spec import SandboxLimits, SandboxSpec

from ..runtime.plan import Plan, SharedPlanFields
from .base import SandboxLayout

KERNEL_DIR_INNER = "/run/rollstream"
# The job's door socket inside every sandbox (read-only: the sandbox connects, never replaces it).
DOOR_DIR_INNER = "/run/rollstream-door"
BASH_ARGS = ["bash", "--noediting", "--noprofile", "--norc", "-i"]
# Runs as `python -c` (so it needs no file inside the image) in place of ipykernel_launcher:
# what it leaves out and why is in that file.
KERNEL_LAUNCHER = (Path(__file__).resolve().parent.parent / "runtime" / "kernel_launcher.py").read_text()
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


def base_plan(spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str, backend: str) -> SharedPlanFields:
    """The fields every backend fills the same way."""
    limits = spec.limits
    return SharedPlanFields(
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


def write_plan(path: str, plan: Plan) -> None:
    """plan.json, a new file only our uid may read or write whatever the umask: the reaper runs
    the commands of no other plan (reaper._plan)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(plan, handle)


def which(name: str) -> str | None:
    return shutil.which(name)
