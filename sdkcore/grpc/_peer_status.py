"""A request-streaming call's status as the server sent it, not grpc.aio's stand-in.

When the server ends a client-streaming or bidirectional call while grpc.aio is
writing one of its messages, the write fails in core and grpc.aio's writer marks the
call INTERNAL "Internal error from Core" (debug string ``Failed "execute_batch"``).
The server's status and that stand-in race (grpcio 1.85; 6-8% of calls the server
ends at once, on loopback: bench/bench_write_race.py):

* the stand-in first: grpc.aio runs the call's done callbacks on it, then the
  server's status replaces it within a few loop iterations without running them
  again (or never, when core holds it behind messages nobody reads: sdkcore's
  streams read on past the stand-in, ``_streaming._RetryingCall._read``);
* the server's status first: done callbacks see it, then the stand-in overwrites it
  (about 5% of such calls), and the application reading the call afterwards gets
  INTERNAL.

A retry decision, a throttle's or limiter's record, a metric, or the error handed to
the application would then say INTERNAL where the server said, e.g., UNAVAILABLE
(retryable) or RESOURCE_EXHAUSTED (an overload answer). :class:`PeerStatus` watches
one attempt's call from the moment sdkcore holds it: it keeps the first status that
is not the stand-in, waiting a little for the server's when the stand-in came first
(``_WAITS``); :func:`watch` gives the one watcher of a call. :meth:`PeerStatus.error`
puts an error status of the server's in place of the stand-in a read or await raised
(not an OK: a client-streaming call's await that failed so has lost the answer);
:meth:`PeerStatus.server_status` gives the server's status, OK included, for the
accounting and the end of a stream (rfc/0009, "On gRPC channels").
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import grpc
from grpc import aio
from grpc._common import CYGRPC_STATUS_CODE_TO_STATUS_CODE
from grpc._cython import cygrpc

__all__: list[str] = []

_INTERNAL = cygrpc.StatusCode.internal
_OK = cygrpc.StatusCode.ok
#: The start of the debug string grpc.aio gives its stand-in (``str(ExecuteBatchError)``).
_FAILED_WRITE = 'Failed "execute_batch"'
#: How long (seconds, one after the other) a stand-in that came first waits for the
#: server's status to replace it: measured within 0.1 ms and 2-4 loop iterations on an
#: idle machine, up to 13 ms beside two CPU-bound processes. Past ~0.11 s the stand-in
#: is taken as the call's status: a server's status behind messages nobody reads never
#: comes (core gives a client the status after its messages), and a permit is not held
#: longer for it. The last checks are loop iterations: a loop that stalled past the
#: long wait runs grpc.aio's status step before the answer.
_WAITS = (0.0, 0.0, 0.0, 0.0, 0.001, 0.01, 0.1, 0.0, 0.0, 0.0, 0.0)
#: The watcher of each call being watched (one per call: the channel's gate and the
#: streaming call read the same status).
_WATCHED: weakref.WeakKeyDictionary[Any, PeerStatus] = weakref.WeakKeyDictionary()


def is_ok(status: Any) -> bool:
    """Whether ``status`` (grpc.aio's ``AioRpcStatus``) is an OK."""
    return bool(status.code() == _OK)


def watch(call: Any) -> PeerStatus:
    """The :class:`PeerStatus` of ``call``: one per call, made on first use (from the
    moment sdkcore holds the call)."""
    try:
        peer = _WATCHED.get(call)
    except TypeError:  # not weakly referable: a watcher of its own
        return PeerStatus(call)
    if peer is None:
        peer = _WATCHED[call] = PeerStatus(call)
    return peer


def stand_in_error(err: aio.AioRpcError) -> bool:
    """Whether ``err``, raised by a read or await of a call, is grpc.aio's stand-in."""
    return err.code() is grpc.StatusCode.INTERNAL and str(err.debug_error_string()).startswith(
        _FAILED_WRITE
    )


def stand_in(status: Any) -> bool:
    """Whether ``status`` (grpc.aio's ``AioRpcStatus``) is the stand-in for a failed write."""
    try:
        return bool(
            status.code() == _INTERNAL and status.debug_error_string().startswith(_FAILED_WRITE)
        )
    except Exception:  # not grpc.aio's status object: the server's
        return False


class PeerStatus:
    """The status one grpc.aio call ended with, the server's where grpc.aio's writer
    put its stand-in in place of it (see the module's text).

    ``status`` is None until it is known, and stays None for a call that is not
    grpc.aio's own (an application interceptor's object): its own accessors then tell.
    """

    __slots__ = ("_listeners", "_tries", "known", "status")

    def __init__(self, call: Any) -> None:
        self.status: Any = None
        self.known = False
        self._listeners: list[Callable[[Any], None]] = []
        self._tries = 0
        if getattr(call, "_cython_call", None) is None:
            self._settle(None)
            return
        try:
            call.add_done_callback(self._ended)
        except Exception:  # grpc.aio's internals moved: its own accessors tell
            self._settle(None)

    def _ended(self, call: Any) -> None:
        if self.known:
            return  # a grpc.aio that runs done callbacks again for the replacement
        status = call._cython_call._status
        if not stand_in(status) or self._tries == len(_WAITS):
            self._settle(status)
            return
        delay = _WAITS[self._tries]
        self._tries += 1
        asyncio.get_running_loop().call_later(delay, self._ended, call)

    def _settle(self, status: Any) -> None:
        self.status = status
        self.known = True
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(status)

    def when_known(self, listener: Callable[[Any], None]) -> None:
        """Call ``listener(status)`` once the status is known (now, if it is)."""
        if self.known:
            listener(self.status)
        else:
            self._listeners.append(listener)

    async def error(self, err: aio.AioRpcError, call: Any = None) -> aio.AioRpcError:
        """``err``, raised by a read or an await of the call; the server's status in its
        place when ``err`` is grpc.aio's stand-in and the server's status is an error.

        An OK from the server cannot be put in its place: the await of a client-streaming
        call that failed so has lost the answer (a read goes on past it, ``_streaming``).
        The application gets the stand-in, as from grpc.aio, and the retry loop sees it.
        """
        status = await self.server_status(err, call)
        if status is None or is_ok(status):
            return err
        return error_of(status, err)

    async def server_status(self, err: aio.AioRpcError, call: Any = None) -> Any:
        """The server's status (grpc.aio's ``AioRpcStatus``, OK included) if ``err``, what
        the call reads, is grpc.aio's stand-in and the server's is known (waits for it);
        else None: ``err`` stands.

        ``call``: the watched call, looked at again when the wait ended on the stand-in:
        core gives the server's status once the messages before it are read, which a slow
        reader may do long after (the status then replaces the stand-in, no callback)."""
        if not stand_in_error(err):
            return None
        if not self.known:
            settled = asyncio.get_running_loop().create_future()

            def wake(_: Any) -> None:
                if not settled.done():  # the awaiting task may have been cancelled
                    settled.set_result(None)

            self.when_known(wake)
            await settled
        status = self.status
        if stand_in(status) and call is not None:
            now = getattr(getattr(call, "_cython_call", None), "_status", None)
            if now is not None and not stand_in(now):
                status = self.status = now
        return None if status is None or stand_in(status) else status


def error_of(status: Any, err: aio.AioRpcError) -> aio.AioRpcError:
    """The server's ``status`` as an error, with ``err``'s initial metadata."""
    return aio.AioRpcError(
        CYGRPC_STATUS_CODE_TO_STATUS_CODE[status.code()],
        err.initial_metadata(),
        aio.Metadata.from_tuple(status.trailing_metadata()),
        status.details(),
        status.debug_error_string(),
    )
