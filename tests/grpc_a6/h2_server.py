"""A minimal scripted HTTP/2 server, for wire-level facts a grpc server cannot produce.

It speaks just enough HTTP/2 for a grpc client on 127.0.0.1 (no TLS, no HPACK
decoding: request headers are not read) and records, per stream, the request
bytes and how the client ended the stream: ``"end_stream"`` (half-close) or
``"rst"`` (the client cancelled). Per stream, in arrival order, the script says:

* ``"respond"``: once the client half-closes, reply ``200`` with one gRPC
  message ``b"ok"`` and ``grpc-status: 0``;
* ``"goaway"``: send GOAWAY naming an earlier last stream id (the stream was
  never seen by the server), then wait for the client to close the connection;
* ``"refuse"``: reset the stream with REFUSED_STREAM.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

_DATA, _HEADERS, _RST, _SETTINGS, _PING, _GOAWAY = 0, 1, 3, 4, 6, 7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_REFUSED_STREAM = 0x7


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream)
        + payload
    )


def _header(name: str, value: str) -> bytes:
    """One HPACK "literal header field without indexing, new name" (short strings only)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes((len(n),)) + n + bytes((len(v),)) + v


class Stream:
    def __init__(self, connection: int, stream_id: int, action: str) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.action = action
        self.data = b""
        self.ended: str | None = None
        self.ended_event = asyncio.Event()


class RawH2Server:
    def __init__(self, script: Callable[[int], str]) -> None:
        self.script = script
        self.streams: list[Stream] = []
        self.port = 0
        self._server: Any = None
        self._connections = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for w in self._writers:
            w.close()
        if self._tasks:
            await asyncio.wait(self._tasks)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.append(task)
        self._connections += 1
        connection = self._connections
        mine: dict[int, Stream] = {}
        try:
            await reader.readexactly(24)  # the client connection preface
            writer.write(_frame(_SETTINGS, 0, 0))
            while True:
                head = await reader.readexactly(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                sid = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = await reader.readexactly(length)
                if kind == _SETTINGS and not flags & _ACK:
                    writer.write(_frame(_SETTINGS, _ACK, 0))
                elif kind == _PING and not flags & _ACK:
                    writer.write(_frame(_PING, _ACK, 0, payload))
                elif kind == _HEADERS and sid not in mine:
                    s = Stream(connection, sid, self.script(len(self.streams) + 1))
                    self.streams.append(s)
                    mine[sid] = s
                    if s.action == "goaway":
                        writer.write(_frame(_GOAWAY, 0, 0, struct.pack(">II", max(sid - 2, 0), 0)))
                    elif s.action == "refuse":
                        writer.write(_frame(_RST, 0, sid, struct.pack(">I", _REFUSED_STREAM)))
                    if flags & _END_STREAM:
                        self._ended(s, "end_stream", writer)
                elif kind == _DATA and sid in mine:
                    s = mine[sid]
                    s.data += payload
                    if flags & _END_STREAM:
                        self._ended(s, "end_stream", writer)
                elif kind == _RST and sid in mine:
                    self._ended(mine[sid], "rst", writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _ended(self, s: Stream, how: str, writer: asyncio.StreamWriter) -> None:
        if s.ended is not None:
            return
        s.ended = how
        s.ended_event.set()
        if how == "end_stream" and s.action == "respond":
            sid = s.stream_id
            headers = _header(":status", "200") + _header("content-type", "application/grpc")
            writer.write(_frame(_HEADERS, _END_HEADERS, sid, headers))
            writer.write(_frame(_DATA, 0, sid, b"\x00" + struct.pack(">I", 2) + b"ok"))
            writer.write(
                _frame(_HEADERS, _END_HEADERS | _END_STREAM, sid, _header("grpc-status", "0"))
            )
