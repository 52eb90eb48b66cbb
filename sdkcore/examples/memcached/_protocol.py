"""The memcached binary protocol: request frames out, response frames in (no I/O here).

A frame is a 24-byte header, then extras, key and value. Requests carry magic
0x80, responses 0x81; the ``opaque`` field is echoed back, which is how a
pipelined client matches responses to requests. Status codes are the ones the
Couchbase KV protocol kept (``sdkcore.mapping.KvStatus``).
"""

from __future__ import annotations

import struct

import attrs

from sdkcore.mapping import KvOpcode

__all__ = [
    "HEADER",
    "REQUEST_MAGIC",
    "RESPONSE_MAGIC",
    "ProtocolError",
    "Response",
    "add_frame",
    "check_response",
    "counter",
    "delete_frame",
    "get_frame",
    "incr_frame",
    "noop_frame",
    "parse_response",
    "request_frame",
    "set_frame",
]

REQUEST_MAGIC = 0x80
RESPONSE_MAGIC = 0x81
HEADER = 24
_HEADER = struct.Struct(">BBHBBHIIQ")  # magic, opcode, key len, extras len, type, vb/status,
#                                       body len, opaque, cas
_STORE_EXTRAS = struct.Struct(">II")  # flags, expiry
_INCR_EXTRAS = struct.Struct(">QQI")  # delta, initial, expiry
_COUNTER = struct.Struct(">Q")  # the value of a successful INCREMENT/DECREMENT
_MAX_KEY = 250  # memcached's limit
_MAX_BODY = 64 * 1024 * 1024  # a response body larger than this is a broken stream


class ProtocolError(ValueError):
    """The byte stream is not the memcached binary protocol (the connection is unusable)."""


@attrs.frozen(slots=True)
class Response:
    """One response frame."""

    opcode: int
    status: int
    opaque: int
    cas: int
    extras: bytes = b""
    key: bytes = b""
    value: bytes = b""


def _key(key: bytes | str) -> bytes:
    raw = key.encode("utf-8") if isinstance(key, str) else key
    if not isinstance(raw, bytes):
        raise TypeError(f"key must be str or bytes, got {key!r} ({type(key).__name__})")
    if not 0 < len(raw) <= _MAX_KEY:
        raise ValueError(f"key must be 1 to {_MAX_KEY} bytes, got {len(raw)} bytes")
    if any(b <= 0x20 or b == 0x7F for b in raw):
        raise ValueError(f"key must not contain spaces or control characters, got {raw!r}")
    return raw


def request_frame(
    opcode: int,
    opaque: int,
    *,
    key: bytes = b"",
    extras: bytes = b"",
    value: bytes = b"",
    cas: int = 0,
) -> bytes:
    """A request frame (vbucket 0, raw data type)."""
    body = len(extras) + len(key) + len(value)
    header = _HEADER.pack(
        REQUEST_MAGIC, opcode, len(key), len(extras), 0, 0, body, opaque & 0xFFFFFFFF, cas
    )
    return b"".join((header, extras, key, value))


def get_frame(opaque: int, key: bytes | str) -> bytes:
    return request_frame(KvOpcode.GET, opaque, key=_key(key))


def _store(
    opcode: int, opaque: int, key: bytes | str, value: bytes, flags: int, expiry: int
) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    extras = _STORE_EXTRAS.pack(flags, expiry)
    return request_frame(opcode, opaque, key=_key(key), extras=extras, value=bytes(value))


def set_frame(
    opaque: int, key: bytes | str, value: bytes, *, flags: int = 0, expiry: int = 0
) -> bytes:
    return _store(KvOpcode.SET, opaque, key, value, flags, expiry)


def add_frame(
    opaque: int, key: bytes | str, value: bytes, *, flags: int = 0, expiry: int = 0
) -> bytes:
    return _store(KvOpcode.ADD, opaque, key, value, flags, expiry)


def incr_frame(
    opaque: int, key: bytes | str, delta: int = 1, *, initial: int = 0, expiry: int = 0
) -> bytes:
    """INCREMENT: creates the counter at ``initial`` when missing (expiry 0xffffffff: don't)."""
    if not 0 <= delta < 2**64 or not 0 <= initial < 2**64:
        raise ValueError("delta and initial must be in 0..2**64-1")
    extras = _INCR_EXTRAS.pack(delta, initial, expiry)
    return request_frame(KvOpcode.INCREMENT, opaque, key=_key(key), extras=extras)


def delete_frame(opaque: int, key: bytes | str) -> bytes:
    return request_frame(KvOpcode.DELETE, opaque, key=_key(key))


def noop_frame(opaque: int) -> bytes:
    return request_frame(KvOpcode.NOOP, opaque)


def _opcode_name(opcode: int) -> str:
    try:
        return f"{KvOpcode(opcode).name} (opcode 0x{opcode:02x})"
    except ValueError:
        return f"opcode 0x{opcode:02x}"


def check_response(response: Response, opcode: int) -> None:
    """ProtocolError unless ``response`` can answer a request of ``opcode``.

    The opaque matched, so the opcode must too (a GET answered by a SET reply is a
    broken server or stream, not an empty value), and a successful INCREMENT or
    DECREMENT carries the counter: exactly 8 bytes.
    """
    if response.opcode != opcode:
        raise ProtocolError(
            f"expected a response to {_opcode_name(opcode)} for opaque {response.opaque}, "
            f"got a response to {_opcode_name(response.opcode)}"
        )
    if (
        opcode in (KvOpcode.INCREMENT, KvOpcode.DECREMENT)
        and response.status == 0
        and len(response.value) != _COUNTER.size
    ):
        raise ProtocolError(
            f"expected an 8-byte counter in the value of the {_opcode_name(opcode)} response, "
            f"got {len(response.value)} bytes"
        )


def counter(response: Response) -> int:
    """The counter an INCREMENT or DECREMENT response carries (after :func:`check_response`)."""
    return int(_COUNTER.unpack(response.value)[0])


def parse_response(buffer: bytearray) -> Response | None:
    """Take one complete response off the front of ``buffer``; None if it is not all there."""
    if len(buffer) < HEADER:
        return None
    magic, opcode, key_len, extras_len, _type, status, body, opaque, cas = _HEADER.unpack_from(
        buffer
    )
    if magic != RESPONSE_MAGIC:
        raise ProtocolError(f"expected response magic 0x81, got 0x{magic:02x}")
    if body > _MAX_BODY or key_len + extras_len > body:
        raise ProtocolError(
            f"bad response lengths: key {key_len}, extras {extras_len}, body {body}"
        )
    if len(buffer) < HEADER + body:
        return None
    start = HEADER
    extras = bytes(buffer[start : start + extras_len])
    start += extras_len
    key = bytes(buffer[start : start + key_len])
    start += key_len
    value = bytes(buffer[start : HEADER + body])
    del buffer[: HEADER + body]
    return Response(opcode, status, opaque, cas, extras, key, value)
