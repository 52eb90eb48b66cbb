"""RetryOrchestrator: RFC 0049 "Retry Orchestration" and "Capping the Retry Duration".

``maybe_retry`` is the decision plus the wait; ``execute`` is the dispatch loop
built on it for SDK code that does not want to write its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import anyio

from . import _log
from ._action import RetryAction
from ._backoff import controlled_backoff
from ._context import CancellationReason, ErrorContext
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
    """

    __slots__ = ("_default", "_in_retry", "_max_in_retry", "_sleep", "_sleep_is_anyio")

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
        self._default: RetryStrategy = default_strategy
        self._max_in_retry = max_requests_in_retry
        self._in_retry = 0
        self._sleep = anyio.sleep if sleep is None else sleep
        self._sleep_is_anyio = sleep is None

    @property
    def default_strategy(self) -> RetryStrategy:
        return self._default

    @property
    def max_requests_in_retry(self) -> int:
        return self._max_in_retry

    @property
    def requests_in_retry(self) -> int:
        """How many requests are waiting in retry backoff right now."""
        return self._in_retry

    # -- the decision ----------------------------------------------------------
    async def maybe_retry(self, request: Request, reason: RetryReason) -> timedelta:
        """Retry ``request`` for ``reason``, or fail it.

        Returns the delay waited once the caller should re-dispatch. Raises when it
        must not: the strategy's chosen exception or RequestCanceledException
        (NO_MORE_RETRIES / TOO_MANY_REQUESTS_IN_RETRY / CANCELLED_VIA_CONTEXT), a
        TimeoutException when the backoff reaches the deadline, or whatever the
        strategy raised.
        """
        plan = self._plan(request, reason, None)
        if plan is None:  # a strategy whose retry_after must be awaited
            plan = self._plan(request, reason, await self._call_strategy(request, reason))
        assert plan is not None
        if plan[0] <= 0.0 and self._sleep_is_anyio:  # zero delay: one checkpoint
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

    def _plan(
        self, request: Request, reason: RetryReason, decided: tuple[Any, Any] | None
    ) -> tuple[float, timedelta, bool] | None:
        """Decide and book a retry: (delay seconds, delay, capped), or raise.

        ``decided`` is (action, strategy) when the strategy was already awaited;
        returns None when the strategy has to be awaited first.
        """
        if type(request) is not Request and not isinstance(request, Request):
            raise TypeError(
                f"maybe_retry(request, reason): request must be an sdkcore.Request, got {request!r}"
            )
        if request._state is not _PENDING:
            raise self._already_completed(request, reason)
        if type(reason) is not RetryReason:
            raise TypeError(
                f"maybe_retry(request, reason): reason must be a RetryReason, got {reason!r}"
            )

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

        if self._in_retry >= self._max_in_retry:
            self._too_many(request, reason, strategy)

        request._attempts += 1
        request._reasons[reason] = None
        request._last_reason = reason
        if reason.after_dispatch:
            request._sent = True

        capped = False
        if request._deadline != _INF:
            left = request._deadline - request._clock()
            if delay >= left:  # RFC 0049 "Capping the Retry Duration"
                capped = True
                delay = left if left > 0.0 else 0.0
                duration = timedelta(seconds=delay)

        log = _log_enabled(_DEBUG)
        if log is not None:
            log.debug(
                _log.EVENT_SCHEDULED,
                request_id=request.id,
                request_name=request.name,
                reason=reason.name,
                attempt=request._attempts,
                delay_ms=round(delay * 1000.0, 3),
                capped=capped,
                idempotent=request.idempotent,
                strategy=self._name(strategy),
            )
        return delay, duration, capped

    def _resume(
        self, request: Request, reason: RetryReason, plan: tuple[float, timedelta, bool]
    ) -> timedelta:
        """After the backoff: the delay waited, or the reason not to re-dispatch."""
        if request._state is not _PENDING:
            raise self._already_completed(request, reason)
        if plan[2]:  # the capped backoff ran into the deadline
            raise self._timeout(request, reason)
        return plan[1]

    async def _pause(self, request: Request, delay: float) -> None:
        """Wait out a backoff; Request.cancel() wakes it early."""
        self._in_retry += 1
        outer = request._cancel_scope
        try:
            with anyio.CancelScope() as scope:
                request._cancel_scope = scope
                try:
                    await self._sleep(delay)
                finally:
                    request._cancel_scope = outer
        except BaseException as exc:
            if isinstance(exc, Exception):  # e.g. an injected sleep that failed
                request._finish(RequestState.FAILED)
            else:
                request._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)
            raise
        finally:
            self._in_retry -= 1

    def succeed(self, request: Request) -> None:
        """Mark ``request`` as succeeded (for hand-wired dispatch loops; ``execute`` does it).

        A completed request cannot be retried; this does nothing if it already completed.
        """
        request._finish(RequestState.SUCCEEDED)

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

    def _strategy_failed(
        self, request: Request, reason: RetryReason, strategy: Any, error: BaseException
    ) -> None:
        request._finish(RequestState.FAILED)
        log = _log.enabled(_log.WARNING)
        if log is not None:
            log.warning(
                _log.EVENT_STRATEGY_FAILED,
                request_id=request.id,
                request_name=request.name,
                reason=reason.name,
                attempt=request._attempts,
                idempotent=request.idempotent,
                strategy=_strategy_name(strategy),
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
            self._log_refusal(log, request, reason, strategy)
        raise RequestCanceledException(
            f"not retried: {self._max_in_retry} requests are already waiting in retry",
            context=request.error_context(reason, strategy=self._name(strategy)),
        )

    # -- failing ---------------------------------------------------------------
    @staticmethod
    def _name(strategy: object) -> str:
        return "controlled_backoff" if strategy is None else _strategy_name(strategy)

    def _log_refusal(self, log: Any, request: Request, reason: RetryReason, strategy: Any) -> None:
        why = request._cancellation
        log.info(
            _log.EVENT_NOT_RETRIED,
            request_id=request.id,
            request_name=request.name,
            reason=reason.name,
            attempt=request._attempts,
            idempotent=request.idempotent,
            strategy=self._name(strategy),
            cancellation_reason=None if why is None else why.name,
        )

    def _refuse(
        self, request: Request, reason: RetryReason, action: RetryAction, strategy: Any
    ) -> NoReturn:
        request._finish(RequestState.CANCELLED, CancellationReason.NO_MORE_RETRIES)
        log = _log.enabled(_log.INFO)
        if log is not None:
            self._log_refusal(log, request, reason, strategy)
        context = request.error_context(reason, strategy=self._name(strategy))
        if action.exception is None:
            raise RequestCanceledException(
                f"not retried: {self._name(strategy)} declined to retry after {reason.name}",
                context=context,
            )
        raise action.exception(context)

    def _already_completed(self, request: Request, reason: RetryReason | None) -> BaseException:
        context = request.error_context(reason)
        if request._state is RequestState.CANCELLED:
            return RequestCanceledException("request was cancelled", context=context)
        return RuntimeError(
            f"request {request.id} ({request.name!r}) is already {request._state.value}; "
            f"it cannot be retried. Context: {context}"
        )

    def _timeout(
        self, request: Request, reason: RetryReason | None, *, in_flight: bool = False
    ) -> TimeoutException:
        request._finish(RequestState.CANCELLED, CancellationReason.TIMEOUT)
        if in_flight:
            request._sent = True
        ambiguous = not request.idempotent and request._sent
        log = _log.enabled(_log.INFO)
        if log is not None:
            log.info(
                _log.EVENT_TIMED_OUT,
                request_id=request.id,
                request_name=request.name,
                reason=None if reason is None else reason.name,
                attempt=request._attempts,
                idempotent=request.idempotent,
                in_flight=in_flight,
                ambiguous=ambiguous,
            )
        context = request.error_context(reason)
        if ambiguous:
            return AmbiguousTimeoutException(context=context)
        return UnambiguousTimeoutException(context=context)

    # -- the dispatch loop -----------------------------------------------------
    async def execute(self, request: Request, send: Callable[[Request], Awaitable[T]]) -> T:
        """Run ``send(request)`` attempt by attempt until it returns, then return its result.

        ``send`` reports a retryable failure by raising :class:`RetryableError`
        (carrying the RetryReason); any other exception fails the request and
        propagates unchanged. The request's timeout spans all attempts: an attempt
        still in flight at the deadline is cancelled and a timeout raised
        (unambiguous if the request is idempotent, ambiguous otherwise). When the
        request is not retried, the final exception's ``__cause__`` is the
        attempt's failure.
        """
        if type(request) is not Request and not isinstance(request, Request):
            raise TypeError(
                f"execute(request, send): request must be an sdkcore.Request, got {request!r}"
            )
        if not callable(send):
            raise TypeError(
                "execute(request, send): send must be a callable (request) -> awaitable, "
                f"got {send!r}"
            )
        if request._state is not _PENDING:
            raise self._already_completed(request, None)
        # One cancel scope spans every attempt and backoff. It is entered and left by
        # hand (not with ``with``) so that both paths share one loop and one frame.
        scope: anyio.CancelScope | None = None
        if request._deadline != _INF:
            left = request._deadline - request._clock()
            if left <= 0.0:  # expired before the first attempt: nothing is sent
                raise self._timeout(request, request._last_reason)
            scope = anyio.CancelScope(deadline=anyio.current_time() + left)
            scope.__enter__()
            request._cancel_scope = scope  # Request.cancel() stops an attempt in flight
        try:
            while True:
                request._in_flight = True
                try:
                    result = await send(request)
                except RetryableError as failure:
                    request._in_flight = False
                    reason = failure.reason
                    try:
                        plan = self._plan(request, reason, None)
                        if plan is None:
                            plan = self._plan(
                                request, reason, await self._call_strategy(request, reason)
                            )
                    except CouchbaseException as exc:
                        if exc.__cause__ is None:  # keep a cause the strategy's factory chose
                            exc.__cause__ = failure.__cause__ or failure
                        raise
                    assert plan is not None
                    if plan[0] <= 0.0 and self._sleep_is_anyio:  # zero delay: one checkpoint
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
                if request._state is not _PENDING:  # Request.cancel() in flight
                    raise self._already_completed(request, request._last_reason)
                break
        except BaseException as exc:
            try:
                if scope is not None:
                    request._cancel_scope = None
                    if scope.__exit__(type(exc), exc, exc.__traceback__):
                        # Our own scope caught the cancellation it delivered.
                        raise self._scope_fired(request) from None
                raise
            except BaseException as final:
                # Whatever leaves execute (the original error, our timeout, or what the
                # scope re-raised from an exception group) completes the request.
                if isinstance(final, Exception):
                    request._finish(RequestState.FAILED)
                else:
                    request._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)
                raise
        if scope is not None:
            request._cancel_scope = None
            scope.__exit__(None, None, None)
        request._finish(RequestState.SUCCEEDED)
        return result

    def _scope_fired(self, request: Request) -> CouchbaseException:
        """The exception for a request whose ``execute`` scope was cancelled."""
        if request._cancellation is CancellationReason.CANCELLED_VIA_CONTEXT:
            error = self._already_completed(request, request._last_reason)
            assert isinstance(error, CouchbaseException)
            return error
        # The deadline: whatever was waiting or in flight saw a cancellation (and may
        # have marked the request cancelled), but the request timed out.
        request._state = RequestState.PENDING
        return self._timeout(request, request._last_reason, in_flight=request._in_flight)

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
