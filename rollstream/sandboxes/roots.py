"""Where a node's sandboxes live: the node's root folder and a deployment's folder under it.
(What a sandbox is made of and how to reach one are part of the job's vocabulary, in
rollstream/sandbox_spec.py.)"""

from __future__ import annotations

import os


def default_root_dir() -> str:
    """Where sandbox folders and sockets live: $ROLLSTREAM_SANDBOX_ROOT or a per-user /tmp folder.

    Socket paths under it may be of any length (runtime/unix_path.py reaches long ones).
    """
    return os.environ.get("ROLLSTREAM_SANDBOX_ROOT") or f"/tmp/rollstream-sb-{os.getuid()}"


def namespace_root_dir(namespace: str, sandbox_root: str | os.PathLike | None = None) -> str:
    """A deployment's sandbox folder: `sandbox_root` where one is configured, else one per
    namespace under the node's root, so that a reaper only ever judges sandboxes of its own jobs."""
    return str(sandbox_root) if sandbox_root else f"{default_root_dir()}/{namespace}"
