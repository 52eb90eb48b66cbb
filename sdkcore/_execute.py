"""The async doors: ``execute`` (the dispatch loop), ``maybe_retry`` and ``attempt``.

Each door runs the shared step of :mod:`sdkcore._core` after a failed attempt and
waits through the runtime layer (:mod:`sdkcore._runtime`). These functions are the
methods of :class:`sdkcore.RetryOrchestrator` (bound there by name).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Generator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from . import _failing, _runtime
from ._action import RetryAction
from ._context import DEFAULT_EFFECT, AttemptEffect, CancellationReason
from ._core import OrchestratorCore
from ._decision import Verdict
from ._duration import to_seconds
from ._errors import (
    CouchbaseException,
    RetryableError,
    TimeoutException,
    final_effect,
    sent_nothing,
)
from ._hooks import INSTANT_DELAYS
from ._log import DEBUG as _DEBUG
from ._reason import RetryReason, suggest_member
from ._request import _DISPATCHING, Request, RequestState

if TYPE_CHECKING:  # made through the Telemetry (``import sdkcore`` does not load it)
    from ._telemetry import RequestTrace

__all__ = ["attempt", "execute", "maybe_retry"]

T = TypeVar("T")

_PENDING = RequestState.PENDING
_RETRY = Verdict.RETRY
_MAYBE = AttemptEffect.MAYBE_APPLIED
_NOT_SENT = AttemptEffect.NOT_SENT
_TIMEOUT = CancellationReason.TIMEOUT
_INF = math.inf
_MONOTONIC = time.monotonic


def _unsent_cut(request: Request, mark: Any, exc: BaseException) -> None:
    """A cancellation reaching the door from a dispatch cut before it sent anything (a
    limiter's queue: :func:`sdkcore._request.dispatch_unsent` set the mark): the attempt
    in flight is booked not sent, so that the door does not take it for cut in flight."""
    if (
        mark is not None
        and Request._dispatch_was_unsent(mark, exc)
        and request.in_flight
        and not isinstance(exc, Exception)
    ):
        reason = Request._dispatch_unsent_reason(mark)
        request._attempt_failed(reason, _NOT_SENT, None, request.clock())


def _callers_cut(error: BaseException, scope: Any) -> BaseException | None:
    """The caller's cancellation ``error`` stands for: raised for a cancellation while the
    caller is being cancelled since ``scope`` opened, not by it (see
    :func:`_converted_cut`). Else None."""
    cut = _failing.raised_for_cut(error)
    if cut is None or scope.fired or not scope.cancelled_elsewhere():
        return None
    return cut


def _converted_cut(request: Request, failure: RetryableError, scope: Any) -> None:
    """Raise the cancellation ``failure`` stands for, if ``send`` raised it while handling
    one (its ``__context__``): cancellation is never retried (rfc/0001). Returns when it
    is an answer.

    Cut by ``execute``'s own scope (the deadline, ``Request.cancel()``): ``failure``
    itself goes on to the door's end, which reports the cut with the attempt in flight,
    as ``attempt()`` does (a refusal that sent nothing, a limiter's queue, booked not
    sent). The caller being cancelled since the scope opened (asyncio 3.11+ counts it,
    trio's enclosing scopes): that cancellation. A cancellation already being handled
    when the door began (a cleanup request in an ``except CancelledError``) is neither,
    nor is an answer raised after a cut it never met (trio runs a woken task on).
    """
    if scope.fired and _failing.raised_for_cut(failure) is not None:
        if sent_nothing(failure):
            request._attempt_failed(failure.reason, _NOT_SENT, failure, request._clock())
        raise failure
    cut = _callers_cut(failure, scope)
    if cut is not None:
        raise cut from None


def _check_request(request: object, door: str) -> None:
    if not isinstance(request, Request):
        raise TypeError(f"{door}: request must be an sdkcore.Request, got {request!r}")


def _scope_fired(
    self: OrchestratorCore, request: Request, error: BaseException | None, *, in_flight: bool
) -> BaseException:
    """The exception for a request whose deadline scope fired (or ``Request.cancel()``)."""
    if request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT:
        return _failing.already_completed(request, request.last_reason, cut=in_flight)
    if error is not None and not isinstance(error, Exception):
        # the cancellation itself: not the attempt's failure; but what a task of the
        # attempt's nursery raised beside it for the cut (trio's group) is
        parts = _failing.split_cut(error)
        error = None if parts is None else parts[0]
    return _failing.timed_out(
        request,
        request.last_reason,
        _failing.strategy_of(request, self._default),
        request.clock(),
        in_flight=in_flight,
        error=error,
    )


async def _awaited(
    request: Request, reason: RetryReason, answer: Any, strategy: Any, scope: Any
) -> Any:
    """An async strategy's answer, awaited within ``execute``'s deadline ``scope``: its
    failure is the strategy's, unless the scope cut it (the deadline or Request.cancel(),
    turned into an error by the strategy's I/O): ``execute`` then reports the cut."""
    try:
        action = await answer
    except Exception as exc:
        if not scope.fired:
            _failing.strategy_failed(request, reason, _failing.strategy_name(strategy), exc)
        raise
    if request.state is not _PENDING:  # Request.cancel() while the strategy ran
        raise _failing.already_completed(request, reason) from _failing.cause(request)
    return action


async def _injected_wait(self: OrchestratorCore, request: Request, rt: Any, delay: float) -> None:
    """An injected ``sleep`` (e.g. a VirtualClock's), else ``instant_retries()``'s one
    checkpoint. A virtual clock's sleep wins: it is what moves that clock, so under
    ``instant_retries()`` a request on a VirtualClock still reaches its timeout; an
    injected sleep of real time does not (every delay is waited as zero there)."""
    if self._sleep is None or (self._sleep_clock is None and INSTANT_DELAYS.get()):
        await rt.sleep(0)
    else:
        waiter = self._sleep(delay)
        try:
            await waiter
        except TypeError:
            if hasattr(waiter, "__await__"):
                raise  # the sleep's own TypeError
            raise TypeError(
                f"RetryOrchestrator(sleep={self._sleep!r}) returned {type(waiter).__name__}, "
                "not an awaitable; sleep must be an async callable (seconds), e.g. "
                "asyncio.sleep or a VirtualClock's sleep"
            ) from None


async def _cancellable_wait(
    self: OrchestratorCore, request: Request, rt: Any, delay: float
) -> None:
    """A backoff ``Request.cancel()`` wakes when no deadline scope is armed (``execute``
    without a deadline, ``maybe_retry``): a scope without a deadline, for that wait only;
    the caller then finds the request cancelled. Apart from ``execute`` so that its frame
    holds no more locals."""
    scope = rt.Scope(_INF)
    previous = request._set_cancel_hook(scope)
    try:
        if self._sleep is None and not INSTANT_DELAYS.get():
            await rt.sleep(delay)
        else:
            await _injected_wait(self, request, rt, delay)
    except BaseException as exc:
        request._set_cancel_hook(previous)
        if not scope.exit(exc):
            raise  # not ours: the caller's cancellation, or the wait's own error
    else:
        request._set_cancel_hook(previous)
        scope.exit(None)


async def execute(
    self: OrchestratorCore, request: Request, send: Callable[[Request], Awaitable[T]]
) -> T:
    """Run ``send(request)`` attempt by attempt until it returns, then return its result.

    ``send`` reports a retryable failure by raising :class:`RetryableError`
    (carrying the RetryReason); any other exception fails the request and
    propagates unchanged. The request's timeout spans all attempts: an attempt
    still in flight at the deadline is cancelled and a timeout raised, whatever
    the cancelled attempt raised (ambiguous if a non-idempotent request may have
    been applied, see rfc/0001 "Ambiguity"). The final exception's ``__cause__``
    is the last attempt's failure.
    """
    _check_request(request, "execute(request, send)")
    if not callable(send):
        raise TypeError(
            "execute(request, send): send must be an async callable (request) -> result, "
            f"got {send!r}"
        )
    if request.state is not _PENDING:
        raise _failing.already_completed(request, None)
    # Another call is sending it (RetryState._being_sent, written out: the method call
    # was most of the check's cost on a successful call; bench/README, sixth session).
    if request._sending or request._in_flight or request._history:
        raise _failing.in_use(request, "execute(request, send)")
    deadline = request.deadline
    rt: Any = None  # the runtime layer, looked up when the call first waits
    scope = previous = token = None
    # Telemetry (rfc/0008): the request's trace, unless a door around this one keeps it
    # (a gRPC call's). Its hooks are called here in line: a wrapping coroutine per attempt
    # and a re-entry of execute were about half of sdkcore's share of a traced call
    # (bench/README, "bench_telemetry.py", second pass).
    trace = handle = None
    if self._telemetry is not None and request._trace is None:
        trace = self._telemetry._request_trace(self._telemetry, request)
    strategy = decides = debug = None  # resolved at the call's first failure
    try:
        request._sending = True  # cleared in the finally below
        if deadline != _INF and deadline - request._clock() <= 0.0:  # expired: nothing is sent
            raise _failing.timed_out(
                request,
                request.last_reason,
                _failing.strategy_of(request, self._default),
                request._clock(),
            )
        if self._budget is not None:  # before the scope: a budget that raises arms nothing
            self._deposit(request)
        if deadline != _INF:
            rt = _runtime.current()
            scope = rt.Scope(rt.now() + (deadline - request._clock()))
            previous = request._set_cancel_hook(scope)  # Request.cancel() cuts the attempt
            token = request._dispatching()  # requests made inside send keep within this deadline
        while True:
            request._begin_attempt(request._clock())
            if trace is not None:
                handle = trace.attempt(request._retries + 1)
            pending = send(request)
            try:
                result = await pending
            except TypeError:
                # Checked only when it fails: one hasattr per attempt was about 1.3% of a
                # retried call's instructions (bench/README, "bench_doors.py", third pass).
                if hasattr(pending, "__await__"):
                    raise  # send's own TypeError
                raise TypeError(
                    f"execute(request, send): send returned {type(pending).__name__}, not "
                    "an awaitable; make it a coroutine function (async def send(request): "
                    "...) or use execute_sync() for a blocking send"
                ) from None
            except RetryableError as failure:
                del pending  # the finished attempt: not held through the backoff
                if scope is not None and failure.__context__ is not None:
                    _converted_cut(request, failure, scope)  # raises the cut, if it is one
                if token is not None:
                    token[2] = None  # (a queue's cut that send got past: not the next one's)
                if trace is not None:
                    trace.attempt_end(handle, failure)
                    handle = None
                reason = failure.reason
                now = request._clock()
                request._attempt_failed(
                    reason,
                    failure.effect or DEFAULT_EFFECT[reason],
                    failure.__cause__ or failure,
                    now,
                )
                if request._state is not _PENDING:
                    # Request.cancel() while the attempt was in flight (no deadline: it ran to
                    # its end): no retry is booked, counted or paid for.
                    raise _failing.already_completed(request, reason) from _failing.cause(request)
                if now >= deadline:
                    # Failed at its deadline (the answer came with it, or the request's clock
                    # is not the loop's): the timeout, no retry asked for or booked, as on
                    # every door (_failing.past_deadline).
                    raise _failing.past_deadline(
                        request, reason, self._default, now
                    ) from _failing.cause(request)
                if strategy is None:  # once per call (a request always has a strategy)
                    if request._clock is not _MONOTONIC or self._sleep_clock is not None:
                        self._check_clock(request)  # the waits move the deadline's clock
                    strategy, decides, gate = self._resolve(request)
                    # kept as the other doors memoize it (Request._resolved_by): the door's
                    # end names the strategy (retry.cancelled). Written out: through
                    # _resolved_by it cost 1.8k instructions a call (bench/README, 16th session)
                    request._memo = (self, strategy, decides, gate)
                    debug = gate(_DEBUG)  # the log gate, asked once: the logger or None
                    rt = rt or _runtime.current()
                action = self._ask(request, reason, strategy, decides)
                if type(action) is not RetryAction and hasattr(action, "__await__"):
                    if scope is None:  # no deadline's scope: Request.cancel() needs one of its own
                        action = await _bounded(
                            self, request, reason, rt, action, _failing.strategy_name(strategy)
                        )
                    else:
                        action = await _awaited(request, reason, action, strategy, scope)
                    now = request._clock()
                verdict, delay = self._settle(  # request._last_error: the failure just booked
                    request,
                    reason,
                    action,
                    strategy,
                    debug,
                    request._last_error,
                    failure.retry_after,
                    now,
                )
                try:  # the wait, written out here: a shared coroutine is one more frame
                    if scope is None and delay > 0.0:
                        await _cancellable_wait(self, request, rt, delay)
                    elif self._sleep is None and not INSTANT_DELAYS.get():
                        await rt.sleep(delay)  # zero: one checkpoint
                    else:
                        await _injected_wait(self, request, rt, delay)
                except BaseException:
                    self._refund_unsent(request)
                    raise
                finally:
                    self._in_retry -= 1  # _leave_backoff(), written out (the loop's thread only)
                if verdict is not _RETRY or request.state is not _PENDING:
                    self._refund_unsent(request)
                    _failing.after_backoff(request, verdict, reason, strategy)
                continue
            if trace is not None:
                trace.attempt_end(handle, None)
            break
    except BaseException as exc:
        if trace is not None and handle is not None:
            # Its span stops being current here (what the ending logs is the request's), and
            # ends in _failed.
            handle = trace.attempt_left(handle)
        if token is not None:
            _unsent_cut(request, token, exc)
        else:
            # No mark of its own (no deadline): a cut in this send marked the dispatch of
            # an enclosing door, if any, which it does not prove unsent: cleared (the safe
            # side). A mark of its own here would hide the enclosing request's deadline
            # from what this send builds.
            enclosing = _DISPATCHING.get()
            if enclosing is not None:
                enclosing[2] = None
        _failed(self, request, exc, scope, previous, trace, handle)
    else:
        if scope is not None:
            request._set_cancel_hook(previous)
            scope.exit(None)
        if request.state is not _PENDING:  # Request.cancel() while the last attempt was in flight
            raise _traced_end(
                trace,
                request,
                _failing.already_completed(request, request.last_reason, answered=True),
            )
        request._succeeded()
        if trace is not None:
            trace.end(request, None)
        return result
    finally:
        request._sending = False
        if token is not None:
            Request._dispatched_done(token)


def _failed(
    self: OrchestratorCore,
    request: Request,
    exc: BaseException,
    scope: Any,
    previous: Any,
    trace: RequestTrace | None,
    handle: Any,
) -> NoReturn:
    """How ``execute`` ends when its loop raised ``exc``: raises what the caller gets.

    The deadline's scope (if armed) is left first: if it cut an attempt or a wait,
    the timeout (or Request.cancel()'s error) replaces ``exc``. A non-retryable answer
    is booked as the last attempt's failure, with the request's error context.
    Apart from ``execute`` so that its frame, which every request waiting in backoff
    holds, keeps only the loop's locals (bench/README, "Memory per request in backoff").
    """
    in_flight = request.in_flight
    fired = False
    try:
        if scope is not None:
            request._set_cancel_hook(previous)
            fired = scope.exit(exc)
            if fired:  # our deadline or Request.cancel() cut an attempt or a wait
                raise _scope_fired(
                    self, request, exc if in_flight else None, in_flight=in_flight
                ) from _failing.cause(request)
            # raised for our cut (_converted_cut), and the caller's own cancellation came
            # in the same turn (the scope did not take it for its own): the caller's
            exc = _failing.raised_for_cut(exc) or exc
        if isinstance(exc, Exception) and in_flight:
            if request.state is not _PENDING:
                # Request.cancel() while the attempt was in flight (no deadline scope: it ran
                # to its end) and its answer is an error: the cancellation is the answer.
                raise _failing.already_completed(
                    request, request.last_reason, answered=True
                ) from exc
            # a non-retryable answer: the last attempt's failure
            request._attempt_failed(None, final_effect(exc, request.id), exc, request.clock())
            if isinstance(exc, CouchbaseException):
                _failing.give_context(request, exc)
        raise exc
    except BaseException as final:  # the error, our timeout, or what the scope re-raised
        _failing.finish_by(request, final)
        if trace is not None:
            # The attempt in flight (``handle``) ends with its own failure, or, cut by our
            # scope, with the timeout (Request.cancel()'s error): the cancellation that cut
            # it said nothing (rfc/0008).
            trace.attempt_end(handle, final if fired else exc)
            trace.end(request, final)
        raise


def _completed(
    request: Request, reason: RetryReason | None, cause: BaseException | None = None
) -> BaseException:
    """The refusal of a hand-wired loop's call on a completed request (``Request.cancel()``
    between two calls), once the trace an earlier call began (if any) recorded it: the
    loop ends with this error, and no later call of it would end the trace.

    ``cause``: what the loop hands ``maybe_retry``; sdkcore's own error for this request
    (its timeout, caught by a loop's ``except TimeoutError``) is raised again as it was.
    A door that adopted the request's span (a gRPC call) ends the trace itself.
    """
    if isinstance(cause, TimeoutException) and request.cancellation_reason is _TIMEOUT:
        context = cause.context
        if context is not None and context.request_id == request.id:
            return cause  # its own timeout, as attempt() raised it
    if cause is not None and not isinstance(cause, Exception):
        return cause  # a cancellation (attempt() ended the request with it): let it through
    error = _failing.already_completed(request, reason)
    trace = request._trace
    if trace is not None and trace.owns_span:
        trace.end(request, error)
    return error


def _traced_end(
    trace: RequestTrace | None, request: Request, error: BaseException
) -> BaseException:
    """``error``, once the request's trace (if any) has recorded the request ending with it."""
    if trace is not None:
        trace.end(request, error)
    return error


async def maybe_retry(
    self: OrchestratorCore,
    request: Request,
    reason: RetryReason,
    *,
    cause: BaseException | None = None,
    effect: AttemptEffect | None = None,
    retry_after: timedelta | float | None = None,
) -> timedelta:
    """Retry ``request`` for ``reason``, or fail it.

    Call it once per failed attempt. ``cause`` is the attempt's failure (logged as
    ``caused_by``, kept as the context's ``last_error`` and chained as the final
    exception's ``__cause__``; a RetryableError counts as its own cause when it has
    one, as on ``execute``); ``effect`` what is known about the server side
    (default: ``cause.effect`` when ``cause`` is a RetryableError that has one, else
    from the reason's flags, see :class:`AttemptEffect`); ``retry_after`` the wait
    the server asked for (default: ``cause.retry_after`` when ``cause`` is a
    RetryableError), see :class:`RetryableError`.

    Returns the delay waited once the caller should re-dispatch. Raises when it
    must not: the strategy's chosen exception or RequestCanceledException
    (NO_MORE_RETRIES / TOO_MANY_REQUESTS_IN_RETRY / RETRY_BUDGET_EXHAUSTED /
    CANCELLED_VIA_CONTEXT), a TimeoutException when the backoff reaches the deadline
    or the server's ``retry_after`` would pass it (the deadline also bounds a strategy
    that must be awaited), or whatever the strategy raised. Also: ``cause`` itself when
    it is a cancellation (never retried; the request ends TASK_CANCELLED) or this
    request's own timeout handed back; ValueError for a RetryableError ``cause`` of
    another reason; RuntimeError inside the ``send`` of ``execute`` or ``hedge``.
    """
    _check_request(request, "maybe_retry(request, reason)")
    if type(reason) is not RetryReason:
        raise TypeError(
            f"maybe_retry(request, reason): reason must be a RetryReason, got {reason!r}"
            + suggest_member(reason, RetryReason)
        )
    if effect is not None and type(effect) is not AttemptEffect:
        raise TypeError(
            f"maybe_retry(effect=...) must be an AttemptEffect, got {effect!r}"
            + suggest_member(effect, AttemptEffect)
        )
    if cause is not None and not isinstance(cause, BaseException):
        raise TypeError(
            f"maybe_retry(cause=...) must be the attempt's exception or None, got {cause!r}"
        )
    # A cancellation handed over itself (a RetryableError raised from one may stand for a
    # helper task's, which the driver reports as retryable: attempt() tells the caller's).
    cancellation = None if isinstance(cause, Exception) else cause
    if isinstance(cause, RetryableError):
        if cause.reason is not reason:  # its effect would be booked under another reason's
            raise ValueError(
                f"maybe_retry(request, {reason.name}, cause=...): the cause is a RetryableError "
                f"for {cause.reason.name}; pass its own reason "
                "(maybe_retry(request, exc.reason, cause=exc)), or its __cause__ as cause"
            )
        # What the other doors book for a RetryableError: its hint and effect unless
        # given, and its own cause as the attempt's failure (the final __cause__).
        if retry_after is None:
            retry_after = cause.retry_after
        if effect is None:
            effect = cause.effect
        cause = cause.__cause__ or cause
    # Checked before anything is booked: a bad hint leaves the request as it was.
    hint = None if retry_after is None else to_seconds(retry_after, "maybe_retry(retry_after=...)")
    if request.state is not _PENDING:
        raise _completed(request, reason, cause)
    if request._sending:  # inside the send of execute or hedge: their loop books it
        raise _failing.inside_send(request)
    telemetry = self._telemetry
    if telemetry is not None and request._trace is None:
        telemetry.begin(request)  # a hand-wired loop without attempt(): its first failure
    if cancellation is not None:
        # A cancellation handed over as the attempt's failure: never retried. The request
        # ends CANCELLED (TASK_CANCELLED) and the cancellation goes on.
        _failing.finish_by(request, cancellation)
        trace = request._trace
        if trace is not None:
            trace.end(request, cancellation)
        raise cancellation
    try:
        now = request.clock()
        request._attempt_failed(reason, effect or DEFAULT_EFFECT[reason], cause, now)
        if self._budget is not None:  # a loop without attempt(): its first failure counts the first
            self._deposit(request)
        if now >= request._deadline:  # failed at its deadline: the timeout, as on every door
            raise _failing.past_deadline(request, reason, self._default, now) from _failing.cause(
                request
            )
        # The waits move the deadline's clock; asked only where they might not (the call on
        # every maybe_retry was 1.3k instructions a retried call: bench/README, 16th session)
        if request._clock is not _MONOTONIC or self._sleep_clock is not None:
            self._check_clock(request)
        rt = _runtime.current()
        _, strategy, decides, gate = request._resolved_by(self, self._resolve)
        action = self._ask(request, reason, strategy, decides)
        if type(action) is not RetryAction and hasattr(action, "__await__"):
            name = _failing.strategy_name(strategy)
            action = await _bounded(self, request, reason, rt, action, name)
            now = request.clock()
        verdict, delay = self._settle(
            request, reason, action, strategy, gate(_DEBUG), cause, hint, now
        )
        if delay > 0.0:  # as execute without a deadline: Request.cancel() can wake it
            # Request.cancel() wakes a real backoff early (the request is then found cancelled).
            try:
                await _cancellable_wait(self, request, rt, delay)
            except BaseException as exc:
                self._refund_unsent(request)
                _failing.finish_by(request, exc)
                raise
            finally:
                self._leave_backoff(request)
        else:
            # The wait written out, as in execute: through a shared wait coroutine it is one
            # more frame, 2% more instructions per retried call (192.2k against 188.3k;
            # bench/README, "The sixteenth session's review fixes").
            try:
                if self._sleep is None and not INSTANT_DELAYS.get():
                    await rt.sleep(delay)  # zero: one checkpoint
                else:
                    await _injected_wait(self, request, rt, delay)
            except BaseException as exc:
                self._refund_unsent(request)
                _failing.finish_by(request, exc)
                raise
            finally:
                self._in_retry -= 1  # _leave_backoff(), written out (the loop's thread only)
        if verdict is not _RETRY or request.state is not _PENDING:
            self._refund_unsent(request)
            _failing.after_backoff(request, verdict, reason, strategy)
        if type(action) is RetryAction and action.seconds == delay and action.duration is not None:
            return action.duration  # the strategy's own timedelta: nothing to build
        return timedelta(seconds=delay)
    except BaseException as exc:
        trace = request._trace
        if trace is not None and request.completed and trace.owns_span:
            # A door that adopted the request's span (a gRPC call) ends it with what its
            # caller gets (the AioRpcError), not with sdkcore's own refusal or timeout.
            trace.end(request, exc)
        raise


async def _bounded(
    self: OrchestratorCore,
    request: Request,
    reason: RetryReason,
    rt: Any,
    pending: Any,
    strategy: str,
) -> Any:
    """Await an async strategy's answer, bounded by the request's deadline."""
    left = request.deadline - request.clock()
    scope = rt.Scope(_INF if left == _INF else rt.now() + left)
    previous = request._set_cancel_hook(scope)
    try:
        action = await pending
    except BaseException as exc:
        request._set_cancel_hook(previous)
        if scope.exit(exc):
            raise _scope_fired(self, request, None, in_flight=False) from _failing.cause(request)
        if isinstance(exc, Exception):
            _failing.strategy_failed(request, reason, strategy, exc)
        else:
            _failing.finish_by(request, exc)
        raise
    request._set_cancel_hook(previous)
    if scope.exit(None):
        raise _scope_fired(self, request, None, in_flight=False) from _failing.cause(request)
    if request.state is not _PENDING:  # Request.cancel() while the strategy ran
        raise _failing.already_completed(request, reason) from _failing.cause(request)
    return action


@contextlib.contextmanager
def attempt(self: OrchestratorCore, request: Request) -> Generator[None, None, None]:
    """Bound one attempt of a hand-wired loop by the request's deadline.

    ``with orchestrator.attempt(request): response = await send(...)``. At the
    deadline the attempt is cancelled and the ``with`` raises the timeout
    (AmbiguousTimeoutException if a non-idempotent request may have been applied,
    UnambiguousTimeoutException otherwise), whatever the cancelled send raised;
    ``Request.cancel()`` cancels it too (RequestCanceledException). A RetryableError
    the block raised for the caller's own cancellation leaves as that cancellation.
    Other exceptions pass through unchanged; the attempt's duration is recorded for
    the next :meth:`maybe_retry`. A second block open on the request at once is a
    RuntimeError; an earlier block whose attempt was never booked is booked maybe
    applied when this one opens. Use it from async code (asyncio or trio).
    """
    _check_request(request, "attempt(request)")
    if request.state is not _PENDING:
        # Request.cancel() after maybe_retry booked a retry: the budget paid for an attempt
        # that never goes (given back once: a backoff the cancel cut gave it back already)
        self._refund_unsent(request)
        raise _completed(request, request.last_reason)
    if request._sending or request._in_block:  # another door, or another attempt() block
        raise _failing.in_use(request, "attempt(request)")
    now = request.clock()
    if request._in_flight:
        # The last block ended without its attempt being booked (a loop that tries again
        # by itself): it went out, so it may have been applied (the safe side).
        request._attempt_failed(None, _MAYBE, None, now)
    left = request.deadline - now
    if left <= 0.0:  # expired before the attempt: nothing is sent
        self._refund_unsent(request)  # the retry maybe_retry booked, and paid for, never goes
        expired = _failing.timed_out(
            request, request.last_reason, _failing.strategy_of(request, self._default), now
        )
        if self._telemetry is not None:
            (request._trace or self._telemetry.begin(request)).end(request, expired)
        raise expired
    request._begin_attempt(now)
    self._deposit(request)  # once, on the request's first attempt
    trace = request._trace
    if trace is None and self._telemetry is not None:
        trace = self._telemetry.begin(request)
    # numbered by the attempts booked: a loop that tries again without maybe_retry counts too
    handle = None if trace is None else trace.attempt(request.failed_attempts + 1)
    token = request._dispatching()  # requests made in the block keep within this deadline
    error: BaseException | None = None
    request._in_block = True  # cleared in the finally below
    try:
        rt = _runtime.current()
        # Without a deadline too: the scope is what Request.cancel() cuts the attempt with.
        scope = rt.Scope(_INF if left == _INF else rt.now() + left)
        previous = request._set_cancel_hook(scope)
        try:
            yield
        except BaseException as exc:
            request._set_cancel_hook(previous)
            _unsent_cut(request, token, exc)
            cut = _callers_cut(exc, scope)  # read before exit(), which takes the count back
            if scope.exit(exc):
                in_flight = request.in_flight
                if in_flight and sent_nothing(exc):
                    # The block's own refusal as the deadline passed (a limiter's queue that
                    # gave its permit back): nothing was sent, as execute books it.
                    request._attempt_failed(exc.reason, _NOT_SENT, exc, request.clock())
                    in_flight = False
                error = _scope_fired(self, request, exc, in_flight=in_flight)
                raise error from _failing.cause(request)
            if cut is None and scope.fired:
                # Raised for the scope's cut, and the caller's own cancellation came in the
                # same turn (exit did not take it for the scope's): the caller's, as
                # execute raises it (_failed). It was lost, the error let out (a review).
                cut = _failing.raised_for_cut(exc)
            if cut is not None:  # the block turned the caller's cancellation into this
                error = cut
                raise cut from None
            error = exc
            raise
        request._set_cancel_hook(previous)
        scope.exit(None)
        if request.cancelled:
            # Request.cancel() as the block ended: trio runs a task already woken by its
            # answer on, uncut. A cancelled request never reports success (as execute).
            error = _failing.already_completed(request, request.last_reason, answered=True)
            raise error
    finally:
        request._in_block = False
        Request._dispatched_done(token)
        if error is not None and not isinstance(error, Exception):
            _failing.finish_by(request, error)  # the caller's cancellation (never retried)
        if trace is not None:
            trace.attempt_end(handle, error)
            if request.completed:  # the deadline or Request.cancel() ended it here
                trace.end(request, error)
