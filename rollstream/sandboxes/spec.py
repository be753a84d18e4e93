"""Where a node's sandboxes live (default_root_dir, namespace_root_dir). What a sandbox is made
of and how to reach one (SandboxSpec, SandboxLimits, SandboxHandle) are part of the job's
vocabulary, in rollstream/sandbox_spec.py; they are named here too for the backends."""

from __future__ import annotations

import os

from rollstream.sandbox_spec import (  # noqa: F401  (the backends' names for them)
    SANDBOX_ID_PATTERN,
    BackendName,
    SandboxHandle,
    SandboxLimits,
    SandboxSpec,
)


def default_root_dir() -> str:
    """Where sandbox folders and sockets live: $ROLLSTREAM_SANDBOX_ROOT or a per-user /tmp folder.

    Socket paths under it may be of any length (runtime/unix_path.py reaches long ones).
    """
    return os.environ.get("ROLLSTREAM_SANDBOX_ROOT") or f"/tmp/rollstream-sb-{os.getuid()}"


def namespace_root_dir(namespace: str, sandbox_root: str | os.PathLike | None = None) -> str:
    """A deployment's sandbox folder: `sandbox_root` where one is configured, else one per
    namespace under the node's root, so that a reaper only ever judges sandboxes of its own jobs."""
    return str(sandbox_root) if sandbox_root else f"{default_root_dir()}/{namespace}"
