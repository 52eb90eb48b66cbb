"""What both concurrency limiters share: the permits, the FIFO queue and the wait (rfc/0009).

The free permits are tokens in a list: taking one is ``list.pop()`` and giving one
back ``list.append()``, each a single atomic operation in CPython (one call, under
the GIL; free-threaded builds lock the list for it), so the path of a dispatch that
finds a permit and never waits takes no lock (bench/README, "bench_limiter.py").
A lock serialises everything else: the queue of ``acquire()`` callers, a limit
that moves (an adaptive one), and handing a returned permit to the first caller in
line. Whoever returns a permit appends it first and looks at the queue second, and
a caller that joins the queue looks for a token again once it is in line, so a
permit is never left free while someone waits for it.

Waiting is the only part that knows the event loop: one small waiter per backend
(an asyncio future, a trio event), woken from any thread, bounded by the runtime
layer's deadline scope (``sdkcore._runtime``). Nothing here imports asyncio or
trio; a waiter finds its loop's module loaded.

Refusal episodes: the first refusal after a granted permit logs ``limiter.refusing``,
and the first permit granted ``EPISODE_QUIET`` (1 s) or more after the episode's last
refusal logs ``limiter.recovered`` (the refusals in between, how long they lasted).
Only refusals take the lock for it; a grant reads one flag (``_shedding``), False
unless an episode is open, and during one a clock reading.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import _log, _runtime
from ._context import AttemptEffect
from ._errors import RetryableError
from ._log import EPISODE_QUIET
from ._reason import RetryReason
from ._request import dispatch_unsent, dispatching
from ._untrusted import show

__all__ = ["LIMITED", "MAX_PERMITS", "Permits", "permits", "text"]

#: The reason of a refusal (rfc/0009: allows non-idempotent retry, not always retried,
#: not after dispatch).
LIMITED = RetryReason.CONCURRENCY_LIMITED
_NOT_SENT = AttemptEffect.NOT_SENT

#: The most permits (or queued callers) a limiter takes. A permit is one slot of a
#: list (8 bytes): a million is 8 MB, far past any endpoint's concurrency.
MAX_PERMITS = 1_000_000
TOKEN = True  # what the token list holds

#: A queued caller gives up a tenth of its request's time left before the deadline,
#: at least ``SLACK`` and at most ``MAX_SLACK`` seconds, so that the door's own
#: deadline scope does not find it waiting: the attempt ends as a refusal (nothing
#: sent, an unambiguous timeout), not as a dispatch cut at the deadline (which may
#: have been applied). Both are timers of the same loop: the door's wins only on a
#: loop stalled for longer than the margin (rfc/0009 has the door change that makes
#: it exact).
SLACK = max(0.002, time.get_clock_info("monotonic").resolution)
MAX_SLACK = 0.02


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
    """The permits of one endpoint: free tokens, a debt, and the queue of ``acquire()`` callers.

    ``_tokens`` holds one token per free permit. ``_debt`` counts permits to destroy
    when they come back, after the limit fell below what was in flight; so
    ``in_flight = _cap + _debt - len(_tokens)``. ``_waiters`` holds the queued
    callers in arrival order. Everything but a token's pop and append is done under
    ``_lock``, which is never held while a caller's code runs or a waiter is woken.

    ``_shedding`` is True from a refusal until a permit is granted ``EPISODE_QUIET``
    after the last refusal (``_shed_last``): a refusal episode, ``_shed_count``
    refusals since ``_shed_since`` (``_clock``), all under the lock.
    """

    __slots__ = (
        "__weakref__",  # a telemetry watch may hold it weakly, as it does breakers
        "_cap",
        "_debt",
        "_lock",
        "_max_queued",
        "_name",
        "_shed_count",
        "_shed_last",
        "_shed_since",
        "_shedding",
        "_telemetry",
        "_tokens",
        "_waiters",
    )

    # The clock (seconds, monotonic). Each subclass holds it in a slot of its own: the
    # adaptive limiter reads it twice per dispatch, and a slot of the base class costs it
    # about 50 more instructions per dispatch (CPython 3.11, valgrind).
    _clock: Callable[[], float]

    def __init__(
        self, cap: int, max_queued: int, name: str, clock: Callable[[], float] | None = None
    ) -> None:
        self._clock: Callable[[], float] = time.monotonic if clock is None else clock
        self._shedding = False
        self._shed_count = 0
        self._shed_since = 0.0
        self._shed_last = 0.0
        self._cap = cap
        self._tokens = [TOKEN] * cap
        self._debt = 0
        self._max_queued = max_queued
        self._name = name
        self._lock = threading.Lock()
        # arrival order; O(1) removal of a waiter that gives up (cancelled, deadline)
        self._waiters: OrderedDict[Any, None] = OrderedDict()
        self._telemetry: Any = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def in_flight(self) -> int:
        """Permits held now (dispatches let through and not yet ended): a gauge."""
        held = self._cap + self._debt - len(self._tokens)
        return held if held > 0 else 0

    @property
    def queued(self) -> int:
        """Callers of ``acquire()`` waiting for a permit now."""
        return len(self._waiters)

    @property
    def max_queued(self) -> int:
        return self._max_queued

    # -- giving permits back ------------------------------------------------------------
    def _give_back(self) -> None:
        """Return one permit (and settle the queue and the debt, if any)."""
        self._tokens.append(TOKEN)
        if self._waiters or self._debt:
            self._settle()

    def _settle(self) -> None:
        """A token came back while someone waits or a debt is owed."""
        with self._lock:
            woken = self._settle_locked()
        if woken is not None:
            self._wake(woken)

    def _settle_locked(self) -> list[Any] | None:
        """Pay the debt, then hand free tokens to the first waiters (under the lock)."""
        tokens = self._tokens
        while self._debt:
            try:
                tokens.pop()
            except IndexError:
                return None  # still owed: no token to give a waiter either
            self._debt -= 1
        waiters = self._waiters
        woken: list[Any] | None = None
        while waiters:
            try:
                tokens.pop()
            except IndexError:
                break
            waiter = waiters.popitem(last=False)[0]
            waiter.granted = True
            if woken is None:
                woken = [waiter]
            else:
                woken.append(waiter)
        return woken

    def _resize(self, cap: int) -> None:
        """The limit becomes ``cap`` (under the lock; then ``_settle_locked`` for waiters)."""
        change = cap - self._cap
        self._cap = cap
        if change > 0:
            paid = change if change < self._debt else self._debt
            self._debt -= paid
            if change > paid:
                self._tokens.extend([TOKEN] * (change - paid))
            return
        tokens = self._tokens
        for taken in range(-change):
            try:
                tokens.pop()
            except IndexError:
                self._debt += -change - taken  # in flight: destroyed as they come back
                return

    def _wake(self, woken: list[Any]) -> None:
        for waiter in woken:
            if not waiter.wake():  # its event loop is gone: the permit comes back
                self._give_back()

    # -- refusals ------------------------------------------------------------------------
    def _hint(self) -> float | None:
        """``retry_after`` of a refusal: None (nothing measured) unless a subclass knows."""
        return None

    def _now(self) -> float:
        """The clock for an episode's duration; NaN if it raises (a refusal stays one)."""
        try:
            return self._clock()
        except Exception:
            return math.nan

    def _refused(self, why: str) -> RetryableError:
        telemetry = self._telemetry
        if telemetry is not None:
            telemetry.limiter_rejected(self)
        now = self._now()
        with self._lock:
            first = not self._shedding
            if first:  # an episode starts
                self._shedding = True
                self._shed_count = 0
                self._shed_since = now
            self._shed_count += 1
            self._shed_last = now
        if first:  # an episode starts: a warning, as a breaker opening (rfc/0001, "Levels")
            log = _log.enabled(_log.WARNING)
            if log is not None:
                log.warning(
                    _log.EVENT_LIMITER_REFUSING,
                    limiter=self._name,
                    limit=self._cap,
                    in_flight=self.in_flight,
                    queued=len(self._waiters),
                    **_log.metric_endpoint(self),
                )
        label = f" {self._name}" if self._name else ""
        return RetryableError(
            LIMITED,
            f"concurrency limiter{label}: {why}: nothing was sent",
            effect=_NOT_SENT,
            retry_after=self._hint(),
        )

    def _full(self) -> RetryableError:
        queued = len(self._waiters)
        ahead = f", {queued} queued" if queued else ""
        return self._refused(f"{self.in_flight} in flight, limit {self._cap}{ahead}")

    def _regained(self, undo: Callable[[], None] | None = None) -> None:
        """A permit was granted while ``_shedding`` (its holder has it, the lock is not
        held): the first such grant ends the episode and logs ``limiter.recovered``.

        Should logging raise, the permit is given back (``undo``, default
        :meth:`_give_back`) before the error propagates: the caller's enter fails, and
        nobody else would return it.
        """
        try:
            now = self._now()
            if now - self._shed_last < EPISODE_QUIET:
                return  # refused within the last second: the episode goes on (no lock)
            with self._lock:
                if not self._shedding or now - self._shed_last < EPISODE_QUIET:
                    return  # another grant ended the episode first, or a refusal came
                self._shedding = False
                refused = self._shed_count
                since = self._shed_since
            log = _log.enabled(_log.INFO)
            if log is not None:
                log.info(
                    _log.EVENT_LIMITER_RECOVERED,
                    limiter=self._name,
                    refused=refused,
                    duration_ms=_log.duration_ms(since, now),
                    limit=self._cap,
                    **_log.metric_endpoint(self),
                )
        except BaseException:
            if undo is None:
                self._give_back()
            else:
                undo()
            raise

    # -- waiting -------------------------------------------------------------------------
    def _take_locked(self) -> bool:
        """A permit for a caller nobody is queued ahead of (under the lock)."""
        if self._debt:
            self._settle_locked()  # pay what is owed before anyone takes a token
            if self._debt:
                return False
        try:
            self._tokens.pop()
        except IndexError:
            return False
        return True

    async def _queue(self) -> None:
        """``acquire()``'s slow path: a permit, waiting in line for it if need be.

        Refused at once when the queue is full or the dispatching request has no time
        left; a wait ends just before that request's deadline (a refusal) and on
        any cancellation (re-raised). Either way the waiter leaves the queue, and a
        permit handed to it meanwhile goes on to the next in line. A waiter handed its
        permit takes one checkpoint with it before returning (its ``wait()``), so a
        cancellation requested as the permit arrived cuts it here, not in the caller's
        block.
        """
        request = dispatching()
        # The request's own deadline, not an enclosing cancel scope's: the scope cuts the
        # wait by itself, as the cancellation it catches (a refusal at the scope's time
        # escaped the scope as the request's failure, and a strategy that does not retry
        # CONCURRENCY_LIMITED ended a request with seconds of its own time left).
        left = math.inf if request is None else request._deadline - request._clock()
        rt = _runtime.current()
        why = None
        waiter: Any = None
        woken: list[Any] | None = None
        with self._lock:
            if not self._waiters and self._take_locked():  # freed meanwhile
                pass
            elif len(self._waiters) >= self._max_queued:
                why = (
                    f"{self.in_flight} in flight, limit {self._cap}, "
                    f"{len(self._waiters)} queued (max_queued {self._max_queued})"
                )
            elif left <= SLACK:  # too late to wait for anything
                why = f"{self.in_flight} in flight, limit {self._cap}, no time left to queue"
            else:
                waiter = _TrioWaiter() if rt.__name__.endswith("_trio") else _AsyncioWaiter()
                self._waiters[waiter] = None
                # in line now: a permit returned before this (its giver saw no queue) is
                # still a token, so take it (and the turn of whoever was before us)
                woken = self._settle_locked()
        if why is not None:
            raise self._refused(why)
        if waiter is None:  # a permit freed meanwhile
            if self._shedding:
                self._regained()
            return
        if woken is not None:
            self._wake(woken)
        if waiter.granted:
            if self._shedding:
                self._regained()
            return
        if left == math.inf:
            scope = None
        else:
            margin = 0.1 * left
            margin = SLACK if margin < SLACK else MAX_SLACK if margin > MAX_SLACK else margin
            scope = rt.Scope(rt.now() + (left - margin))
        try:
            await waiter.wait()
        except BaseException as exc:
            cut = scope is not None and scope.exit(exc)
            woken = None
            with self._lock:
                if waiter.granted:  # handed a permit as the wait ended: pass it on
                    self._tokens.append(TOKEN)
                    woken = self._settle_locked()
                else:
                    del self._waiters[waiter]
            if woken is not None:
                self._wake(woken)
            if cut:
                raise self._refused(
                    f"no permit within the request's deadline (limit {self._cap})"
                ) from None
            # Cut while queued (the request's own deadline scope, on a loop too late for
            # the margin above, or the caller): nothing was sent. The dispatch's mark says
            # so, and the door books the attempt not sent when the cancellation reaches
            # it (else it would take it for cut in flight, maybe applied); not booked here:
            # a scope inside ``send`` may catch the cancellation and send after all.
            dispatch_unsent(LIMITED)
            raise
        if scope is not None and scope.exit(None):  # granted as the deadline passed
            self._give_back()
            raise self._refused(f"no permit within the request's deadline (limit {self._cap})")
        if self._shedding:
            self._regained()


def _resolve(future: Any) -> None:
    if not future.done():
        future.set_result(None)


class _AsyncioWaiter:
    """A caller waiting on asyncio: a future of its loop, resolved from any thread."""

    __slots__ = ("future", "granted", "loop", "sleep", "thread")

    def __init__(self) -> None:
        asyncio = sys.modules["asyncio"]  # the running loop's: loaded
        self.sleep = asyncio.sleep
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()
        self.thread = threading.get_ident()
        self.granted = False

    async def wait(self) -> None:
        await self.future
        # One turn of the loop with the permit before the caller's block runs: a
        # cancellation requested after the hand-over cuts it here, and ``_queue`` passes
        # the permit on (trio's wait does the same). Task.cancel() in the turn of the
        # hand-over raises at the await above already; anyio's cancel scopes skip a task
        # whose future is done and cancel it a turn later, here.
        await self.sleep(0)

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

    __slots__ = ("checkpoint", "event", "granted", "thread", "token")

    def __init__(self) -> None:
        trio = sys.modules["trio"]  # the running loop's: loaded
        self.event = trio.Event()
        self.token = trio.lowlevel.current_trio_token()
        self.thread = threading.get_ident()
        self.granted = False
        self.checkpoint = trio.lowlevel.checkpoint

    async def wait(self) -> None:
        await self.event.wait()
        # Setting the event rescheduled this task at once, so a cancellation requested
        # after the hand-over (Request.cancel() in the same turn; a hedge whose winner
        # ended as it gave the permit back, its runner cutting the losers in the next
        # step) would reach it only at the block's first checkpoint, after its code ran:
        # a write, perhaps. One checkpoint with the permit raises it here instead, and
        # ``_queue`` passes the permit on, as asyncio's wait does.
        await self.checkpoint()

    def wake(self) -> bool:
        if threading.get_ident() == self.thread:
            self.event.set()
            return True
        try:
            self.token.run_sync_soon(self.event.set)
        except RuntimeError:  # trio.RunFinishedError: nobody will take the permit
            return False
        return True
