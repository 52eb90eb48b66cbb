"""A fake memcached that answers as a test scripts it (tests only; threads, 127.0.0.1).

``ScriptedServer(answer)`` reads request frames and writes back whatever
``answer(opcode, opaque)`` returns (bytes, possibly a broken or mismatched
response); ``trickle`` sends those bytes one at a time, that many seconds apart.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from types import TracebackType

_HEADER = struct.Struct(">BBHBBHIIQ")


def response(
    opcode: int, opaque: int, *, value: bytes = b"", extras: bytes = b"", status: int = 0
) -> bytes:
    """A response frame (magic 0x81)."""
    body = len(extras) + len(value)
    return _HEADER.pack(0x81, opcode, 0, len(extras), 0, status, body, opaque, 1) + extras + value


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


class ScriptedServer:
    def __init__(self, answer: Callable[[int, int], bytes], *, trickle: float = 0.0) -> None:
        self.answer = answer
        self.trickle = trickle
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedServer:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (Linux)
        self._listener.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for thread in self._threads:
            thread.join(timeout=10)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                header = _read_exactly(conn, 24)
                if header is None:
                    return
                _, opcode, _, _, _, _, body, opaque, _ = _HEADER.unpack(header)
                if body and _read_exactly(conn, body) is None:
                    return
                out = self.answer(opcode, opaque)
                if not self.trickle:
                    conn.sendall(out)
                    continue
                for i in range(len(out)):
                    if self._stop.wait(self.trickle):
                        return
                    conn.sendall(out[i : i + 1])
        except OSError:
            return
        finally:
            conn.close()


def elapsed_since(started: float) -> float:
    return time.monotonic() - started
