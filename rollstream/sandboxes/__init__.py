"""Sandboxes: where an agent's tools run (bash on a pty, IPython, an editor), isolated.

Public API: SandboxSpec / SandboxLimits (what to build), create_sandbox -> SandboxHandle,
SandboxClient (tools over the supervisor's Unix socket), destroy_sandbox, Reaper,
tool_schemas. Names are imported lazily so that `import rollstream.sandboxes` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    # What a sandbox is made of is part of the job's vocabulary, at the bottom layer.
    "SandboxSpec": "rollstream.sandbox_spec",
    "SandboxLimits": "rollstream.sandbox_spec",
    "SandboxHandle": "rollstream.sandbox_spec",
    "default_root_dir": "roots",
    "SandboxClient": "sandbox_client",
    "create_sandbox": "lifecycle",
    "destroy_sandbox": "lifecycle",
    "Reaper": "reaper",
    "become_subreaper": "reaper",
    "live_supervisors": "reaper",
    "BashResult": "results",
    "IPythonResult": "results",
    "EditResult": "results",
    "ToolOutput": "results",
    "tool_schemas": "tools",
    "call_tool": "tools",
    "SandboxError": "errors",
    "BackendUnavailable": "errors",
    "SandboxStartError": "errors",
    "SandboxSetupError": "errors",
    "SandboxGone": "errors",
    "ToolError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollstream.sandboxes' has no attribute {name!r}")
    return getattr(
        importlib.import_module(module if module.startswith("rollstream.") else f".{module}", __name__), name
    )


if TYPE_CHECKING:
    from rollstream.sandbox_spec import SandboxHandle, SandboxLimits, SandboxSpec

    from .errors import BackendUnavailable, SandboxError, SandboxGone, SandboxSetupError, SandboxStartError, ToolError
    from .lifecycle import create_sandbox, destroy_sandbox
    from .reaper import Reaper, become_subreaper
    from .results import BashResult, EditResult, IPythonResult, ToolOutput
    from .roots import default_root_dir
    from .sandbox_client import SandboxClient
    from .tools import call_tool, tool_schemas
