"""A small fault-injecting TCP proxy for the memcached binary protocol (tests only).

It runs an asyncio loop in its own thread, so tests on asyncio, trio or threads
can all put it between a client and a memcached. It forwards whole frames and
counts what reaches the endpoint; knobs (set from the test's thread) make it:

* ``delay``: hold every reply this many seconds;
* ``request_latency``: a callable given each request frame and returning the
  seconds it is held before it goes on to memcached, each on its own timer, so a
  slow request does not hold back the ones behind it (a long-tail server: e.g. 99% of
  requests in 1-2 ms and 1% in 50 ms, drawn per frame). Called on the proxy's thread;
  not used with a capacity;
* ``drop_replies``: swallow every reply (a black hole: the client times out);
* :meth:`black_hole_open`: swallow every reply on the connections open now, while
  new connections work (a connection stuck somewhere on the way);
* ``cut_opcodes`` / ``cut_every``: cut the connection in the middle of every
  ``cut_every``-th reply to one of these opcodes (the request did reach memcached);
* :meth:`limit_capacity`: a server with a fixed capacity: at most ``capacity`` requests
  in service at a time, each for ``service_time`` seconds before it goes on to
  memcached; the others wait in a FIFO queue (work cut by the client is still done,
  as a real server does) or, with ``reject=True``, are answered at once with TMPFAIL
  (status 0x86, what memcached answers when it cannot take a request).

Counters: ``connections`` (accepted), ``refused`` (memcached was not there),
``requests`` (request frames that reached the proxy, by opcode: forwarded, or
read and left unanswered while memcached was not there), ``cuts``; with a capacity,
``served``, ``rejected`` (TMPFAIL answers) and ``peak_busy`` (the most in service at once).
"""

from __future__ import annotations

import asyncio
import collections
import struct
import threading
from collections.abc import Callable, Coroutine
from typing import Any

_HEADER = 24
_BODY = struct.Struct(">I")
_RESPONSE = struct.Struct(">BBHBBHIIQ")
TMPFAIL = 0x86
_TMPFAIL_TEXT = b"Temporary failure"


def tmpfail_reply(request: bytes) -> bytes:
    """A TMPFAIL response to ``request`` (same opcode and opaque)."""
    (opaque,) = _BODY.unpack_from(request, 12)
    header = _RESPONSE.pack(0x81, request[1], 0, 0, 0, TMPFAIL, len(_TMPFAIL_TEXT), opaque, 0)
    return header + _TMPFAIL_TEXT


async def _frame(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(_HEADER)
    (body,) = _BODY.unpack_from(header, 8)
    return header + (await reader.readexactly(body) if body else b"")


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.delay = 0.0
        self.request_latency: Callable[[bytes], float] | None = None
        self.drop_replies = False
        self.cut_opcodes: frozenset[int] = frozenset()
        self.cut_every = 1
        self._lock = threading.Lock()
        self.connections = 0
        self.refused = 0
        self.cuts = 0
        self.requests: collections.Counter[int] = collections.Counter()
        self._replies: collections.Counter[int] = collections.Counter()
        self._open: set[int] = set()
        self._black_holed: set[int] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.capacity = 0  # 0: no limit (set through limit_capacity)
        self.service_time = 0.0
        self.reject = False
        self.served = self.rejected = self.peak_busy = 0
        self._busy = 0
        self._slots: asyncio.Semaphore | None = None
        self._serving: set[asyncio.Future[None]] = set()

    # -- lifecycle (called from the test's thread) ---------------------------------------
    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def start(self) -> FaultProxy:
        self._thread.start()

        async def serve() -> int:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            port: int = self._server.sockets[0].getsockname()[1]
            return port

        self.port = self._call(serve())
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            # A connection accepted just before the close has a handler task that has not
            # taken its first step, and so has not registered its writer: cancelled now,
            # it never would, and its socket would be left to the garbage collector (an
            # "unclosed socket" warning, seen under load). One turn lets each register.
            await asyncio.sleep(0)
            for writer in list(self._writers):
                writer.transport.abort()
            if self._server is not None:
                await self._server.wait_closed()
            # Every task still running (a request queued for a capacity slot, a handler)
            # ends here, on its loop: none is left to be collected after the loop closed.
            current = asyncio.current_task()
            pending = [task for task in asyncio.all_tasks() if task is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        try:
            self._call(close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def cut_all(self) -> None:
        """Abort every open connection now (as a crashed server would)."""

        async def cut() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        self._call(cut())

    def black_hole_open(self) -> None:
        """From now on, swallow every reply on the connections open now (new ones work)."""
        with self._lock:
            self._black_holed |= self._open

    def limit_capacity(self, capacity: int, service_time: float, *, reject: bool = False) -> None:
        """Serve at most ``capacity`` requests at a time, each ``service_time`` s (0: no limit).

        Requests still queued for (or in) the previous capacity are dropped unanswered.
        """

        async def apply() -> None:
            for task in list(self._serving):  # requests still waiting are dropped, unanswered
                task.cancel()
            self.capacity = capacity
            self.service_time = service_time
            self.reject = reject
            self._slots = asyncio.Semaphore(capacity) if capacity else None

        self._call(apply())

    def reset_counts(self) -> None:
        with self._lock:
            self.served = self.rejected = self.peak_busy = 0
            self.connections = self.refused = self.cuts = 0
            self.requests.clear()
            self._replies.clear()

    def counts(self) -> tuple[int, int, dict[int, int]]:
        """``(connections, refused, requests by opcode)``, read together."""
        with self._lock:
            return self.connections, self.refused, dict(self.requests)

    # -- the loop's side --------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self.connections += 1
            number = self.connections
            self._open.add(number)
        self._writers.add(writer)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    "127.0.0.1", self.upstream_port
                )
            except OSError:
                with self._lock:
                    self.refused += 1
                await self._count_unanswered(reader)
                writer.transport.abort()
                return
            self._writers.add(up_writer)
            tasks = [
                asyncio.ensure_future(self._requests(reader, up_writer, writer)),
                asyncio.ensure_future(self._replies_to(up_reader, writer, number)),
            ]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                up_writer.transport.abort()
                self._writers.discard(up_writer)
        finally:
            writer.transport.abort()
            self._writers.discard(writer)
            with self._lock:
                self._open.discard(number)

    async def _count_unanswered(self, reader: asyncio.StreamReader) -> None:
        """memcached is not there: count the frames the client sends, then hang up.

        It waits up to 1 s for the first frame, then reads for at most 20 ms more (a
        pipelined client may have written several), so a dead endpoint answers a
        connection by closing it promptly, as a refused connection would.
        """
        loop = asyncio.get_running_loop()
        try:
            frame = await asyncio.wait_for(_frame(reader), 1.0)
            with self._lock:
                self.requests[frame[1]] += 1
            until = loop.time() + 0.02
            while (left := until - loop.time()) > 0:
                frame = await asyncio.wait_for(_frame(reader), left)
                with self._lock:
                    self.requests[frame[1]] += 1
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
            return

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        up: asyncio.StreamWriter,
        writer: asyncio.StreamWriter | None = None,
    ) -> None:
        try:
            while True:
                frame = await _frame(reader)
                with self._lock:
                    self.requests[frame[1]] += 1
                slots = self._slots
                if slots is not None and writer is not None:
                    if self.reject and self._busy >= self.capacity:
                        with self._lock:
                            self.rejected += 1
                        writer.write(tmpfail_reply(frame))
                        continue
                    task = asyncio.ensure_future(self._serve(slots, frame, up))
                    self._serving.add(task)
                    task.add_done_callback(self._serving.discard)
                    continue
                latency = self.request_latency
                if latency is not None:
                    hold = latency(frame)
                    if hold > 0:
                        asyncio.get_running_loop().call_later(hold, self._forward, up, frame)
                        continue
                up.write(frame)
                await up.drain()
        except (asyncio.IncompleteReadError, OSError):
            return

    @staticmethod
    def _forward(up: asyncio.StreamWriter, frame: bytes) -> None:
        """A request held by ``request_latency`` goes on (a whole frame per write)."""
        if not up.is_closing():
            up.write(frame)

    async def _serve(
        self, slots: asyncio.Semaphore, frame: bytes, up: asyncio.StreamWriter
    ) -> None:
        """One request through the fixed capacity: a slot, the service time, then memcached."""
        self._busy += 1  # counted from here: a request waiting for a slot makes the server busy
        try:
            async with slots:
                with self._lock:
                    self.peak_busy = max(self.peak_busy, min(self._busy, self.capacity))
                await asyncio.sleep(self.service_time)
                if not up.is_closing():
                    up.write(frame)  # a whole frame per write: never interleaved
                with self._lock:
                    self.served += 1
        finally:
            self._busy -= 1

    async def _replies_to(
        self, up: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        try:
            while True:
                frame = await _frame(up)
                if self.drop_replies or number in self._black_holed:
                    continue
                if self.delay:
                    await asyncio.sleep(self.delay)
                opcode = frame[1]
                if opcode in self.cut_opcodes:
                    with self._lock:
                        self._replies[opcode] += 1
                        cut = self._replies[opcode] % self.cut_every == 0
                        if cut:
                            self.cuts += 1
                    if cut:
                        writer.write(frame[: len(frame) // 2])
                        await writer.drain()
                        writer.transport.abort()
                        return
                writer.write(frame)
                await writer.drain()
        except (asyncio.IncompleteReadError, OSError):
            return
