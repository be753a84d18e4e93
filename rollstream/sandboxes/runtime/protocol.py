"""Wire format between sandbox clients and the per-sandbox supervisor.

Each frame is a 4-byte big-endian length followed by one msgpack map. Requests are
`{"id": int, "op": str, "args": map}`, replies `{"id": int, "ok": bool, "result"|"error": ...}`.
Shared by the asyncio client and the threaded supervisor, so it holds only pure helpers.
"""

from __future__ import annotations

import socket
import struct

import msgpack

HEADER = struct.Struct(">I")
# A reply carries at most a capped tool output plus file contents for read_file; 256 MiB
# is far above both and still stops a corrupt length from allocating the machine away.
MAX_FRAME_BYTES = 256 * 1024 * 1024


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def pack(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict:
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


def recv_message(sock: socket.socket) -> dict | None:
    header = recv_exact(sock, HEADER.size)
    if header is None:
        return None
    body = recv_exact(sock, frame_length(header))
    if body is None:
        raise ProtocolError("connection closed between a frame header and its body")
    return unpack(body)


def send_message(sock: socket.socket, message: dict) -> None:
    sock.sendall(pack(message))
