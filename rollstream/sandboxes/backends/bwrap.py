"""The bubblewrap backend: rootless namespaces around each sandboxed process, no daemon.

Every bash session and the kernel get their own `bwrap` over the same folders: the
rootfs (host or unpacked image) read-only, the workdir, /tmp and the kernel's ipc
folder bound from the host, a fresh tmpfs over home directories, no network by default.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

from ..spec import SandboxSpec
from .base import (
    BASH_ARGS,
    KERNEL_ARGS,
    KERNEL_DIR_INNER,
    STANDARD_PATH,
    LaunchPlan,
    SandboxLayout,
    base_plan,
    host_python_path,
    rlimits_for,
    sandbox_env,
    which,
)

# Host top-level entries never bound into the sandbox: either replaced by fresh mounts
# (proc, dev, tmp) or private to the host's users (root, home, run holds sockets such as
# docker's and redis's).
_NOT_BOUND = {"proc", "dev", "tmp", "root", "home", "run", "lost+found"}
SANDBOX_UID = 1000


@functools.lru_cache(maxsize=1)
def _bwrap_works() -> bool:
    binary = which("bwrap")
    if binary is None:
        return False
    probe = [binary, "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "--", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def rootfs_args(rootfs: str) -> list[str]:
    """Bind each top-level entry of `rootfs` read-only over bwrap's tmpfs root.

    Binding entries one by one (rather than the whole `/`) leaves the root writable for
    bwrap to create mount points such as /workspace.
    """
    args: list[str] = []
    for name in sorted(os.listdir(rootfs)):
        if name in _NOT_BOUND:
            continue
        source = os.path.join(rootfs, name)
        if os.path.islink(source):
            args += ["--symlink", os.readlink(source), f"/{name}"]
        elif os.path.exists(source):
            args += ["--ro-bind", source, f"/{name}"]
    return args


_SO_ACCEPTCON = 0x10000


def listening_unix_sockets() -> list[str]:
    """Paths of the host's listening Unix sockets (a Redis, a docker daemon, our supervisors).

    A network namespace does not cover filesystem sockets, and a read-only bind does not
    stop connect(): a socket visible inside is reachable, so the sandbox gets /dev/null
    bound over each instead.
    """
    paths = []
    try:
        with open("/proc/net/unix") as handle:
            next(handle, None)
            for line in handle:
                fields = line.split()
                if len(fields) >= 8 and int(fields[3], 16) & _SO_ACCEPTCON and fields[7].startswith("/"):
                    paths.append(fields[7])
    except (OSError, ValueError):
        pass
    return paths


class BwrapBackend:
    name = "bwrap"

    def available(self) -> bool:
        return _bwrap_works()

    def bwrap_args(self, spec: SandboxSpec, layout: SandboxLayout, env: dict[str, str]) -> list[str]:
        rootfs = spec.image or "/"
        if spec.image is not None and not os.path.isdir(spec.image):
            raise FileNotFoundError(
                f"bwrap image {spec.image!r} is not a folder; unpack a rootfs there first "
                "(rollstream images pull --backend bwrap IMAGE)"
            )
        args = [which("bwrap") or "bwrap", "--unshare-all"]
        if spec.network:
            args.append("--share-net")
        args += [
            "--unshare-user",
            "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_UID),
            "--cap-drop", "ALL",
            "--die-with-parent",
            "--hostname", "sandbox",
        ]
        args += rootfs_args(rootfs)
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/root", "--tmpfs", "/home", "--tmpfs", "/run"]
        if spec.image is None:
            args += self._host_rootfs_extras(spec, layout)
        args += [
            "--bind", layout.work, spec.workdir,
            "--bind", layout.tmp, "/tmp",
            "--bind", layout.kernel, KERNEL_DIR_INNER,
            "--chdir", spec.workdir,
            "--clearenv",
        ]
        if spec.image is None:
            # An interpreter (a venv) under /tmp would vanish behind the private /tmp, and with
            # it the kernel and the tests a task runs with the host's Python.
            for prefix in sorted({sys.base_prefix, sys.prefix}):
                if prefix.startswith("/tmp/"):
                    args += ["--ro-bind", prefix, prefix]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return args + ["--"]

    def _host_rootfs_extras(self, spec: SandboxSpec, layout: SandboxLayout) -> list[str]:
        args: list[str] = []
        # Other sandboxes' folders must stay invisible even if the root is not under /tmp.
        root_dir = os.path.dirname(layout.dir)
        hidden = [root_dir, *spec.hide_paths]
        for path in hidden:
            top = path.strip("/").split("/")[0]
            if top in _NOT_BOUND or not os.path.exists(path):
                continue
            if os.path.isdir(path):
                args += ["--tmpfs", path]
            else:
                args += ["--ro-bind", "/dev/null", path]
        hidden_dirs = [path.rstrip("/") + "/" for path in hidden if os.path.isdir(path)]
        for path in sorted(set(listening_unix_sockets())):
            top = path.strip("/").split("/")[0]
            if top in _NOT_BOUND or path.startswith(tuple(hidden_dirs)) or not os.path.exists(path):
                continue
            # The supervisor drops the mask of a socket gone by the time it spawns a shell.
            args += ["--ro-bind", "/dev/null", path]
        # The host interpreter (for the kernel) may live under a home folder we just hid.
        for prefix in {sys.base_prefix, sys.prefix}:
            if prefix.strip("/").split("/")[0] in ("root", "home", "run"):
                args += ["--ro-bind", prefix, prefix]
        return args

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        path = host_python_path() if spec.image is None else STANDARD_PATH
        env = sandbox_env(spec, path)
        prefix = self.bwrap_args(spec, layout, env)
        python = spec.python or (sys.executable if spec.image is None else "python3")
        return LaunchPlan(
            **base_plan(spec, layout, sandbox_id, owner, self.name),
            workdir_inner=spec.workdir,
            mounts=[(spec.workdir, layout.work), ("/tmp", layout.tmp)],
            bash_argv=prefix + BASH_ARGS,
            exec_prefix=prefix,
            kernel_argv=[python, *KERNEL_ARGS],
            kernel_dir_inner=KERNEL_DIR_INNER,
            spawn_env=env,
            spawn_cwd=layout.dir,
            host_env={"PATH": os.environ.get("PATH", STANDARD_PATH)},
            rlimits=rlimits_for(spec.limits),
            pid_namespace=True,  # --unshare-pid + --die-with-parent
        )
