"""The sandbox's plan as the runtime reads it: plan.json, written by lifecycle.py from a backend's
``LaunchPlan`` (backends/base.py, whose fields say what each is for), read by the supervisor,
its confinement (confine.py) and the reaper. TypedDicts: the supervisor runs with ``python -S``
on the stdlib alone, and the plan stays the plain dict that JSON gives. Every key is optional
to a reader: the reaper reads what it finds, and an unreadable plan is empty."""

from __future__ import annotations

from typing import TypedDict


class SharedPlanFields(TypedDict, total=False):
    """What every backend fills the same way (backends/common.base_plan)."""

    sandbox_id: str
    owner: str
    backend: str
    dir: str
    socket_path: str
    kernel_dir_host: str
    output_bytes: int
    default_timeout_s: float
    default_no_output_timeout_s: float | None
    idle_timeout_s: float
    max_lifetime_s: float
    disk_bytes: int | None
    data_dir: str  # mount point of the sandbox's tmpfs
    max_processes: int | None
    memory_bytes: int | None
    cpus: float | None


class Plan(SharedPlanFields, total=False):
    """The whole plan: the shared fields and each backend's own."""

    created_at: float
    remove_dir_on_exit: bool
    ready_fd: int
    workdir_inner: str
    mounts: list[tuple[str, str]]  # a pair is a list once in JSON
    bash_argv: list[str]
    exec_prefix: list[str]
    kernel_argv: list[str]
    kernel_dir_inner: str
    spawn_env: dict[str, str]
    spawn_cwd: str | None
    pid_namespace: bool
    unprivileged_via: str
    confine_processes: bool
    rlimits: dict[str, int]
    # the container runtime's commands, where one holds the sandbox
    host_env: dict[str, str]
    start_argv: list[str] | None
    start_timeout_s: float | None
    stop_argv: list[str] | None
    cleanup_argv: list[str] | None
    inspect_argv: list[str] | None
    extra: dict
