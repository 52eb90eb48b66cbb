"""RetryOrchestrator: RFC 0049 "Retry Orchestration" and "Capping the Retry Duration".

``maybe_retry`` is the decision plus the wait; ``execute`` is the dispatch loop
built on it for SDK code that does not want to write its own.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from datetime import timedelta
from types import CoroutineType
from typing import Any, NoReturn, TypeVar

import anyio

from . import _hooks, _log
from ._action import RetryAction
from ._backoff import controlled_backoff
from ._cancel import outer_cancel_pending
from ._context import AttemptEffect, CancellationReason, ErrorContext, describe_error
from ._errors import (
    AmbiguousTimeoutException,
    CouchbaseException,
    RequestCanceledException,
    RetryableError,
    TimeoutException,
    UnambiguousTimeoutException,
)
from ._hedge import HedgePolicy, HedgeThrottler, run_hedged
from ._reason import RetryReason
from ._request import Request, RequestState
from ._strategy import (
    BestEffortRetryStrategy,
    FailFastRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    RetryStrategy,
)

__all__ = ["DEFAULT_MAX_REQUESTS_IN_RETRY", "RetryOrchestrator"]

T = TypeVar("T")

#: Per-orchestrator limit of requests waiting in retry (the Java SDK's default).
DEFAULT_MAX_REQUESTS_IN_RETRY = 32768

_CONTROLLED = tuple(controlled_backoff(n) for n in range(6))
_CONTROLLED_SECONDS = tuple(d.total_seconds() for d in _CONTROLLED)

# How a strategy class is called, decided once per class (see _kind_of).
_BUILTIN, _ASYNC, _SYNC = 0, 1, 2
_BUILTIN_RETRY_AFTER = frozenset(
    {
        BestEffortRetryStrategy.retry_after,
        FailFastRetryStrategy.retry_after,
        FastFailOnTerminalErrorRetryStrategy.retry_after,
    }
)
# type -> (its retry_after, kind, instances may carry their own retry_after)
_kinds: dict[type, tuple[object, int, bool]] = {}
_KINDS_LIMIT = 1024  # classes made on the fly must not grow the cache without bound
# type -> its retry_after, for built-in kinds whose instances cannot override it
_builtin_fast: dict[type, object] = {}
_log_enabled = _log.enabled
_DEBUG = _log.DEBUG
_INF = float("inf")


def _unsafe_retry(context: ErrorContext) -> BaseException:
    reason = context.reason.name if context.reason is not None else "?"
    return RequestCanceledException(
        f"not retried: the request is not idempotent and may have reached the server "
        f"({reason}); the strategy asked for a retry, which could apply it twice",
        context=context,
    )


_UNSAFE = RetryAction.no_retry(_unsafe_retry)
_PENDING = RequestState.PENDING
_EFFECT_OF = {r: AttemptEffect.for_reason(r) for r in RetryReason}
_MAYBE = AttemptEffect.MAYBE_APPLIED
_NOT_SENT = AttemptEffect.NOT_SENT
_instant = _hooks.INSTANT_DELAYS.get
_MONOTONIC = time.monotonic
_UNSET: Any = object()


def _drop_tracebacks(history: list[list[Any]]) -> None:
    """After a success, let the recorded failures go of their tracebacks.

    A traceback holds the frames it passed through, and those hold the request, whose
    history holds the failure: a reference cycle per retried call, left to the cyclic
    garbage collector (measured: about 1 us per retry in bench_core.py). Once the call
    has succeeded nobody needs the tracebacks; types and messages stay for
    ``Request.attempts``.
    """
    for entry in history:
        error = entry[2]
        if error is not None:
            error.__traceback__ = None


def _kind_of(strategy: object) -> int:
    """How to call ``strategy``: decided once per class, re-checked cheaply per call.

    The cache entry is trusted only while the class still has the same
    ``retry_after`` (a class patched later is re-classified) and the instance has
    no ``retry_after`` of its own.
    """
    cls = type(strategy)
    method = getattr(cls, "retry_after", None)
    entry = _kinds.get(cls)
    if (
        entry is not None
        and entry[0] is method
        and (not entry[2] or "retry_after" not in strategy.__dict__)
    ):
        return entry[1]
    own = getattr(strategy, "__dict__", None)
    if method is None or (own is not None and "retry_after" in own):
        # retry_after set on the instance: decide for this object, do not cache
        bound = getattr(strategy, "retry_after", None)
        return _ASYNC if inspect.iscoroutinefunction(bound) else _SYNC
    if method in _BUILTIN_RETRY_AFTER and callable(getattr(cls, "_decide", None)):
        kind = _BUILTIN
    elif inspect.iscoroutinefunction(method):
        kind = _ASYNC
    else:
        kind = _SYNC
    if len(_kinds) >= _KINDS_LIMIT:
        _kinds.clear()
        _builtin_fast.clear()
    has_dict = cls.__dictoffset__ != 0
    _kinds[cls] = (method, kind, has_dict)
    if kind == _BUILTIN and not has_dict:
        _builtin_fast[cls] = method
    return kind


def _strategy_name(strategy: object) -> str:
    return type(strategy).__name__


class RetryOrchestrator:
    """Decides, for each failed attempt, whether and when a request is retried.

    * ``default_strategy``: used for requests whose ``retry_strategy`` is None
      (default: :class:`FastFailOnTerminalErrorRetryStrategy`).
    * ``max_requests_in_retry``: backpressure; beyond this many requests waiting
      in retry, further retries fail at once (TOO_MANY_REQUESTS_IN_RETRY).
    * ``sleep``: the wait (default ``anyio.sleep``); inject a virtual clock's sleep
      in tests together with ``Request(clock=...)``.

    Three doors, one set of rules: :meth:`execute` (async dispatch loop),
    :meth:`execute_sync` (the same for threads), and :meth:`maybe_retry` with
    :meth:`attempt`, :meth:`succeed` and :meth:`fail` for a hand-wired loop.
    """

    __slots__ = (
        "_default",
        "_in_retry",
        "_in_retry_sync",
        "_lock",
        "_max_in_retry",
        "_sleep",
        "_sleep_clock",
        "_sleep_is_anyio",
    )

    def __init__(
        self,
        default_strategy: RetryStrategy | None = None,
        *,
        max_requests_in_retry: int = DEFAULT_MAX_REQUESTS_IN_RETRY,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
    ) -> None:
        if default_strategy is None:
            default_strategy = FastFailOnTerminalErrorRetryStrategy()
        elif isinstance(default_strategy, type) or not callable(
            getattr(default_strategy, "retry_after", None)
        ):
            raise TypeError(
                "RetryOrchestrator(default_strategy=...) must be a RetryStrategy instance (an "
                f"object with a retry_after(request, reason) method), got {default_strategy!r}"
            )
        if (
            not isinstance(max_requests_in_retry, int)
            or isinstance(max_requests_in_retry, bool)
            or max_requests_in_retry < 1
        ):
            raise ValueError(
                "RetryOrchestrator(max_requests_in_retry=...) must be an integer >= 1, "
                f"got {max_requests_in_retry!r}"
            )
        if sleep is not None and not callable(sleep):
            raise TypeError(
                f"RetryOrchestrator(sleep=...) must be an async callable (seconds), got {sleep!r}"
            )
        self._default: RetryStrategy = default_strategy
        self._max_in_retry = max_requests_in_retry
        self._in_retry = 0  # async waits: only the event loop's thread changes it
        self._in_retry_sync = 0  # execute_sync waits: changed under _lock
        self._lock = threading.Lock()
        self._sleep = anyio.sleep if sleep is None else sleep
        self._sleep_is_anyio = sleep is None
        # A virtual clock's sleep (an object with .clock() and .sleep()): requests must
        # run on that clock, or their deadlines and the waits disagree.
        owner = getattr(sleep, "__self__", None)
        clock = getattr(owner, "clock", None)
        self._sleep_clock: Any = clock if callable(clock) else None

    @property
    def default_strategy(self) -> RetryStrategy:
        return self._default

    @property
    def max_requests_in_retry(self) -> int:
        return self._max_in_retry

    @property
    def requests_in_retry(self) -> int:
        """How many requests are waiting in retry backoff right now."""
        return self._in_retry + self._in_retry_sync

    def __repr__(self) -> str:
        return (
            f"<RetryOrchestrator default_strategy={self._default!r} "
            f"requests_in_retry={self.requests_in_retry}/{self._max_in_retry}>"
        )

    # -- the decision ----------------------------------------------------------
    async def maybe_retry(
        self,
        request: Request,
        reason: RetryReason,
        *,
        cause: BaseException | None = None,
        effect: AttemptEffect | None = None,
    ) -> timedelta:
        """Retry ``request`` for ``reason``, or fail it.

        Call it once per failed attempt. ``cause`` is the attempt's failure (logged as
        ``caused_by``, kept as the context's ``last_error`` and chained as the final
        exception's ``__cause__``); ``effect`` what is known about the server side
        (default: from the reason's flags, see :class:`AttemptEffect`).

        Returns the delay waited once the caller should re-dispatch. Raises when it
        must not: the strategy's chosen exception or RequestCanceledException
        (NO_MORE_RETRIES / TOO_MANY_REQUESTS_IN_RETRY / CANCELLED_VIA_CONTEXT), a
        TimeoutException when the backoff reaches the deadline (the deadline also
        bounds a strategy that must be awaited), or whatever the strategy raised.
        """
        self._check(request, reason, "maybe_retry")
        if effect is not None and type(effect) is not AttemptEffect:
            raise TypeError(f"maybe_retry(effect=...) must be an AttemptEffect, got {effect!r}")
        request._record(
            reason, _EFFECT_OF[reason] if effect is None else effect, cause, self._took(request)
        )
        try:
            plan = self._plan(request, reason, None)
            if plan is None:  # a strategy whose retry_after must be awaited
                plan = self._plan(request, reason, await self._decide_bounded(request, reason))
        except CouchbaseException as exc:
            if exc.__cause__ is None and cause is not None:
                exc.__cause__ = cause
            raise
        assert plan is not None
        if (plan[0] <= 0.0 and self._sleep_is_anyio) or _instant():  # zero delay: one checkpoint
            self._in_retry += 1
            try:
                await anyio.lowlevel.checkpoint()
            except BaseException:
                request._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)
                raise
            finally:
                self._in_retry -= 1
        else:
            await self._pause(request, plan[0])
        return self._resume(request, reason, plan)

    @staticmethod
    def _check(request: Request, reason: RetryReason, door: str) -> None:
        if type(request) is not Request and not isinstance(request, Request):
            raise TypeError(
                f"{door}(request, reason): request must be an sdkcore.Request, got {request!r}"
            )
        if type(reason) is not RetryReason:
            raise TypeError(
                f"{door}(request, reason): reason must be a RetryReason, got {reason!r}"
            )
        if request._state is not _PENDING:
            raise RetryOrchestrator._already_completed(request, reason)

    @staticmethod
    def _took(request: Request) -> float | None:
        """How long the attempt that just ended was in flight (None if not measured)."""
        started = request._sent_at
        if started < 0.0:
            return None
        request._sent_at = -1.0
        return request._clock() - started

    def _plan(
        self,
        request: Request,
        reason: RetryReason,
        decided: tuple[Any, Any] | None,
        log: Any = _UNSET,
    ) -> tuple[float, timedelta, bool] | None:
        """Decide and book a retry: (delay seconds, delay, capped), or raise.

        The failed attempt is already recorded. ``decided`` is (action, strategy) when
        the strategy was already awaited; returns None when the strategy has to be
        awaited first. ``log``: the debug logger or None, when the caller already
        asked (``execute`` asks once per call, not once per attempt).
        """
        strategy: Any = None
        if reason.always_retry:  # RFC 0049: controlled backoff, the strategy is not consulted
            attempt = request._attempts
            duration: timedelta = _CONTROLLED[attempt if attempt < 5 else 5]
            delay = duration.total_seconds()
        else:
            if decided is None:
                strategy = request._strategy or self._default
                cls = type(strategy)
                fast = _builtin_fast.get(cls)  # slotted built-in class, not patched since
                if (fast is None or fast is not cls.retry_after) and _kind_of(strategy) != _BUILTIN:
                    return None
                try:
                    action = strategy._decide(request, reason)
                except Exception as exc:
                    self._strategy_failed(request, reason, strategy, exc)
                    raise
            else:
                action, strategy = decided
                if request._state is not _PENDING:  # cancelled while the strategy ran
                    raise self._already_completed(request, reason)
            if type(action) is not RetryAction:
                self._check_action(request, reason, strategy, action)
            if action.duration is None:
                self._refuse(request, reason, action, strategy)
            if not (request._idempotent or reason.allows_non_idempotent_retry):
                # RFC 0049 "Network Time": a non-idempotent request that may have
                # reached the server must fail, whatever a custom strategy says.
                self._refuse(request, reason, _UNSAFE, strategy)
            duration = action.duration
            delay = action._seconds

        if self._in_retry + self._in_retry_sync >= self._max_in_retry:
            self._too_many(request, reason, strategy)

        request._attempts += 1
        request._reasons[reason] = None
        capped = False
        if request._deadline != _INF:
            left = request._deadline - request._clock()
            if delay >= left:  # RFC 0049 "Capping the Retry Duration"
                capped = True
                delay = left if left > 0.0 else 0.0
                duration = timedelta(seconds=delay)
        request._history[-1][4] = delay

        if log is _UNSET:
            log = _log_enabled(_DEBUG)
        if log is not None:
            log.debug(
                _log.EVENT_SCHEDULED,
                **self._fields(request, reason, strategy),
                delay_ms=round(delay * 1000.0, 3),
                capped=capped,
            )
        return delay, duration, capped

    def _resume(
        self, request: Request, reason: RetryReason, plan: tuple[float, timedelta, bool]
    ) -> timedelta:
        """After the backoff: the delay waited, or the reason not to re-dispatch."""
        if request._state is not _PENDING:
            raise self._already_completed(request, reason)
        if plan[2]:  # the capped backoff ran into the deadline
            raise self._timeout(request, reason) from self._cause(request)
        return plan[1]

    async def _pause(self, request: Request, delay: float) -> None:
        """Wait out a backoff; Request.cancel() wakes it early."""
        if (
            self._sleep_clock is not None
            and request._clock is _MONOTONIC
            and request._deadline != _INF
        ):
            raise ValueError(
                f"RetryOrchestrator(sleep={self._sleep!r}) waits on a virtual clock, but request "
                f"{request.id} ({request.name!r}) runs on {request._clock!r}: build the request "
                "with Request(clock=<the same clock>.clock) so its deadline follows the waits"
            )
        self._in_retry += 1
        outer = request._cancel_scope
        try:
            with anyio.CancelScope() as scope:
                request._cancel_scope = scope
                try:
                    await self._sleep(delay)
                finally:
                    request._cancel_scope = outer
        except BaseException as exc:  # e.g. an injected sleep that failed, or a cancellation
            request._finish_by(exc)
            raise
        finally:
            self._in_retry -= 1

    # -- the hand-wired loop ----------------------------------------------------
    def succeed(self, request: Request) -> None:
        """Mark ``request`` as succeeded (for hand-wired dispatch loops; ``execute`` does it).

        A completed request cannot be retried; this does nothing if it already completed.
        """
        request._finish(RequestState.SUCCEEDED)

    def fail(self, request: Request, error: BaseException) -> BaseException:
        """Fail ``request`` with ``error`` (a non-retryable answer); returns ``error`` to raise.

        For hand-wired loops, to match :meth:`succeed`: the attempt is recorded
        (``last_error``), the request completes as failed, and a CouchbaseException
        without a context gets the request's. ``raise orchestrator.fail(request, exc)``.
        Does not complete a request that already completed.
        """
        if not isinstance(error, BaseException):
            raise TypeError(f"fail(request, error): error must be an exception, got {error!r}")
        if request._state is _PENDING:
            request._record(None, _MAYBE, error, self._took(request))
            request._finish(RequestState.FAILED)
        if isinstance(error, CouchbaseException) and error.context is None:
            error.context = request.error_context(request._last_reason)
        return error

    @contextlib.contextmanager
    def attempt(self, request: Request) -> Generator[None, None, None]:
        """Bound one attempt of a hand-wired loop by the request's deadline.

        ``with orchestrator.attempt(request): response = await send(...)``. At the
        deadline the attempt is cancelled and the ``with`` raises the timeout
        (AmbiguousTimeoutException if a non-idempotent request may have been applied,
        UnambiguousTimeoutException otherwise), whatever the cancelled send raised;
        ``Request.cancel()`` cancels it too (RequestCanceledException). Other
        exceptions pass through unchanged; the attempt's duration is recorded for the
        next :meth:`maybe_retry`. Use it from async code (it arms an anyio cancel scope).
        """
        if type(request) is not Request and not isinstance(request, Request):
            raise TypeError(
                f"attempt(request): request must be an sdkcore.Request, got {request!r}"
            )
        if request._state is not _PENDING:
            raise self._already_completed(request, request._last_reason)
        now = anyio.current_time()  # first: its first call may import the backend
        left = request._deadline - request._clock()
        if left <= 0.0:  # expired before the attempt: nothing is sent
            raise self._timeout(request, request._last_reason)
        request._sent_at = request._clock()
        if request._deadline == _INF:
            yield
            return
        scope = anyio.CancelScope(deadline=now + left)
        outer = request._cancel_scope
        request._cancel_scope = scope
        try:
            with scope:
                yield
        except BaseException as exc:
            request._cancel_scope = outer
            if self._cut_by_us(scope, exc, in_flight=True):
                raise self._scope_fired(request, exc, in_flight=True) from self._cause(request)
            raise
        request._cancel_scope = outer
        if scope.cancelled_caught:  # the scope swallowed its own cancellation
            raise self._scope_fired(request, None, in_flight=True) from self._cause(request)

    # -- strategies other than the built-ins (slow path, still no per-call inspect) ----
    async def _call_strategy(self, request: Request, reason: RetryReason) -> tuple[Any, Any]:
        strategy: Any = request._strategy or self._default
        kind = _kind_of(strategy)  # not _BUILTIN: _plan decided those synchronously
        try:
            if kind == _ASYNC:
                return await strategy.retry_after(request, reason), strategy
            action = strategy.retry_after(request, reason)
            if type(action) is not RetryAction and inspect.isawaitable(action):
                action = await action
            return action, strategy
        except Exception as exc:
            self._strategy_failed(request, reason, strategy, exc)
            raise
        except BaseException:
            request._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)
            raise

    async def _decide_bounded(self, request: Request, reason: RetryReason) -> tuple[Any, Any]:
        """Await the strategy, bounded by the request's deadline (maybe_retry's door)."""
        if request._deadline == _INF:
            return await self._call_strategy(request, reason)
        outer = request._cancel_scope
        with anyio.CancelScope(deadline=request.loop_deadline()) as scope:
            request._cancel_scope = scope
            try:
                return await self._call_strategy(request, reason)
            finally:
                request._cancel_scope = outer
        raise self._scope_fired(request, None, in_flight=False) from self._cause(request)

    def _strategy_failed(
        self, request: Request, reason: RetryReason, strategy: Any, error: BaseException
    ) -> None:
        request._finish(RequestState.FAILED)
        log = _log.enabled(_log.WARNING)
        if log is not None:
            log.warning(
                _log.EVENT_STRATEGY_FAILED,
                **self._fields(request, reason, strategy),
                error=repr(error),
            )

    def _check_action(
        self, request: Request, reason: RetryReason, strategy: Any, action: object
    ) -> None:
        if isinstance(action, RetryAction):  # a subclass
            return
        err = TypeError(
            f"{_strategy_name(strategy)}.retry_after(request, {reason!r}) returned "
            f"{action!r} ({type(action).__name__}); a RetryStrategy must return a "
            "RetryAction: RetryAction.with_duration(delay) or RetryAction.no_retry()"
        )
        self._strategy_failed(request, reason, strategy, err)
        raise err

    def _too_many(self, request: Request, reason: RetryReason, strategy: Any) -> NoReturn:
        request._finish(RequestState.CANCELLED, CancellationReason.TOO_MANY_REQUESTS_IN_RETRY)
        log = _log.enabled(_log.INFO)
        if log is not None:
            self._log_refusal(log, request, reason, strategy, "too_many_requests_in_retry")
        raise RequestCanceledException(
            f"not retried: {self._max_in_retry} requests are already waiting in retry "
            f"(after {reason.name})",
            context=request.error_context(reason, strategy=self._name(strategy)),
        )

    # -- failing ---------------------------------------------------------------
    @staticmethod
    def _name(strategy: object) -> str:
        return "controlled_backoff" if strategy is None else _strategy_name(strategy)

    def _fields(
        self, request: Request, reason: RetryReason | None, strategy: Any
    ) -> dict[str, Any]:
        """The fields every retry.* event carries (built only when the level is enabled).

        ``attempt`` is the 1-based number of the attempt the event is about: the one
        that failed (scheduled, not_retried, strategy_failed) or the last one sent
        (timed_out; 0 if none was).
        """
        history = request._history
        return {
            "request_id": request.id,
            "request_name": request.name,
            "reason": None if reason is None else reason.name,
            "attempt": len(history),
            "idempotent": request.idempotent,
            "strategy": self._name(strategy),
            "caused_by": describe_error(history[-1][2]) if history else None,
        }

    def _log_refusal(
        self, log: Any, request: Request, reason: RetryReason, strategy: Any, why: str
    ) -> None:
        cancellation = request._cancellation
        log.info(
            _log.EVENT_NOT_RETRIED,
            **self._fields(request, reason, strategy),
            why=why,
            cancellation_reason=None if cancellation is None else cancellation.name,
        )

    def _refuse(
        self, request: Request, reason: RetryReason, action: RetryAction, strategy: Any
    ) -> NoReturn:
        request._finish(RequestState.CANCELLED, CancellationReason.NO_MORE_RETRIES)
        # Whichever strategy refused: a request that is not idempotent, failed for a
        # reason that does not allow retrying it, was refused for idempotency.
        unsafe = not (request._idempotent or reason.allows_non_idempotent_retry)
        log = _log.enabled(_log.INFO)
        if log is not None:
            why = "not_idempotent" if unsafe else "strategy_declined"
            self._log_refusal(log, request, reason, strategy, why)
        context = request.error_context(reason, strategy=self._name(strategy))
        if action.exception is None:
            if unsafe:
                raise RequestCanceledException(
                    f"not retried: the request is not idempotent and may have reached the "
                    f"server ({reason.name}); retrying could apply it twice",
                    context=context,
                )
            raise RequestCanceledException(
                f"not retried: {self._name(strategy)} declined to retry after {reason.name}",
                context=context,
            )
        raise action.exception(context)

    @staticmethod
    def _already_completed(request: Request, reason: RetryReason | None) -> BaseException:
        context = request.error_context(reason)
        if request._state is RequestState.CANCELLED:
            return RequestCanceledException("request was cancelled", context=context)
        return RuntimeError(
            f"request {request.id} ({request.name!r}) is already {request._state.value}; "
            f"it cannot be retried. Context: {context}"
        )

    def _timeout(
        self,
        request: Request,
        reason: RetryReason | None,
        *,
        in_flight: bool = False,
        error: BaseException | None = None,
    ) -> TimeoutException:
        """Complete ``request`` as timed out; the exception to raise.

        ``in_flight``: an attempt was cut at the deadline (recorded as maybe applied;
        ``error`` is what it raised, unless that was the cancellation itself).
        """
        request._finish(RequestState.CANCELLED, CancellationReason.TIMEOUT)
        if in_flight:
            request._record(None, _MAYBE, error, self._took(request))
        ambiguous = not request.idempotent and request._maybe_applied
        log = _log.enabled(_log.INFO)
        if log is not None:
            fields = self._fields(request, reason, request._strategy or self._default)
            fields["caused_by"] = describe_error(request._last_error)
            log.info(
                _log.EVENT_TIMED_OUT,
                **fields,
                in_flight=in_flight,
                ambiguous=ambiguous,
            )
        context = request.error_context(reason, in_flight=in_flight)
        if ambiguous:
            return AmbiguousTimeoutException(context=context)
        return UnambiguousTimeoutException(context=context)

    @staticmethod
    def _cause(request: Request) -> BaseException | None:
        """The ``__cause__`` of a timeout: the last attempt's failure, never a cancellation."""
        error = request._last_error
        # cancellations (asyncio's, trio's) are BaseExceptions, never Exceptions
        return error if isinstance(error, Exception) else None

    @staticmethod
    def _cut_by_us(scope: anyio.CancelScope, exc: BaseException, *, in_flight: bool) -> bool:
        """Our scope did not swallow ``exc``: was it still our deadline or cancel()?

        grpc.aio (and other libraries running attempts in their own tasks) re-raise a
        fresh cancellation that anyio does not recognise as its own. Once our scope
        fired, such a cancellation is ours unless the task itself is being cancelled,
        and any other error raised by an attempt in flight is what the cut produced.
        """
        if not (scope.cancel_called or anyio.current_time() >= scope.deadline):
            return False
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            return not outer_cancel_pending()
        return in_flight and isinstance(exc, Exception)

    def _scope_fired(
        self, request: Request, error: BaseException | None, *, in_flight: bool
    ) -> CouchbaseException:
        """The exception for a request whose deadline scope fired (or was cancelled)."""
        if request._cancellation is CancellationReason.CANCELLED_VIA_CONTEXT:
            failure = self._already_completed(request, request._last_reason)
            assert isinstance(failure, CouchbaseException)
            return failure
        # The deadline: whatever was waiting or in flight saw a cancellation (and may
        # have marked the request cancelled), but the request timed out.
        request._state = RequestState.PENDING
        if error is not None and isinstance(error, anyio.get_cancelled_exc_class()):
            error = None
        return self._timeout(request, request._last_reason, in_flight=in_flight, error=error)

    # -- the dispatch loop -----------------------------------------------------
    async def execute(self, request: Request, send: Callable[[Request], Awaitable[T]]) -> T:
        """Run ``send(request)`` attempt by attempt until it returns, then return its result.

        ``send`` reports a retryable failure by raising :class:`RetryableError`
        (carrying the RetryReason); any other exception fails the request and
        propagates unchanged. The request's timeout spans all attempts: an attempt
        still in flight at the deadline is cancelled and a timeout raised, whatever
        the cancelled attempt raised (ambiguous if a non-idempotent request may have
        been applied, see rfc/0001 "Ambiguity"). The final exception's ``__cause__``
        is the last attempt's failure.
        """
        if type(request) is not Request and not isinstance(request, Request):
            raise TypeError(
                f"execute(request, send): request must be an sdkcore.Request, got {request!r}"
            )
        if not callable(send):
            raise TypeError(
                "execute(request, send): send must be an async callable (request) -> result, "
                f"got {send!r}"
            )
        if request._state is not _PENDING:
            raise self._already_completed(request, None)
        # One cancel scope spans every attempt and backoff. It is entered and left by
        # hand (not with ``with``) so that both paths share one loop and one frame.
        scope: anyio.CancelScope | None = None
        if request._deadline != _INF:
            now = anyio.current_time()  # first: its first call may import the backend
            left = request._deadline - request._clock()
            if left <= 0.0:  # expired before the first attempt: nothing is sent
                raise self._timeout(request, request._last_reason)
            scope = anyio.CancelScope(deadline=now + left)
            scope.__enter__()
            request._cancel_scope = scope  # Request.cancel() stops an attempt in flight
        clock = request._clock
        history = request._history
        debug: Any = _UNSET  # the debug logger (or None), asked at the first retry of the call
        try:
            while True:
                request._in_flight = True
                request._sent_at = clock()
                pending = send(request)
                if type(pending) is not CoroutineType and not hasattr(pending, "__await__"):
                    raise TypeError(
                        f"execute(request, send): send returned {type(pending).__name__}, not "
                        "an awaitable; make it a coroutine function (async def send(request): "
                        "...) or use execute_sync() for a blocking send"
                    )
                try:
                    result = await pending
                except RetryableError as failure:
                    request._in_flight = False
                    reason = failure.reason
                    effect = failure.effect
                    if effect is None:
                        effect = _EFFECT_OF[reason]
                    cause = failure.__cause__ or failure
                    # Request._record, inlined: this runs once per failed attempt
                    history.append([reason, effect, cause, clock() - request._sent_at, None])
                    request._last_error = cause
                    request._last_reason = reason
                    if effect is not _NOT_SENT:
                        request._sent = True
                        if effect is _MAYBE:
                            request._maybe_applied = True
                    request._sent_at = -1.0
                    if debug is _UNSET:
                        debug = _log_enabled(_DEBUG)
                    try:
                        plan = self._plan(request, reason, None, debug)
                        if plan is None:
                            plan = self._plan(
                                request, reason, await self._call_strategy(request, reason), debug
                            )
                    except CouchbaseException as exc:
                        if exc.__cause__ is None:  # keep a cause the strategy's factory chose
                            exc.__cause__ = cause
                        raise
                    assert plan is not None
                    if (plan[0] <= 0.0 and self._sleep_is_anyio) or _instant():  # one checkpoint
                        self._in_retry += 1
                        try:
                            await anyio.lowlevel.checkpoint()
                        finally:
                            self._in_retry -= 1
                    else:
                        await self._pause(request, plan[0])
                    if plan[2] or request._state is not _PENDING:
                        self._resume(request, reason, plan)  # raises
                    continue
                request._in_flight = False
                request._sent_at = -1.0
                if request._state is not _PENDING:  # Request.cancel() in flight
                    raise self._already_completed(request, request._last_reason)
                break
        except BaseException as exc:
            in_flight = request._in_flight
            request._in_flight = False
            try:
                if scope is not None:
                    request._cancel_scope = None
                    if scope.__exit__(type(exc), exc, exc.__traceback__) or self._cut_by_us(
                        scope, exc, in_flight=in_flight
                    ):
                        # Our deadline (or Request.cancel()) cut an attempt or a wait.
                        raise self._scope_fired(
                            request, exc if in_flight else None, in_flight=in_flight
                        ) from self._cause(request)
                raise
            except BaseException as final:
                # Whatever leaves execute (the original error, our timeout, or what the
                # scope re-raised from an exception group) completes the request.
                if isinstance(final, Exception):
                    if request._state is _PENDING and final is exc and in_flight:
                        # a non-retryable answer: it is the last attempt's failure
                        request._record(None, _MAYBE, exc, self._took(request))
                        if isinstance(exc, CouchbaseException):
                            old = exc.context  # none yet, or built by a mapper for this request
                            if old is None or old.request_id == request.id:
                                exc.context = request.error_context(
                                    request._last_reason, extra=None if old is None else old.extra
                                )
                    request._finish(RequestState.FAILED)
                else:
                    request._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)
                raise
        if scope is not None:
            request._cancel_scope = None
            scope.__exit__(None, None, None)
        request._finish(RequestState.SUCCEEDED)
        if history:
            _drop_tracebacks(history)
        return result

    # -- the sync door -----------------------------------------------------------
    def execute_sync(
        self,
        request: Request,
        send: Callable[[Request], T],
        *,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> T:
        """:meth:`execute` for synchronous callers (threads): same rules, same errors, same logs.

        ``send(request)`` is a blocking call; it should bound its own I/O by
        ``request.time_left`` (e.g. as a socket timeout), since a thread cannot be
        cancelled. Whatever ``send`` raises once the deadline has passed becomes the
        timeout (the attempt counts as cut in flight). Backoffs block in ``sleep``
        (default ``time.sleep``). Only synchronous strategies can be used here (the
        built-ins are); an async one raises TypeError. Safe to call from many threads
        on one orchestrator: the backpressure count is kept under a lock.
        """
        if type(request) is not Request and not isinstance(request, Request):
            raise TypeError(
                f"execute_sync(request, send): request must be an sdkcore.Request, got {request!r}"
            )
        if not callable(send):
            raise TypeError(
                f"execute_sync(request, send): send must be a callable (request) -> result, "
                f"got {send!r}"
            )
        if request._state is not _PENDING:
            raise self._already_completed(request, None)
        clock = request._clock
        deadline = request._deadline
        while True:
            if clock() >= deadline:
                raise self._timeout(request, request._last_reason) from self._cause(request)
            request._sent_at = clock()
            try:
                result = send(request)
            except RetryableError as failure:
                reason = failure.reason
                effect = failure.effect
                cause = failure.__cause__ or failure
                request._record(
                    reason,
                    _EFFECT_OF[reason] if effect is None else effect,
                    cause,
                    clock() - request._sent_at,
                )
                request._sent_at = -1.0
                self._retry_sync(request, reason, cause, sleep)
                continue
            except Exception as exc:
                if clock() >= deadline and request._state is _PENDING:
                    raise self._timeout(
                        request, request._last_reason, in_flight=True, error=exc
                    ) from exc
                if request._state is _PENDING:
                    request._record(None, _MAYBE, exc, self._took(request))
                request._finish(RequestState.FAILED)
                raise
            except BaseException:
                request._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)
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
            request._sent_at = -1.0
            if request._state is not _PENDING:  # Request.cancel() from another thread
                raise self._already_completed(request, request._last_reason)
            request._finish(RequestState.SUCCEEDED)
            return result

    def _retry_sync(
        self,
        request: Request,
        reason: RetryReason,
        cause: BaseException,
        sleep: Callable[[float], Any],
    ) -> None:
        """Decide and wait one retry on the calling thread (raises when not retried)."""
        try:
            strategy: Any = request._strategy or self._default
            if not reason.always_retry and _kind_of(strategy) == _ASYNC:
                request._finish(RequestState.FAILED)
                raise TypeError(
                    f"execute_sync needs a synchronous RetryStrategy; "
                    f"{_strategy_name(strategy)}.retry_after is a coroutine function. Use a "
                    "built-in strategy or one whose retry_after is a plain method, or "
                    "'await orchestrator.execute(...)'"
                )
            with self._lock:  # the capacity check and the count move together
                plan = self._plan(request, reason, None)
                if plan is None:
                    action = strategy.retry_after(request, reason)
                    plan = self._plan(request, reason, (action, strategy))
                assert plan is not None
                self._in_retry_sync += 1
        except CouchbaseException as exc:
            if exc.__cause__ is None:
                exc.__cause__ = cause
            raise
        try:
            if plan[0] > 0.0 and not _instant():
                sleep(plan[0])
        except BaseException as exc:
            request._finish_by(exc)
            raise
        finally:
            with self._lock:
                self._in_retry_sync -= 1
        if plan[2] or request._state is not _PENDING:
            try:
                self._resume(request, reason, plan)
            except CouchbaseException as exc:
                raise exc from self._cause(request)

    # -- hedged requests (rfc/0004) ------------------------------------------------
    async def hedge(
        self,
        request: Request,
        send: Callable[[Request, int], Awaitable[T]],
        policy: HedgePolicy,
        *,
        throttler: HedgeThrottler | None = None,
    ) -> T:
        """Send copies of an idempotent ``request`` ahead of failures; return the first success.

        ``send(request, index)`` sends hedge ``index`` (0 for the first; an SDK may
        send hedge ``i`` to another replica). The first attempt goes at once, the
        next after each ``policy.delay`` without an answer, up to
        ``policy.max_attempts`` (capped). The first result wins and every other
        attempt is cancelled; its result is returned. ``RetryableError`` with a
        non-fatal reason sends the next hedge at once (or after the pushback); any
        other exception cancels everything and propagates. When every copy failed,
        ``RequestCanceledException`` (NO_MORE_RETRIES) is raised for the *last*
        failure to arrive (its ``__cause__``). The request's timeout covers the
        whole chain (``UnambiguousTimeoutException``). ``throttler`` (e.g.
        ``sdkcore.grpc.RetryThrottler``) gates every hedge after the first.
        A request that is not idempotent is refused (InvalidArgumentException)
        and nothing is sent. Error contexts list every hedge under ``extra``.
        """
        return await run_hedged(self, request, send, policy, throttler)
