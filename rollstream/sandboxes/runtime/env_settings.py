"""The settings read from ``ROLLSTREAM_*`` environment variables outside ``rollstream.config``:
those of the sandbox runtime, which runs under ``python -S`` with the stdlib alone (no pydantic),
and the node-wide defaults that the layers below ``config`` need (roots, image folders). One
reader and one table of names; ``config.Settings`` reads the rest. Stdlib only."""

from __future__ import annotations

import os
from typing import overload

PREFIX = "ROLLSTREAM_"

# Name after the prefix -> what it sets. Reading a name not listed here is a bug (KeyError).
DOCUMENTED = {
    "API_TOKEN": "the API's bearer token (else ROLLSTREAM_API_TOKEN_FILE, else one made in the data folder)",
    "API_TOKEN_FILE": "a file holding the API's bearer token",
    "BASE_IMAGE": "the image SWE and Harbor environments are built on (localhost/rollstream/python:bookworm)",
    "CGROUP_ROOT": "a delegated cgroup v2 folder for sandboxes when not root",
    "ENV_BUILD_NETWORK": "the network environment image builds use (default)",
    "IMAGES_DIR": "where images go (~/.cache/rollstream/images; as root /var/cache/rollstream/images)",
    "MODEL_CACHE": "where the demo's models are cached (~/.cache/rollstream/models)",
    "SANDBOX_CONTAINER_CAPABILITIES": "capabilities a container sandbox's root may keep where its task asks "
    "(JSON list; default all seven of sandbox_spec.ROOT_TASK_CAPABILITIES; [] drops every one)",
    "SANDBOX_CONFINE": "'off' where another layer enforces the sandbox's limits",
    "SANDBOX_MB_<KIND>": "MB one sandbox of a kind costs where not measured on the node (BASH 7, KERNEL 40)",
    "SANDBOX_ROOT": "where sandbox folders and sockets live (/tmp/rollstream-sb-UID)",
    "SANDBOX_UID_BASE": "the first host uid of the sandboxes' range (1900000000)",
    "SANDBOX_UID_COUNT": "how many host uids the range holds (65536)",
    "SANDBOX_UID_LOCKS": "the node-wide folder of the uid locks (/run/rollstream-uids)",
    "SWE_MIRROR": "the swe task's repository mirror (~/.cache/rollstream/swe-mirror)",
    "SWE_REPORT": "set by eval for the SWE pytest plugin: where it writes each test's outcome",
}


def env_name(name: str) -> str:
    """The variable's full name, for messages that tell the operator what to set."""
    if name not in DOCUMENTED and not any(
        pattern.endswith("<KIND>") and name.startswith(pattern[: -len("<KIND>")]) for pattern in DOCUMENTED
    ):
        raise KeyError(f"{PREFIX}{name} is not a documented setting (runtime/env_settings.py)")
    return PREFIX + name


@overload
def env_setting(name: str) -> str | None: ...
@overload
def env_setting(name: str, default: str) -> str: ...
def env_setting(name: str, default: str | None = None) -> str | None:
    """``$ROLLSTREAM_<name>``, or ``default`` where it is unset or empty."""
    return os.environ.get(env_name(name)) or default
