"""The memcached binary codec of the example: frames out, frames in, bad input refused."""

from __future__ import annotations

import struct

import pytest

from sdkcore.examples.memcached import ProtocolError, Response
from sdkcore.examples.memcached import _protocol as proto
from sdkcore.mapping import KvOpcode


def response_bytes(
    opcode: int, status: int, opaque: int, value: bytes = b"", extras: bytes = b""
) -> bytes:
    header = struct.pack(
        ">BBHBBHIIQ", 0x81, opcode, 0, len(extras), 0, status, len(extras) + len(value), opaque, 7
    )
    return header + extras + value


def test_request_frames() -> None:
    frame = proto.set_frame(9, "key", b"value", flags=3, expiry=60)
    magic, opcode, key_len, extras_len, _, _, body, opaque, cas = struct.unpack_from(
        ">BBHBBHIIQ", frame
    )
    assert (magic, opcode, key_len, extras_len, body, opaque, cas) == (
        0x80, KvOpcode.SET, 3, 8, 8 + 3 + 5, 9, 0,
    )  # fmt: skip
    assert frame[24:32] == struct.pack(">II", 3, 60)
    assert frame[32:] == b"keyvalue"
    incr = proto.incr_frame(1, b"n", 5, initial=2)
    assert incr[24:44] == struct.pack(">QQI", 5, 2, 0)
    assert proto.noop_frame(4)[1] == KvOpcode.NOOP
    assert len(proto.noop_frame(4)) == 24


def test_responses_are_taken_whole_from_a_stream() -> None:
    stream = response_bytes(0x00, 0, 1, b"abc", extras=b"\0\0\0\0") + response_bytes(0x0A, 0, 2)
    buffer = bytearray()
    got: list[Response] = []
    for byte in stream:  # one byte at a time: partial frames wait for the rest
        buffer.append(byte)
        response = proto.parse_response(buffer)
        if response is not None:
            got.append(response)
    assert [(r.opcode, r.opaque, r.value, r.extras, r.cas) for r in got] == [
        (0x00, 1, b"abc", b"\0\0\0\0", 7),
        (0x0A, 2, b"", b"", 7),
    ]
    assert buffer == bytearray()


def test_a_broken_stream_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="magic"):
        proto.parse_response(bytearray(b"\x80" + b"\0" * 23))
    bad = bytearray(struct.pack(">BBHBBHIIQ", 0x81, 0, 10, 0, 0, 0, 4, 0, 0))
    with pytest.raises(ProtocolError, match="lengths"):
        proto.parse_response(bad)


@pytest.mark.parametrize(
    ("key", "error"),
    [("", ValueError), ("a b", ValueError), ("k" * 251, ValueError), (5, TypeError)],
)
def test_bad_keys_are_refused(key: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="key"):
        proto.get_frame(1, key)  # type: ignore[arg-type]


def test_store_needs_bytes() -> None:
    with pytest.raises(TypeError, match="value must be bytes"):
        proto.set_frame(1, "k", "text")  # type: ignore[arg-type]
