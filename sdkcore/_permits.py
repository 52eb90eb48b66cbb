"""What both concurrency limiters share: the count, the FIFO queue and the wait (rfc/0009).

A :class:`Permits` counts the dispatches in flight against a cap and keeps the
callers of ``acquire()`` that wait for a permit in arrival order. A permit that is
given back while callers wait is handed to the first of them (the count does not
drop), so nobody barges past the queue and a ``guard()`` never takes a permit that
a queued caller is owed.

Waiting is the only part that knows the event loop: one small waiter per backend
(an asyncio future, a trio event), woken from any thread, bounded by the runtime
layer's deadline scope (``sdkcore._runtime``). Nothing here imports asyncio or
trio until a caller actually waits on one of them.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

from . import _runtime
from ._context import AttemptEffect
from ._errors import RetryableError
from ._reason import RetryReason
from ._request import dispatching
from ._untrusted import show

__all__ = ["LIMITED", "MAX_PERMITS", "Permits", "permits", "text"]

#: The reason of a refusal. ``RetryReason.CONCURRENCY_LIMITED`` (rfc/0009: allows
#: non-idempotent retry, not always retried, not after dispatch) once ``_reason.py``
#: has it; until then SERVICE_NOT_AVAILABLE, the existing reason with those flags.
LIMITED: RetryReason = getattr(
    RetryReason, "CONCURRENCY_LIMITED", RetryReason.SERVICE_NOT_AVAILABLE
)
_NOT_SENT = AttemptEffect.NOT_SENT

#: The most permits (or queued callers) a limiter takes: far past any endpoint.
MAX_PERMITS = 1_000_000_000

#: A queued caller gives up this long before its request's deadline, so the door's
#: own deadline scope never finds it waiting: the attempt ends as a refusal (nothing
#: sent), not as a dispatch cut at the deadline (which may have been applied).
SLACK = max(0.001, time.get_clock_info("monotonic").resolution)


def permits(value: object, what: str, minimum: int) -> int:
    """An int in ``[minimum, MAX_PERMITS]``, else a TypeError/ValueError naming ``what``."""
    allowed = f"an int from {minimum} to {MAX_PERMITS}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be {allowed}, got {show(value)} ({type(value).__name__})")
    if not minimum <= value <= MAX_PERMITS:
        raise ValueError(f"{what} must be {allowed}, got {show(value)}")
    return int(value)


def text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {show(value)} ({type(value).__name__})")
    return value


class Permits:
    """The count of dispatches in flight, its cap, and the queue of ``acquire()`` callers.

    Subclasses set ``_cap`` (the current limit) and build the context managers; every
    field is read and written under ``_lock``, which is never held while a caller's
    code runs or while a waiter is woken.
    """

    __slots__ = (
        "__weakref__",  # a telemetry watch may hold it weakly, as it does breakers
        "_cap",
        "_in_flight",
        "_lock",
        "_max_queued",
        "_name",
        "_telemetry",
        "_waiters",
    )

    def __init__(self, cap: int, max_queued: int, name: str) -> None:
        self._cap = cap
        self._max_queued = max_queued
        self._name = name
        self._in_flight = 0
        self._lock = threading.Lock()
        # arrival order; O(1) removal of a waiter that gives up (cancelled, deadline)
        self._waiters: OrderedDict[Any, None] = OrderedDict()
        self._telemetry: Any = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def in_flight(self) -> int:
        """Permits held now (dispatches let through and not yet ended)."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Callers of ``acquire()`` waiting for a permit now."""
        return len(self._waiters)

    @property
    def max_queued(self) -> int:
        return self._max_queued

    # -- under the lock ---------------------------------------------------------------
    def _hand_over(self) -> list[Any] | None:
        """Give the free permits to the first waiters (under the lock); they are woken after."""
        waiters = self._waiters
        woken: list[Any] | None = None
        while waiters and self._in_flight < self._cap:
            waiter = waiters.popitem(last=False)[0]
            waiter.granted = True
            self._in_flight += 1
            if woken is None:
                woken = [waiter]
            else:
                woken.append(waiter)
        return woken

    # -- outside the lock -------------------------------------------------------------
    def _wake(self, woken: list[Any]) -> None:
        for waiter in woken:
            if not waiter.wake():  # its event loop is gone: the permit comes back
                self._give_back()

    def _give_back(self) -> None:
        """Return one permit that no dispatch will use (and pass it on to a waiter)."""
        with self._lock:
            self._in_flight -= 1
            woken = self._hand_over() if self._waiters else None
        if woken is not None:
            self._wake(woken)

    def _hint(self) -> float | None:
        """``retry_after`` of a refusal: None (nothing measured) unless a subclass knows."""
        return None

    def _refused(self, why: str) -> RetryableError:
        label = f" {self._name}" if self._name else ""
        return RetryableError(
            LIMITED,
            f"concurrency limiter{label}: {why}: nothing was sent",
            effect=_NOT_SENT,
            retry_after=self._hint(),
        )

    def _full(self) -> RetryableError:
        return self._refused(f"{self._in_flight} in flight, limit {self._cap}")

    async def _queue(self) -> int:
        """``acquire()``'s slow path: wait in line for a permit; the in-flight count once held.

        Refused at once when the queue is full or the dispatching request has no time
        left; a wait ends ``SLACK`` before that request's deadline (a refusal) and on
        any cancellation (re-raised). Either way the waiter leaves the queue, and a
        permit handed to it meanwhile goes on to the next in line.
        """
        request = dispatching()
        left = math.inf if request is None else request._left()
        rt = _runtime.current()
        why = None
        with self._lock:
            if self._in_flight < self._cap and not self._waiters:  # freed meanwhile
                self._in_flight += 1
                return self._in_flight
            if len(self._waiters) >= self._max_queued:
                why = (
                    f"{self._in_flight} in flight, limit {self._cap}, "
                    f"{len(self._waiters)} queued (max_queued {self._max_queued})"
                )
            elif left <= SLACK:
                why = f"{self._in_flight} in flight, limit {self._cap}, no time left to queue"
            else:
                waiter = _TrioWaiter() if rt.__name__.endswith("_trio") else _AsyncioWaiter()
                self._waiters[waiter] = None
        if why is not None:
            raise self._refused(why)
        scope = None if left == math.inf else rt.Scope(rt.now() + (left - SLACK))
        try:
            await waiter.wait()
        except BaseException as exc:
            cut = scope is not None and scope.exit(exc)
            with self._lock:
                if waiter.granted:  # handed a permit as the wait ended: pass it on
                    self._in_flight -= 1
                    woken = self._hand_over() if self._waiters else None
                else:
                    self._waiters.pop(waiter, None)
                    woken = None
            if woken is not None:
                self._wake(woken)
            if cut:
                raise self._refused(
                    f"no permit within the request's deadline (limit {self._cap})"
                ) from None
            raise
        if scope is not None and scope.exit(None):  # granted as the deadline passed
            self._give_back()
            raise self._refused(f"no permit within the request's deadline (limit {self._cap})")
        return self._in_flight


def _resolve(future: Any) -> None:
    if not future.done():
        future.set_result(None)


class _AsyncioWaiter:
    """A caller waiting on asyncio: a future of its loop, resolved from any thread."""

    __slots__ = ("future", "granted", "loop", "thread")

    def __init__(self) -> None:
        asyncio = sys.modules["asyncio"]  # the running loop's: loaded
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()
        self.thread = threading.get_ident()
        self.granted = False

    async def wait(self) -> None:
        await self.future

    def wake(self) -> bool:
        if threading.get_ident() == self.thread:
            _resolve(self.future)
            return True
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future)
        except RuntimeError:  # the loop is closed: nobody will take the permit
            return False
        return True


class _TrioWaiter:
    """A caller waiting on trio: an event of its run, set from any thread."""

    __slots__ = ("event", "granted", "thread", "token")

    def __init__(self) -> None:
        trio = sys.modules["trio"]  # the running loop's: loaded
        self.event = trio.Event()
        self.token = trio.lowlevel.current_trio_token()
        self.thread = threading.get_ident()
        self.granted = False

    async def wait(self) -> None:
        await self.event.wait()

    def wake(self) -> bool:
        if threading.get_ident() == self.thread:
            self.event.set()
            return True
        try:
            self.token.run_sync_soon(self.event.set)
        except RuntimeError:  # trio.RunFinishedError: nobody will take the permit
            return False
        return True
