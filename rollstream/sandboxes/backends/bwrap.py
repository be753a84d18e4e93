"""The bubblewrap backend: rootless namespaces around each sandboxed process, no daemon.

Every bash session and the kernel get their own `bwrap` over the same folders: the
rootfs (host or unpacked image) read-only, the workdir, /tmp and the kernel's ipc
folder bound from the host, a fresh tmpfs over home directories, no network by default.
"""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys

from rollstream.sandbox_spec import SandboxSpec

from ..errors import BackendUnavailable
from ..image_cache import resolve_image
from .base import LaunchPlan, SandboxLayout
from .common import (
    BASH_ARGS,
    DOOR_DIR_INNER,
    KERNEL_ARGS,
    KERNEL_DIR_INNER,
    STANDARD_PATH,
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


def _setpriv_for_root() -> str:
    """As root, bwrap would map the sandbox user to host uid 0: the supervisor then starts bwrap
    through setpriv under a uid of the sandbox's own (runtime/identity.py)."""
    if os.geteuid() != 0:
        return ""  # bwrap maps the sandbox user to our own unprivileged uid
    setpriv = which("setpriv")
    if setpriv is None:
        raise BackendUnavailable(
            "bwrap as root needs setpriv (util-linux) to run sandboxes under an unprivileged host uid; "
            "install util-linux, or run the workers as an unprivileged user"
        )
    return setpriv


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


# A socket folder with more entries than this is hidden whole rather than rebuilt entry by entry.
MAX_REBUILT_ENTRIES = 256


def _folder_without_sockets(folder: str, sockets: list[str]) -> list[str]:
    """Mask the sockets of `folder` so that one recreated later (a restarted Redis) stays hidden.

    A mask bound over a socket covers that inode only: a server that restarts unlinks it and
    binds a new one, which a shell opened before would then reach. So the folder itself is
    replaced by a fresh tmpfs and its other entries are bound back: a socket made there later
    does not appear inside. (The supervisor drops the tmpfs if the folder is gone by then.)
    """
    try:
        names = sorted(os.listdir(folder))
    except OSError:  # a folder we may search but not list: mask the sockets themselves
        return [arg for path in sockets for arg in ("--ro-bind", "/dev/null", path)]
    args = ["--tmpfs", folder]
    if len(names) > MAX_REBUILT_ENTRIES:
        return args
    for name in names:
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISSOCK(info.st_mode):
            continue
        if stat.S_ISLNK(info.st_mode):
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind-try", path, path]
    return args


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
            "--ro-bind", layout.door, DOOR_DIR_INNER,
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
        socket_folders: dict[str, list[str]] = {}
        for path in sorted(set(listening_unix_sockets())):
            top = path.strip("/").split("/")[0]
            if top in _NOT_BOUND or path.startswith(tuple(hidden_dirs)) or not os.path.exists(path):
                continue
            if os.path.dirname(path) == "/":
                # The supervisor drops the mask of a socket gone by the time it spawns a shell.
                args += ["--ro-bind", "/dev/null", path]
            else:
                socket_folders.setdefault(os.path.dirname(path), []).append(path)
        for folder in sorted(socket_folders, key=len):  # a parent before the folders inside it
            args += _folder_without_sockets(folder, socket_folders[folder])
        # The host interpreter (for the kernel) may live under a home folder we just hid.
        for prefix in {sys.base_prefix, sys.prefix}:
            if prefix.strip("/").split("/")[0] in ("root", "home", "run"):
                args += ["--ro-bind", prefix, prefix]
        return args

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        spec = spec.model_copy(update={"image": resolve_image(spec.image, "bwrap")})
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
            # bwrap itself runs on the host: it gets no variable of the job's (LD_PRELOAD would
            # run the job's code there); the sandbox's environment goes in by --setenv.
            spawn_env={"PATH": STANDARD_PATH},
            spawn_cwd=layout.dir,
            host_env={"PATH": os.environ.get("PATH", STANDARD_PATH)},
            rlimits=rlimits_for(spec.limits),
            pid_namespace=True,  # --unshare-pid + --die-with-parent
            unprivileged_via=_setpriv_for_root(),
        )
