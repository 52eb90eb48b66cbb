"""A real memcached for the demo: a launcher and a counting proxy (loopback only).

:class:`MemcachedProcess` starts ``memcached`` on 127.0.0.1 and a free port and
can kill and restart it on the same port; its processes are always killed when
its ``async with`` ends, whatever ends it (an error, a cancellation, Ctrl-C).
Where ``setpriv`` is available the process also gets the parent-death signal, so
it does not outlive the demo even when the demo itself is killed.

:class:`CountingProxy` sits in front of one memcached, in the caller's event
loop (anyio: asyncio or trio). It forwards whole binary-protocol frames and
counts the request frames that reach the endpoint, by opcode. While memcached is
down it accepts connections, counts the frames the client writes and hangs up,
so the frames sent into a dead endpoint are counted too.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from types import TracebackType

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = ["INSTALL", "CountingProxy", "MemcachedProcess", "memcached_binary"]

#: How to get memcached (Debian and Ubuntu; other distributions have a package too).
INSTALL = "apt-get install memcached"
#: A safety net on every wait for the process, not a timing claim.
START_TIMEOUT = 10.0

_HEADER = 24
_BODY = struct.Struct(">I")  # total body length, at offset 8 of the header
_GONE = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)


def memcached_binary(which: Callable[[str], str | None] | None = None) -> str | None:
    """The path of ``memcached`` on PATH (``which``: default ``shutil.which``), or None."""
    return (shutil.which if which is None else which)("memcached")


def memcached_version(binary: str) -> str:
    """``memcached -V``'s version (e.g. ``1.6.18``), or ``"?"``."""
    try:
        done = subprocess.run(
            [binary, "-V"], capture_output=True, timeout=START_TIMEOUT, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    words = done.stdout.decode(errors="replace").split()
    return words[-1] if len(words) >= 2 else "?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class MemcachedProcess:
    """One memcached on 127.0.0.1:``port`` (binary protocol, 1 thread, 16 MB, no UDP).

    ``async with MemcachedProcess(binary) as server:`` starts it and kills it at the
    end. :meth:`kill` and :meth:`start` kill and restart it on the same port.
    """

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The process id while started (None after :meth:`kill`)."""
        return None if self._process is None else self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "-l", "127.0.0.1",
            "-p", str(self.port),
            "-U", "0",  # no UDP
            "-B", "binary",
            "-t", "1",
            "-m", "16",
        ]  # fmt: skip
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command += ["-u", "root"]  # memcached refuses to run as root without -u
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # Linux: killed with the process that started it
            command = [setpriv, "--pdeathsig", "KILL", "--", *command]
        return command

    async def start(self) -> MemcachedProcess:
        """Start it (again) and wait until it listens (RuntimeError if it does not)."""
        if self.running:
            return self
        # In the demo's own process group: a Ctrl-C in the terminal reaches it too.
        # Spawned from this (the event loop's) thread on purpose: the parent-death
        # signal follows the thread that forked, and a fork+exec takes milliseconds.
        self._process = process = subprocess.Popen(  # noqa: ASYNC220
            self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                self.kill()
                raise RuntimeError(f"memcached exited at start ({process.returncode}): {err}")
            try:
                stream = await anyio.connect_tcp("127.0.0.1", self.port)
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"memcached did not listen on {self.port}") from None
                await anyio.sleep(0.01)
            else:
                await stream.aclose()
                return self

    def kill(self) -> None:
        """Kill it now (SIGKILL: a crash, not a shutdown) and reap it."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait(timeout=START_TIMEOUT)
        if process.stderr is not None:
            process.stderr.close()

    async def __aenter__(self) -> MemcachedProcess:
        try:
            return await self.start()
        except BaseException:
            self.kill()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


async def _frame(reader: BufferedByteReceiveStream) -> bytes:
    header = await reader.receive_exactly(_HEADER)
    (body,) = _BODY.unpack_from(header, 8)
    return header + (await reader.receive_exactly(body) if body else b"")


class CountingProxy:
    """Forwards whole frames to memcached on ``upstream_port``; counts what reaches it.

    Run it with ``port = await task_group.start(proxy.serve)``; cancel the task
    group to stop it. ``frames`` counts request frames by opcode (forwarded, or read
    and left unanswered while memcached was down); ``connections`` and ``refused``
    (memcached was not there) count connections.
    """

    #: How long a connection to a dead endpoint is read before the proxy hangs up.
    LINGER = 0.02

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.frames: collections.Counter[int] = collections.Counter()
        self.connections = 0
        self.refused = 0

    def snapshot(self) -> dict[int, int]:
        """The frames counted so far, by opcode."""
        return dict(self.frames)

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener:
            self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
            task_status.started(self.port)
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.connections += 1
        reader = BufferedByteReceiveStream(client)
        async with client:
            try:
                upstream = await anyio.connect_tcp("127.0.0.1", self.upstream_port)
            except OSError:
                self.refused += 1
                await self._count_unanswered(reader)
                return
            async with upstream, anyio.create_task_group() as tg:

                async def requests() -> None:
                    try:
                        while True:
                            frame = await _frame(reader)
                            self.frames[frame[1]] += 1
                            await upstream.send(frame)
                    except _GONE:
                        pass
                    tg.cancel_scope.cancel()

                async def replies() -> None:
                    try:
                        async for chunk in upstream:
                            await client.send(chunk)
                    except _GONE:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(requests)
                tg.start_soon(replies)

    async def _count_unanswered(self, reader: BufferedByteReceiveStream) -> None:
        """memcached is not there: count what the client writes, then hang up promptly."""
        try:
            with anyio.move_on_after(1.0):
                frame = await _frame(reader)
                self.frames[frame[1]] += 1
                with anyio.move_on_after(self.LINGER):  # a pipelined client may write more
                    while True:
                        frame = await _frame(reader)
                        self.frames[frame[1]] += 1
        except _GONE:
            return
