"""Exceptions of the sandbox package; each message says what to do about it."""

from __future__ import annotations


class SandboxError(Exception):
    """Base of every sandbox error."""


class BackendUnavailable(SandboxError):
    """The requested backend cannot run on this machine."""


class SandboxStartError(SandboxError):
    """The supervisor or the container did not come up."""


# How a container backend's start says that one of the sandbox's own services failed (below).
SERVICE_FAILED_MARK = "rs-service-failed: "


class SandboxServiceFailed(SandboxStartError):
    """A service of the spec (a sidecar) failed on its own: it exited, or its healthcheck judged it
    unhealthy. The environment's fault, not the node's: another start would fail the same way."""


class SandboxSetupError(SandboxError):
    """A setup command of the spec failed; the sandbox was destroyed."""


class SandboxGone(SandboxError):
    """The sandbox's supervisor is not answering (destroyed, reaped or crashed)."""


class ToolError(SandboxError):
    """The supervisor refused or failed a tool call; `kind` names the remote error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
