"""The one codec for messages on the wire: pydantic models to msgpack and back. A stream
entry carries the bytes in field ``data``; for operators, a JSON document in field
``json`` is accepted too (``XADD rs:jobs:init * json '{...}'``)."""

from __future__ import annotations

import json
from typing import TypeVar

import msgpack
from pydantic import BaseModel

from rollstream.messages import Envelope, Job

M = TypeVar("M", bound=BaseModel)


class DecodeError(ValueError):
    """The bytes are not a valid message; the text says why."""


def pack(model: BaseModel) -> bytes:
    return msgpack.packb(model.model_dump(mode="python"), use_bin_type=True)


def unpack_raw(data: bytes) -> object:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack ({type(exc).__name__}: {exc})") from exc


def unpack(model: type[M], data: bytes) -> M:
    return model.model_validate(unpack_raw(data))


def fields_payload(fields: dict) -> object:
    """The decoded payload of a stream entry's fields, whichever encoding it used."""
    if b"data" in fields:
        return unpack_raw(fields[b"data"])
    if b"json" in fields:
        try:
            return json.loads(fields[b"json"])
        except (ValueError, UnicodeDecodeError) as exc:
            raise DecodeError(f"field 'json' is not valid JSON: {exc}") from exc
    names = sorted(k.decode(errors="replace") for k in fields)
    raise DecodeError(f"stream entry has fields {names}; expected 'data' (msgpack) or 'json'")


def decode_envelope(fields: dict) -> Envelope:
    """A stage message as an Envelope; a bare Job (e.g. added by hand with redis-cli)
    is wrapped."""
    payload = fields_payload(fields)
    if not isinstance(payload, dict):
        raise DecodeError(f"message is a {type(payload).__name__}, expected a map")
    if "job" in payload:
        return Envelope.model_validate(payload)
    return Envelope(job=Job.model_validate(payload))
