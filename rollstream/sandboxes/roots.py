"""Where a node's sandboxes live: the node's root folder and a deployment's folder under it,
and the check that no other user can change them. (What a sandbox is made of and how to
reach one are part of the job's vocabulary, in rollstream/sandbox_spec.py.)

The sandbox root is a trust boundary: the workers (root, on a node that gives each sandbox a
uid of its own) tear down whatever folder they find there, from the plan.json and
confinement.json inside. A root that another user could create first (a predictable /tmp
name), rename or fill would let that user choose what root kills, unmounts and runs; so it is
made by us, and it and every folder above it are checked before each use (`ensure_root`,
`check_root`).
"""

from __future__ import annotations

import os
import stat

from .errors import SandboxError
from .runtime.env_settings import env_setting


class UnsafeSandboxRoot(SandboxError):
    """The sandbox root, or a folder above it, is not ours alone to change."""


def default_root_dir() -> str:
    """Where sandbox folders and sockets live: $ROLLSTREAM_SANDBOX_ROOT or a per-user /tmp folder.

    Socket paths under it may be of any length (runtime/unix_path.py reaches long ones).
    """
    return env_setting("SANDBOX_ROOT") or f"/tmp/rollstream-sb-{os.getuid()}"


def namespace_root_dir(namespace: str, sandbox_root: str | os.PathLike | None = None) -> str:
    """A deployment's sandbox folder: `sandbox_root` where one is configured, else one per
    namespace under the node's root, so that a reaper only ever judges sandboxes of its own jobs."""
    return str(sandbox_root) if sandbox_root else f"{default_root_dir()}/{namespace}"


_ADVICE = ("remove it (or have its owner remove it) if rollstream did not make it, or set "
           "ROLLSTREAM_SANDBOX_ROOT to a folder below folders only root and the user running the workers "
           "can change (e.g. /var/lib/rollstream-sb, or a folder of your own under a 0755 home)")


def check_root(path: str | os.PathLike) -> str:
    """The absolute sandbox root `path`, once it and every folder above it are shown to be
    changeable by no user but root and us; raises UnsafeSandboxRoot otherwise.

    Every existing folder on the way must belong to root or to our uid and be writable by no
    one else, except a sticky one like /tmp (whose entries only their owner may rename); the
    root itself must be ours and writable by us alone. A symlink on the way must be root's or
    ours, and the folder it leads to passes the same check. Missing folders below the last
    existing one are not judged (ensure_root makes them ours).
    """
    root = os.path.abspath(os.fspath(path))
    _check_chain(root)
    real = os.path.realpath(root)
    if real != root:
        _check_chain(real)
    return root


def ensure_root(path: str | os.PathLike) -> str:
    """Make the sandbox root (and the folders missing above it) ours, mode 0700, and check it
    and what is above it (check_root); the absolute path."""
    root = check_root(path)  # never make folders below one another user controls (nor where a link leads)
    os.makedirs(root, mode=0o700, exist_ok=True)
    return check_root(root)


def _check_chain(root: str) -> None:
    us = os.geteuid()
    folders = [root]
    while folders[-1] != os.path.dirname(folders[-1]):
        folders.append(os.path.dirname(folders[-1]))
    for folder in reversed(folders):  # from / down
        try:
            info = os.lstat(folder)
        except FileNotFoundError:
            return
        leaf = folder == root
        if info.st_uid not in (0, us):
            raise UnsafeSandboxRoot(
                f"sandbox root {root}: {folder} belongs to uid {info.st_uid}, who could replace what "
                f"rollstream keeps there and have it torn down as uid {us}; {_ADVICE}"
            )
        if stat.S_ISLNK(info.st_mode):
            continue  # what it leads to is checked through the real path
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafeSandboxRoot(f"sandbox root {root}: {folder} is not a folder; {_ADVICE}")
        if leaf and info.st_uid != us:
            raise UnsafeSandboxRoot(
                f"sandbox root {root} belongs to uid {info.st_uid}, not to the uid running the workers ({us}); "
                f"{_ADVICE}"
            )
        writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable_by_others and (leaf or not info.st_mode & stat.S_ISVTX):
            raise UnsafeSandboxRoot(
                f"sandbox root {root}: {folder} is writable by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}), who could rename or plant folders in it; run "
                f"'chmod go-w {folder}' if that is yours to change, or {_ADVICE}"
            )


def written_by_us(path: str | os.PathLike, folder: bool = False) -> bool:
    """Whether `path` is a regular file (or with `folder`, a folder), not a symlink, that our
    uid owns and no one else may write: a file of the sandbox root we may act upon."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    kind_ok = stat.S_ISDIR(info.st_mode) if folder else stat.S_ISREG(info.st_mode)
    return kind_ok and info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
