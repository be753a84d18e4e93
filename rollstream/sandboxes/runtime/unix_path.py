"""Unix socket paths of any length: a sandbox's socket lives in its folder, wherever the
operator put the sandbox root, but the kernel takes at most 107 bytes for a socket address.

A longer path is reached through a descriptor of its folder (`/proc/self/fd/N/name`), which
the kernel resolves like the folder itself; a short path is used as it is.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

MAX_SOCKET_ADDRESS_BYTES = 107


@contextlib.contextmanager
def socket_address(path: str) -> Iterator[str]:
    """An address for bind/connect that names `path`, valid inside the `with` block."""
    if len(os.fsencode(path)) <= MAX_SOCKET_ADDRESS_BYTES:
        yield path
        return
    folder_fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder_fd}/{os.path.basename(path)}"
    finally:
        os.close(folder_fd)


def bind_unix(listener: socket.socket, path: str) -> None:
    with socket_address(path) as address:
        listener.bind(address)


async def open_unix_connection(path: str, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    import asyncio  # loaded already where this runs; the supervisor, which binds, does without (~20 ms)

    with socket_address(path) as address:
        return await asyncio.open_unix_connection(address, **kwargs)
