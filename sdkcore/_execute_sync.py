"""The sync door: ``execute_sync``, the dispatch loop for threads.

The same step after a failure as the async doors (:mod:`sdkcore._core`); the
waits block the calling thread. No lock is held while user code runs (``send``,
the strategy, a sleep): the backpressure count alone is changed under the
orchestrator's lock, one increment at a time.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from . import _failing
from ._action import RetryAction
from ._context import DEFAULT_EFFECT, CancellationReason
from ._core import OrchestratorCore
from ._decision import Verdict
from ._errors import CouchbaseException, RequestCanceledException, RetryableError, final_effect
from ._hooks import INSTANT_DELAYS
from ._log import DEBUG
from ._reason import RetryReason
from ._request import _DISPATCHING, Request, RequestState

__all__ = ["execute_sync"]

T = TypeVar("T")

_PENDING = RequestState.PENDING
_WAIT_MAX = 86400.0  # seconds: the longest single wait of a backoff (see _wait)
_VIA_CONTEXT = CancellationReason.CANCELLED_VIA_CONTEXT


def execute_sync(
    self: OrchestratorCore,
    request: Request,
    send: Callable[[Request], T],
    *,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """:meth:`execute` for synchronous callers (threads): same rules, same errors, same logs.

    ``send(request)`` is a blocking call; it should bound its own I/O by
    ``request.time_left`` (e.g. as a socket timeout), since a thread cannot be
    cancelled. Whatever ``send`` raises once the deadline has passed becomes the
    timeout, a retryable failure included: any other error counts as cut in flight
    (maybe applied); a ``RetryableError`` keeps the effect it reports (a NOT_SENT one
    leaves the timeout unambiguous).
    Backoffs block: by default on an event that ``Request.cancel()`` sets from any
    thread (and a deadline); a ``sleep`` of your own replaces it, and the caller then
    stays blocked until it returns. A backoff on a ``VirtualClock`` for a deadline on
    ``time.monotonic``, or the reverse, is refused at the first wait. Only strategies that
    decide synchronously can be used here (the built-ins, and subclasses that
    override ``decide``); an async one raises TypeError. Safe to call from many
    threads on one orchestrator, and from a strategy or a ``send`` on it: no lock
    is held while user code runs.
    """
    if not isinstance(request, Request):
        raise TypeError(
            f"execute_sync(request, send): request must be an sdkcore.Request, got {request!r}"
        )
    if not callable(send):
        raise TypeError(
            f"execute_sync(request, send): send must be a callable (request) -> result, "
            f"got {send!r}"
        )
    if sleep is not time.sleep and not callable(sleep):
        raise TypeError(
            f"execute_sync(..., sleep) must be a callable (seconds) that blocks, got {sleep!r}"
        )
    if sleep is time.sleep and self._sleep_clock is not None:
        sleep = _virtual_sleep(self, request)
    if request.state is not _PENDING:
        raise _failing.already_completed(request, None)
    if not request._claim_on_threads():  # another call is sending it
        raise _failing.in_use(request, "execute_sync(request, send)")
    trace = token = None
    outer = _DISPATCHING.get()  # the mark before this call's (see Request._dispatch_lost)
    try:
        telemetry = self._telemetry
        if telemetry is not None and request._trace is None:
            trace = telemetry._request_trace(telemetry, request)
        token = request._dispatching()  # requests made inside send keep within this deadline
        if request.clock() < request.deadline:  # expired: nothing is sent, nor paid (_loop)
            self._deposit(request)  # a budget that raises fails the request: recorded below
        result = _loop(self, request, send, sleep, trace, _handled())
    except Exception as exc:
        self._refund_unsent(request)  # a paid retry that never began
        if request.cancellation_reason is _VIA_CONTEXT and not _says_cancelled(exc):
            # Request.cancel() from another thread completed the request between the loop's
            # last look at it and the step that would have (the answer's error, a timeout,
            # a refusal): the caller gets the cancellation, as the request's state says.
            cancelled = _failing.already_completed(request, request.last_reason)
            if trace is not None:
                trace.end(request, cancelled)
            raise cancelled from _failing.cause(request) or exc
        # An error raised between the loop's steps (a log handler that raises, a strategy's
        # answer whose repr raises) ends the request, as execute's; nothing if ended already.
        _failing.finish_by(request, exc)
        if trace is not None:
            trace.end(request, exc)
        raise
    except BaseException as exc:
        # The caller's own interrupt wherever it was raised (the loop ends a request it
        # cuts itself; this one, e.g. between two steps, would stay pending).
        self._refund_unsent(request)  # a paid retry that never began
        _failing.finish_by(request, exc)
        if trace is not None:
            trace.end(request, exc)
        raise
    finally:
        request._sending = False
        if token is not None:
            # Request._dispatched_done, written out: no call (where Python raises a pending
            # KeyboardInterrupt) before the reset, or the mark would stay in the thread.
            token[0] = None
            _DISPATCHING.reset(token[1])
        else:
            Request._dispatch_lost(outer)
    if trace is not None:
        trace.end(request, None)
    return result


#: What interrupts the caller's thread (Ctrl-C, ``sys.exit``): never a retryable failure.
_INTERRUPTS = (KeyboardInterrupt, SystemExit)

#: The exception the calling thread is handling now: ``sys.exception`` (3.11+, 18 ns a call
#: against 61 ns for ``sys.exc_info()[1]``, timeit), once per ``execute_sync`` call.
_handled: Callable[[], BaseException | None] = getattr(sys, "exception", lambda: sys.exc_info()[1])


def _virtual_sleep(self: OrchestratorCore, request: Request) -> Callable[[float], None]:
    """The backoff of ``execute_sync`` on an orchestrator that waits on a virtual clock.

    Its sleep is async, which this door cannot await, and time.sleep would never move
    that clock: a request on it would retry until the end of real time. The clock's
    blocking counterpart waits instead (``VirtualClock.sleep_sync``); at the first
    wait, as the async doors check, the request must run on that clock.
    """
    blocking = getattr(getattr(self._sleep, "__self__", None), "sleep_sync", None)

    def sleep(seconds: float) -> None:
        self._check_clock(request)
        if not callable(blocking):
            raise ValueError(
                f"RetryOrchestrator(sleep={self._sleep!r}) waits on a virtual clock, which "
                "execute_sync cannot await, and its clock has no sleep_sync: pass a "
                "blocking sleep that moves the same clock, execute_sync(request, send, "
                "sleep=...)"
            )
        blocking(seconds)

    sleep.sdkcore_virtual = True  # type: ignore[attr-defined]  # (see _is_virtual)
    return sleep


def _is_virtual(sleep: Callable[[float], Any]) -> bool:
    """A virtual clock's blocking sleep (a ``VirtualClock``'s ``sleep_sync``, or the
    orchestrator's virtual sleep, :func:`_virtual_sleep`): it moves that clock."""
    owner = getattr(sleep, "__self__", None)
    return getattr(owner, "sdkcore_virtual", False) is True or (
        getattr(sleep, "sdkcore_virtual", False) is True
    )


def _says_cancelled(error: Exception) -> bool:
    """``error`` is the RequestCanceledException of a request cancelled via its context."""
    context = getattr(error, "context", None)
    return (
        isinstance(error, RequestCanceledException)
        and context is not None
        and context.cancellation_reason is _VIA_CONTEXT
    )


def _loop(
    self: OrchestratorCore,
    request: Request,
    send: Callable[[Request], T],
    sleep: Callable[[float], Any],
    trace: Any,
    handled: BaseException | None,
) -> T:
    """The attempts. ``handled``: the exception the caller was handling when it called the
    door (a cleanup request in an ``except KeyboardInterrupt``), which is no interrupt of
    this call's even when a failure's ``__context__`` is it."""
    clock = request.clock
    deadline = request.deadline
    while True:
        if clock() >= deadline:
            self._refund_unsent(request)  # a retry booked whose backoff ended past it: not sent
            raise _failing.timed_out(
                request, request.last_reason, _failing.strategy_of(request, self._default), clock()
            ) from _failing.cause(request)
        if not request._begin_attempt_on_threads(clock()):
            # Request.cancel() from another thread since the loop's last look: nothing is sent.
            self._refund_unsent(request)
            raise _failing.already_completed(request, request.last_reason) from _failing.cause(
                request
            )
        try:
            # with telemetry, the attempt in its span (rfc/0008)
            result = send(request) if trace is None else trace.call_sync(send, request)
        except RetryableError as failure:
            cut = _failing.raised_for_cut(failure)
            if isinstance(cut, _INTERRUPTS) and cut is not handled:
                # send turned the caller's interrupt (Ctrl-C) into a retryable failure:
                # never retried (rfc/0001); the attempt it cut is booked as execute books it.
                # Other BaseExceptions (gevent.Timeout, a per-attempt timeout) are send's own.
                raise cut from None
            reason = failure.reason
            failed = failure.__cause__ or failure
            now = clock()
            request._attempt_failed(reason, failure.effect or DEFAULT_EFFECT[reason], failed, now)
            if request.state is not _PENDING:  # Request.cancel() from another thread
                raise _failing.already_completed(request, reason) from failed
            if now >= deadline:  # blocked past the deadline: the timeout, as for any error
                raise _failing.past_deadline(
                    request, reason, self._default, now
                ) from _failing.cause(request)
            _retry(self, request, reason, failed, sleep, failure.retry_after, now)
            continue
        except Exception as exc:
            now = clock()
            if now >= deadline and request.state is _PENDING:
                raise _failing.timed_out(
                    request,
                    request.last_reason,
                    _failing.strategy_of(request, self._default),
                    now,
                    in_flight=True,
                    error=exc,
                ) from exc
            if request.state is not _PENDING:  # Request.cancel() from another thread
                # while the attempt was in flight: its answer (an error) came after the
                # cancel and is dropped; the attempt is booked maybe applied (as execute)
                raise _failing.already_completed(
                    request, request.last_reason, answered=True
                ) from exc
            request._attempt_failed(None, final_effect(exc, request.id), exc, now)
            if isinstance(exc, CouchbaseException):
                _failing.give_context(request, exc)
            request._finish_by(exc)
            raise
        except BaseException as exc:  # the caller's own (a KeyboardInterrupt): in flight
            _failing.finish_by(request, exc)
            raise
        if hasattr(result, "__await__"):
            close = getattr(result, "close", None)
            if close is not None:
                close()  # a coroutine never awaited: no warning, nothing ran
            request._finish(RequestState.FAILED)
            raise TypeError(
                "execute_sync(request, send): send returned an awaitable; use "
                "'await orchestrator.execute(request, send)' for an async send"
            )
        if not request._succeeded():  # Request.cancel() from another thread came first
            raise _failing.already_completed(request, request.last_reason, answered=True)
        return result


def _check_clocks(request: Request, sleep: Callable[[float], Any]) -> None:
    """A backoff that waits on one clock for a deadline on another never meets it: a
    virtual clock's ``sleep_sync`` for a request on the real clock timed it out at once
    ("after 10 retries" in no time), and ``time.sleep`` for a request on a virtual clock
    retried until the end of real time. Refused at the first wait, naming both. Only a
    clock marked ``sdkcore_virtual`` (a ``VirtualClock``) counts: a wrapper of real time
    with the same method names is no mismatch."""
    if request.timeout is None:  # (an inherited deadline: see rfc/0005, "VirtualClock")
        return
    if sleep is time.sleep:
        owner = getattr(request.clock, "__self__", None)
        if getattr(owner, "sdkcore_virtual", False) is True:  # a VirtualClock
            raise ValueError(
                f"request {request.id} ({request.name!r}) runs on the virtual clock "
                f"{request.clock!r}, but execute_sync waits with time.sleep, which never "
                "moves it: pass its blocking sleep, execute_sync(request, send, "
                "sleep=<the clock>.sleep_sync)"
            )
        return
    owner = getattr(sleep, "__self__", None)
    if getattr(owner, "sdkcore_virtual", False) is True and request.clock is time.monotonic:
        raise ValueError(
            f"execute_sync(sleep={sleep!r}) waits on a virtual clock, but request "
            f"{request.id} ({request.name!r}) runs on {request.clock!r}: build the request "
            "with Request(clock=<the same clock>.clock) so its deadline follows the waits"
        )


def _blocking_sleep(sleep: Callable[[float], Any], delay: float) -> None:
    """An injected ``sleep``; one that returned an awaitable never waited (an async
    callable the door's check could not tell, e.g. a lambda returning a coroutine)."""
    slept = sleep(delay)
    if slept is not None and hasattr(slept, "__await__"):
        close = getattr(slept, "close", None)
        if close is not None:
            close()  # never awaited: no warning
        raise TypeError(
            f"execute_sync(..., sleep={sleep!r}) returned {type(slept).__name__}, an "
            "awaitable: the backoff never waited. sleep must block (e.g. time.sleep); "
            "use 'await orchestrator.execute(...)' for an async sleep"
        )


class _Wake:
    """The cancel hook of a request waiting in ``execute_sync``'s backoff: an event
    ``Request.cancel()`` sets from any thread."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def cancel(self) -> None:
        self.event.set()


def _wait(request: Request, delay: float) -> None:
    """Block for ``delay`` seconds, or until ``Request.cancel()`` (the caller then finds
    the request cancelled). An event per backoff: retries only, never a first attempt."""
    wake = _Wake()
    previous = request._set_cancel_hook(wake)
    try:
        if request.state is _PENDING:  # cancelled before the hook was set: no wait
            # A day at most per wait: Event.wait raises OverflowError past
            # threading.TIMEOUT_MAX (a delay RetryAction accepts), so a longer one waits again.
            while delay > _WAIT_MAX:
                if wake.event.wait(_WAIT_MAX):
                    return
                delay -= _WAIT_MAX
            wake.event.wait(delay)
    finally:
        request._set_cancel_hook(previous)


def _retry(
    self: OrchestratorCore,
    request: Request,
    reason: RetryReason,
    failure: BaseException,
    sleep: Callable[[float], Any],
    hint: float | None,
    now: float,
) -> None:
    """Decide and wait one retry on the calling thread (raises when not retried)."""
    _, strategy, decides, gate = request._resolved_by(self, self._resolve)
    action = self._ask(request, reason, strategy, decides)
    if type(action) is not RetryAction and hasattr(action, "__await__"):
        close = getattr(action, "close", None)
        if close is not None:
            close()  # never awaited: no warning
        method = _failing.asked(strategy)
        name = _failing.strategy_name(strategy)
        fix = (
            "Make its decide a plain def"
            if method == "decide"
            else "Use a built-in strategy, override its decide(request, reason) instead"
        )
        error = TypeError(
            f"execute_sync needs a synchronous RetryStrategy; {name}.{method} returned an "
            f"awaitable, deciding on {_failing.strategy_failed_on(request, reason)}. "
            f"{fix}, or 'await orchestrator.execute(...)'"
        )
        # failed as for a strategy's wrong answer: the request, and retry.strategy_failed
        _failing.strategy_failed(request, reason, name, error, raised=False)
        raise error
    try:
        # in the try: an interrupt anywhere after _decide_on_threads counted the request
        # reaches the finally below, which gives the count back once (request._counted)
        verdict, delay = self._settle(
            request, reason, action, strategy, gate(DEBUG), failure, hint, now, threads=True
        )
        # A virtual clock's sleep waits under instant_retries() too: it is what moves that
        # clock to the request's timeout, as on the async doors.
        if delay > 0.0 and (not INSTANT_DELAYS.get() or _is_virtual(sleep)):
            _check_clocks(request, sleep)
            if sleep is time.sleep:
                _wait(request, delay)  # Request.cancel() from another thread wakes it
            else:
                _blocking_sleep(sleep, delay)
    except BaseException as exc:
        self._refund_unsent(request)
        _failing.finish_by(request, exc)
        raise
    finally:
        # _leave_backoff(request, threads=True), written out: a Python call's entry is where
        # a pending interrupt is raised, before its decrement
        with self._lock:
            if request._counted:
                request._counted = False
                self._in_retry_sync -= 1
    if verdict is not Verdict.RETRY or request.state is not _PENDING:
        # Request.cancel() from another thread, or a backoff capped at the deadline
        self._refund_unsent(request)
        _failing.after_backoff(request, verdict, reason, strategy)
