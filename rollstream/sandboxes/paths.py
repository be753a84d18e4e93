"""Host names and paths derived from ids that a job chose: readable, bounded, never escaping, never colliding.

A job id reaches the host as a sandbox id (a folder, a socket, a cgroup, a container name)
and as the echo task's work folder. Ids are checked at submit, but a raw message on a
stream skips that door, so everything here holds for any string: the readable part keeps
only safe characters and a digest of the whole id keeps two ids apart, and a path is used
only after it resolves to a direct child of its root.
"""

from __future__ import annotations

import hashlib
import os
import re

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
DIGEST_HEX = 16  # 64 bits: a second id with the same name needs ~2^64 tries


def safe_name(value: str, max_prefix: int = 24) -> str:
    """`value` as one path component: up to `max_prefix` safe characters, then a digest of all of it.

    Matches [A-Za-z0-9][A-Za-z0-9_.-]*: never empty, never '.' or '..', never a '/' or a
    leading '-'; ids that share their first characters still get different names.
    """
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_HEX]
    readable = _UNSAFE.sub("_", value)[:max_prefix].lstrip("._-")
    return f"{readable}-{digest}" if readable else digest


def sandbox_id_for(job_id: str, attempt: int) -> str:
    """The sandbox id of one attempt of a job (kept short: it names folders, cgroups and containers)."""
    return f"{safe_name(job_id, 20)}-{int(attempt)}"


class PathEscape(ValueError):
    """A path derived from an id would leave its root folder."""


def child_path(root: str | os.PathLike, name: str) -> str:
    """root/name, refused unless it is a direct child of `root` once both are resolved."""
    root_real = os.path.realpath(os.fspath(root))
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise PathEscape(f"{name!r} is not a single file name under {root_real}")
    path = os.path.join(root_real, name)
    if os.path.dirname(os.path.realpath(path)) != root_real:
        raise PathEscape(f"{path} resolves outside {root_real} (a symlink?); refusing to use it")
    return path


def is_child_of(root: str | os.PathLike, path: str) -> bool:
    """True when `path`, symlinks resolved, is the direct child of `root` that its name says."""
    name = os.path.basename(path)
    if name in ("", ".", "..") or "\0" in path:
        return False
    return os.path.realpath(path) == os.path.join(os.path.realpath(os.fspath(root)), name)
