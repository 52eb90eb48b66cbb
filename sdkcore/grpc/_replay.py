"""The replay buffer of a client-streaming call: request messages kept until the call commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ._call import BUFFER_FULL, _Call

__all__: list[str] = []


def _writes(source: Any) -> bool:
    """Whether ``source`` is grpc.aio's own request stream for the ``write()`` API (its
    generator over a one-place queue: ``done_writing()`` is seen only when its end marker
    is read, so until the call commits it is read at once, bounded by the byte limit).
    False if grpc.aio names it otherwise, or an application interceptor ahead of sdkcore's
    wraps it: then it is read as any stream (rfc/0003, "Replay buffering")."""
    code = getattr(source, "ag_code", None)
    return getattr(code, "co_name", "") == "_proxy_writes_as_request_iterator"


#: Messages read from the request iterator that no attempt has sent yet, at most: the
#: read runs that far ahead of the wire (ahead of the furthest any attempt has sent: a
#: retry's replay of messages sent before is not read-ahead), then waits. Read without
#: a bound, an iterator that never awaits (empty messages never fill the byte limit)
#: froze the event loop; read only on demand, or held back while a retry waits, grpc.aio's
#: ``write()`` API saw its ``done_writing()`` late, and a ``write()`` after it was
#: dropped instead of refused: that stream is read without the bound (:func:`_writes`).
READ_AHEAD = 16


class _ReplayBuffer:
    """Request messages of a client-streaming call, kept for replay until commit.

    The application's request iterator is read at most :data:`READ_AHEAD` messages
    ahead of the furthest any attempt has sent (``sent``).
    """

    def __init__(self, c: _Call, source: Any, *, writes: bool = False) -> None:
        """``writes``: ``source`` is the ``write()`` API's stream (read as :func:`_writes`
        says grpc.aio's is)."""
        self.c = c
        self.items: list[Any] = []
        self.base = 0  # absolute index of items[0]
        self.consumed = 0  # absolute index of the next item for the live attempt
        self.sent = 0  # absolute index past the furthest item any attempt has taken
        self.generation = 0
        self.done = False
        #: What the application's request iterator (or message_size) raised, if anything.
        self.error: Exception | None = None
        self.committed = False
        self.event = asyncio.Event()
        #: Wakes the read when an attempt takes a message past ``sent`` (it checks the
        #: count itself: see _wait_for_room).
        self.room = asyncio.Event()
        self.source = source
        self.bounded = not (writes or _writes(source))
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._pump())

    def commit(self) -> None:
        if self.committed:
            return
        self.committed = True
        c = self.c
        c.state.committed = True
        c.release()
        if c.in_backoff:
            # No attempt is live: end the wait now; the call fails with the last error.
            c.request.cancel()
        drop = self.consumed - self.base
        if drop > 0:
            del self.items[:drop]
            self.base = self.consumed

    def _append(self, message: Any) -> None:
        if not self.committed:
            core = self.c.core
            size = core.message_size(message)
            if self.c.buffered + size > core.per_call_buffer_limit or not core._reserve(size):
                self.c.state.commit_why = BUFFER_FULL
                self.commit()
            else:
                self.c.buffered += size
        self.items.append(message)
        self.event.set()

    def detach(self) -> None:
        """The live attempt failed: it takes no more messages, and none count as sent."""
        self.generation += 1
        self.consumed = self.base  # the next attempt replays the buffer first
        self.event.set()

    async def _wait_for_room(self) -> None:
        if not self.bounded and not self.committed:
            # grpc.aio's write() stream before the commit: the byte limit bounds it (past
            # it the call commits), and done_writing() is seen at once. After the commit
            # nothing else would bound it: read ahead as any stream (a review's one-off
            # script measured 600 MiB held for a server that stopped reading).
            return
        while self.base + len(self.items) - self.sent >= READ_AHEAD:  # (base <= sent)
            self.room.clear()
            await self.room.wait()

    async def _pump(self) -> None:
        """Read the request iterator, at most READ_AHEAD messages ahead of the wire."""
        source = self.source
        try:
            if hasattr(source, "__aiter__"):
                iterator = source.__aiter__()
                while True:
                    await self._wait_for_room()
                    try:
                        message = await iterator.__anext__()
                    except StopAsyncIteration:
                        break
                    self._append(message)
            else:
                iterator = iter(source)
                while True:
                    await self._wait_for_room()
                    try:
                        message = next(iterator)
                    except StopIteration:
                        break
                    self._append(message)
        except Exception as exc:
            # Like grpc.aio: the RPC is cancelled (not half-closed). The live attempt's
            # request stream re-raises it; grpc cancels that attempt and logs it.
            self.error = exc
            if self.c.in_backoff:
                self.c.request.cancel()
        finally:
            self.done = True
            self.event.set()

    async def attempt_messages(self) -> AsyncIterator[Any]:
        """The request stream of one attempt: a replay of the buffer, then new messages."""
        self.generation += 1
        generation = self.generation
        i = self.base
        self.consumed = i
        while generation == self.generation:
            k = i - self.base
            if k < len(self.items):
                message = self.items[k]
                i += 1
                self.consumed = i
                if self.committed:
                    del self.items[: i - self.base]
                    self.base = i
                if i > self.sent:  # a message no attempt had taken: one fewer read ahead
                    self.sent = i
                    self.room.set()
                yield message
            elif self.done:
                if self.error is not None:
                    raise self.error
                return
            else:
                self.event.clear()
                await self.event.wait()

    @property
    def source_done(self) -> bool:
        return self.done

    def close(self) -> None:
        self.generation += 1
        task = self.task
        if task is not None and not task.done():
            task.cancel()
