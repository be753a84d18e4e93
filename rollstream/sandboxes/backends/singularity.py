"""The Singularity/Apptainer backend: one instance per sandbox, tools through `exec instance://`.

Rootless on Slurm nodes: `instance start --containall --writable-tmpfs`, network off,
the workdir, /tmp and the kernel's ipc folder bound from the host. spython finds the
binary and prepares images (see images.py); the commands themselves are plain argv.
"""

from __future__ import annotations

import functools
import os
import re

from rollstream.sandbox_spec import SandboxSpec

from ..image_cache import resolve_image
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

_CLIENT_ENV = ("PATH", "HOME", "APPTAINER_CACHEDIR", "SINGULARITY_CACHEDIR", "APPTAINER_TMPDIR", "SINGULARITY_TMPDIR")


@functools.lru_cache(maxsize=1)
def singularity_binary() -> str | None:
    """apptainer, else singularity, as found on PATH."""
    for name in ("apptainer", "singularity"):
        path = which(name)
        if path is not None:
            return path
    return None


def instance_name(sandbox_id: str) -> str:
    # Instance names allow letters, digits, '-' and '_' only.
    return "rs-" + re.sub(r"[^A-Za-z0-9_-]", "_", sandbox_id)


class SingularityBackend:
    name = "singularity"

    def __init__(self, binary: str | None = None) -> None:
        self._binary = binary

    @property
    def binary(self) -> str:
        return self._binary or singularity_binary() or "apptainer"

    def available(self) -> bool:
        return (self._binary or singularity_binary()) is not None

    def start_argv(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str) -> list[str]:
        if not spec.image:
            raise ValueError("backend='singularity' needs an image: a .sif path or a docker:// URI")
        argv = [self.binary, "instance", "start", "--containall", "--cleanenv", "--writable-tmpfs", "--no-home"]
        if not spec.network:
            argv += ["--net", "--network", "none"]
        argv += [
            "--bind", f"{layout.work}:{spec.workdir}",
            "--bind", f"{layout.tmp}:/tmp",
            "--bind", f"{layout.kernel}:{KERNEL_DIR_INNER}",
            "--bind", f"{layout.door}:{DOOR_DIR_INNER}:ro",
            "--pwd", spec.workdir,
            "--hostname", "sandbox",
        ]
        return argv + [spec.image, instance_name(sandbox_id)]

    def exec_prefix(self, spec: SandboxSpec, sandbox_id: str, env: dict[str, str]) -> list[str]:
        argv = [self.binary, "exec", "--cleanenv", "--pwd", spec.workdir]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        return argv + [f"instance://{instance_name(sandbox_id)}"]

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        spec = spec.model_copy(update={"image": resolve_image(spec.image, "singularity")})
        env = sandbox_env(spec, STANDARD_PATH)
        host_env = {key: os.environ[key] for key in _CLIENT_ENV if key in os.environ}
        prefix = self.exec_prefix(spec, sandbox_id, env)
        stop = [self.binary, "instance", "stop", instance_name(sandbox_id)]
        return LaunchPlan(
            **base_plan(spec, layout, sandbox_id, owner, self.name),
            workdir_inner=spec.workdir,
            mounts=[(spec.workdir, layout.work), ("/tmp", layout.tmp)],
            bash_argv=prefix + ulimit_wrapped(BASH_ARGS, spec.limits),
            exec_prefix=prefix,
            kernel_argv=ulimit_wrapped(
                [spec.python or "python3", *KERNEL_ARGS], spec.limits
            ),
            kernel_dir_inner=KERNEL_DIR_INNER,
            spawn_env=host_env,
            spawn_cwd=layout.dir,
            host_env=host_env,
            rlimits={},  # applied by ulimit inside; an RLIMIT_AS on the Go starter would break it
            start_argv=self.start_argv(spec, layout, sandbox_id),
            stop_argv=stop,
            cleanup_argv=stop,
        )
