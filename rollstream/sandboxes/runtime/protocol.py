"""Wire format between sandbox clients and the per-sandbox supervisor.

Each frame is a 4-byte big-endian length followed by one msgpack map. Requests are
`{"id": int, "op": str, "args": map}` (``Request``), replies `{"id": int, "ok": bool,
"result"|"kind"+"error": ...}` (``Reply``); each op's result has a type of its own below.
Shared by the asyncio client and the threaded supervisor (which runs with ``python -S``), so it
holds only pure helpers and stdlib types: TypedDicts, plain dicts on the wire.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Literal, TypedDict

import msgpack

HEADER = struct.Struct(">I")
# A reply carries at most a capped tool output plus file contents for read_file; 256 MiB
# is far above both and still stops a corrupt length from allocating the machine away.
MAX_FRAME_BYTES = 256 * 1024 * 1024


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


# What the supervisor serves (runtime/supervisor.py dispatches on it).
Op = Literal["ping", "bash", "ipython", "edit", "write_file", "read_file", "close_session", "info", "shutdown"]


class Request(TypedDict):
    id: int
    op: Op
    args: dict[str, Any]  # the op's keyword arguments; a None one is left out


class Reply(TypedDict, total=False):
    id: int | None  # the request's; None for a request that named none
    ok: bool
    result: Any  # when ok: the op's result, one of the types below
    kind: str  # when not ok: the error's class name (BadRequest, EditorError, SessionBusy, ...)
    error: str


class PingResult(TypedDict):
    pid: int


class BashResult(TypedDict):
    output: bytes  # as the pty gave it
    exit_code: int | None
    timed_out: bool
    interrupted: bool
    truncated: bool
    total_bytes: int
    duration_ms: float
    note: str


class IPythonResult(TypedDict):
    stdout: str
    stderr: str
    result: str | None
    error: str | None
    images_png_b64: list[str]
    execution_count: int | None
    timed_out: bool
    interrupted: bool
    truncated: bool
    duration_ms: float
    note: str


class EditResult(TypedDict):
    output: str


class WriteFileResult(TypedDict):
    bytes: int


class ReadFileResult(TypedDict):
    data: bytes


class CloseSessionResult(TypedDict):
    closed: bool


class InfoResult(TypedDict):
    pid: int
    sessions: list[str]
    terminals: dict[str, str]
    kernel_alive: bool
    uptime_s: float
    disk_exceeded: bool
    limits: dict[str, str]


def request(request_id: int, op: Op, args: dict[str, Any]) -> Request:
    """A request frame's map; arguments that are None are left out (the supervisor's defaults)."""
    return {"id": request_id, "op": op, "args": {k: v for k, v in args.items() if v is not None}}


def pack(message: Request | Reply | dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False)
    except Exception as error:  # ExtraData, FormatError, StackError, invalid UTF-8 in a str
        raise ProtocolError(f"the frame is not valid msgpack: {error}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"expected a msgpack map, got {type(message).__name__}")
    return message


def frame_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return length


def recv_exact(sock: socket.socket, size: int) -> bytes | None:
    """Read exactly `size` bytes; None when the peer closed before sending any."""
    chunks = []
    remaining = size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            if remaining == size:
                return None
            raise ProtocolError("connection closed in the middle of a frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    header = recv_exact(sock, HEADER.size)
    if header is None:
        return None
    body = recv_exact(sock, frame_length(header))
    if body is None:
        raise ProtocolError("connection closed between a frame header and its body")
    return unpack(body)


def send_message(sock: socket.socket, message: Request | Reply | dict[str, Any]) -> None:
    sock.sendall(pack(message))
