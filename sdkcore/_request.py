"""Request: what the orchestrator retries (RFC 0049 "Request Annotation")."""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import attrs

from . import _runtime
from ._action import RetryAction
from ._context import AttemptEffect, AttemptRecord, CancellationReason, ErrorContext, describe_error
from ._duration import MAX_SECONDS, to_seconds
from ._reason import RetryReason

__all__ = ["DEFAULT_TIMEOUT", "DispatchInfo", "Request", "RequestState", "RetryStrategy"]

#: The default request timeout: the Couchbase SDKs' KV timeout, 2.5 s.
DEFAULT_TIMEOUT = timedelta(milliseconds=2500)

_DEFAULT_SECONDS = DEFAULT_TIMEOUT.total_seconds()
_ids = itertools.count(1)
_NOT_SENT = AttemptEffect.NOT_SENT
_MAYBE = AttemptEffect.MAYBE_APPLIED
_EMPTY: Mapping[str, Any] = MappingProxyType({})

#: The request whose attempt is being sent in this task or thread (set by the doors
#: around ``send``): a Request built meanwhile takes the earlier of the two deadlines.
_DISPATCHING: ContextVar[Request | None] = ContextVar("sdkcore_dispatching", default=None)


@attrs.frozen(slots=True)
class DispatchInfo:
    """What a dispatcher puts on the wire for one attempt (:meth:`Request.dispatch_info`).

    ``attempt``: the 1-based number of the attempt being sent (gRPC's
    ``grpc-previous-rpc-attempts`` is ``attempt - 1``). ``time_left``: seconds until
    the request's deadline (0 once passed), None without one: a server-side timeout
    (Couchbase query's ``timeout``, gRPC's ``grpc-timeout``) should be this, not
    the request's full timeout.
    """

    attempt: int
    time_left: float | None


@runtime_checkable
class RetryStrategy(Protocol):
    """Decides whether and when a failed request is retried (RFC 0049 "Retry Strategies").

    ``retry_after`` may be a plain method returning a :class:`RetryAction` or a
    coroutine (it may await I/O): the orchestrator awaits what it returns when that
    is not a RetryAction. ``execute_sync`` takes only strategies that decide
    synchronously. The built-ins are in :mod:`sdkcore._strategy`; the protocol lives
    here, beside the :class:`Request` that carries one, so neither module imports
    the other's.
    """

    def retry_after(
        self, request: Request, reason: RetryReason
    ) -> RetryAction | Awaitable[RetryAction]: ...


class RequestState(enum.Enum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Request:
    """One logical operation, retried attempt by attempt.

    The application sets ``idempotent``, ``timeout``, ``retry_strategy`` and
    ``client_context``; the retry state (``retry_attempts``, ``retry_reasons``,
    completion) is read-only and changed only by the :class:`RetryOrchestrator`.

    ``timeout`` is a ``timedelta`` or seconds (> 0), or ``None`` for no deadline;
    the deadline starts when the request is created. A request created while another
    request's attempt is being sent (in its ``send``, same task or thread) never
    outlives that one: its deadline is the earlier of the two (deadline in).
    ``clock`` (seconds, monotonic) is injectable for tests; it must be the clock
    the orchestrator waits on.
    """

    __slots__ = (
        "__weakref__",
        "_attempts",
        "_cancel_scope",
        "_cancellation",
        "_clock",
        "_context",
        "_deadline",
        "_dispatched",
        "_history",
        "_id",
        "_idempotent",
        "_in_flight",
        "_last_error",
        "_last_reason",
        "_maybe_applied",
        "_memo",
        "_name",
        "_reasons",
        "_sent",
        "_sent_at",
        "_start",
        "_state",
        "_strategy",
        "_timeout_s",
    )

    def __init__(
        self,
        *,
        name: str = "request",
        idempotent: bool = False,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        retry_strategy: RetryStrategy | None = None,
        client_context: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idempotent is not True and idempotent is not False:
            raise TypeError(f"Request.idempotent must be a bool, got {idempotent!r}")
        if not isinstance(name, str):
            raise TypeError(f"Request.name must be a str, got {name!r}")
        if client_context is None:
            context = _EMPTY
        elif isinstance(client_context, Mapping):
            context = MappingProxyType(dict(client_context))
        else:
            raise TypeError(
                "Request.client_context must be a Mapping or None, "
                f"got {type(client_context).__name__}"
            )
        if retry_strategy is not None and (
            isinstance(retry_strategy, type)
            or not callable(getattr(retry_strategy, "retry_after", None))
        ):
            raise TypeError(
                "Request.retry_strategy must be a RetryStrategy instance (an object with a "
                f"retry_after(request, reason) method) or None, got {retry_strategy!r}"
            )
        if timeout is None:
            seconds = math.inf
        elif timeout is DEFAULT_TIMEOUT:
            seconds = _DEFAULT_SECONDS
        elif type(timeout) is float and 0.0 < timeout <= MAX_SECONDS:
            seconds = timeout
        else:
            seconds = to_seconds(timeout, "Request.timeout", allow_zero=False)
        self._id = next(_ids)
        self._name = name
        self._idempotent = idempotent
        self._strategy = retry_strategy
        self._context = context
        self._timeout_s = seconds
        self._clock = clock
        self._start = start = clock()
        self._deadline = start + seconds
        outer = _DISPATCHING.get()
        if outer is not None and outer._deadline != math.inf:
            # Dispatched from inside another request's send: never outlive it.
            left = outer._deadline - outer._clock()
            self._deadline = min(self._deadline, start + (left if left > 0.0 else 0.0))
        self._attempts = 0
        self._reasons: list[RetryReason] = []  # distinct, first-seen order (a list: 100 B less)
        self._state = RequestState.PENDING
        self._cancellation: CancellationReason | None = None
        self._sent = False
        self._in_flight = False
        self._last_reason: RetryReason | None = None
        self._cancel_scope: Any = None
        # One entry per failed attempt: [reason, effect, error, duration s, delay s].
        self._history: list[list[Any]] = []
        self._last_error: BaseException | None = None
        self._maybe_applied = False
        self._sent_at = -1.0  # clock time the attempt in flight was sent (-1: none)
        self._dispatched = False  # a door has counted its first attempt
        self._memo: tuple[Any, ...] | None = None  # see _resolved_by

    # -- what the application set (read-only once built) ----------------------
    @property
    def id(self) -> int:
        """Unique in this process; shown in logs and error contexts."""
        return self._id

    @property
    def name(self) -> str:
        return self._name

    @property
    def idempotent(self) -> bool:
        return self._idempotent

    @property
    def retry_strategy(self) -> RetryStrategy | None:
        """The per-request strategy, or None for the orchestrator's default."""
        return self._strategy

    @property
    def client_context(self) -> Mapping[str, Any]:
        """Read-only view of the caller's context (e.g. ``{"robot": True}``); empty if None."""
        return self._context

    # -- read-only retry state -------------------------------------------------
    @property
    def retry_attempts(self) -> int:
        """How many retries have happened (0 before the first retry)."""
        return self._attempts

    @property
    def retry_reasons(self) -> tuple[RetryReason, ...]:
        """Every distinct reason this request was retried for, in first-seen order."""
        return tuple(self._reasons)

    @property
    def timeout(self) -> timedelta | None:
        """The timeout the request was built with (None: no deadline)."""
        return None if self._timeout_s == math.inf else timedelta(seconds=self._timeout_s)

    @property
    def deadline(self) -> float:
        """The deadline on the request's ``clock`` (``math.inf`` without a timeout).

        ``clock`` defaults to ``time.monotonic``, which is not the event loop's clock on
        every backend (trio's differs): to arm a cancel scope use :meth:`loop_deadline`.
        """
        return self._deadline

    def loop_deadline(self) -> float:
        """The deadline on the running event loop's clock (``anyio.current_time()``).

        ``math.inf`` without a timeout. Call it from async code (asyncio or trio); it
        is what ``anyio.CancelScope(deadline=...)`` and ``trio.CancelScope`` expect.
        """
        if self._deadline == math.inf:
            return math.inf
        now: float = _runtime.current().now()
        return now + (self._deadline - self._clock())

    @property
    def clock(self) -> Callable[[], float]:
        """The clock (seconds, monotonic) the request's deadline is kept on."""
        return self._clock

    @property
    def elapsed(self) -> timedelta:
        return timedelta(seconds=self._clock() - self._start)

    @property
    def time_left(self) -> timedelta | None:
        """Time until the deadline (zero once passed), or None without a timeout."""
        if self._timeout_s == math.inf:
            return None
        return timedelta(seconds=max(0.0, self._deadline - self._clock()))

    def dispatch_info(self) -> DispatchInfo:
        """The attempt number and the time left, to put on the wire (deadline out).

        Call it inside ``send``: ``info = request.dispatch_info()``, then e.g. send
        ``timeout=f"{int(info.time_left * 1000)}ms"`` with a query.
        """
        if self._deadline == math.inf:
            return DispatchInfo(self._attempts + 1, None)
        left = self._deadline - self._clock()
        return DispatchInfo(self._attempts + 1, left if left > 0.0 else 0.0)

    @property
    def state(self) -> RequestState:
        return self._state

    @property
    def completed(self) -> bool:
        """True once the request succeeded, failed or was cancelled."""
        return self._state is not RequestState.PENDING

    @property
    def cancelled(self) -> bool:
        return self._state is RequestState.CANCELLED

    @property
    def cancellation_reason(self) -> CancellationReason | None:
        return self._cancellation

    @property
    def reached_network(self) -> bool:
        """True if some attempt may have been written to the network.

        Set when an attempt is cut off in flight, or when a failed attempt was
        recorded whose effect is not ``AttemptEffect.NOT_SENT``.
        """
        return self._sent

    @property
    def maybe_applied(self) -> bool:
        """True if some attempt may have been applied on the server.

        A timeout of a non-idempotent request is ambiguous exactly when this is true
        (see rfc/0001, "Ambiguity").
        """
        return self._maybe_applied

    @property
    def last_reason(self) -> RetryReason | None:
        """The reason of the last attempt that failed with one (None before any)."""
        return self._last_reason

    @property
    def last_effect(self) -> AttemptEffect | None:
        """What is known about the server side of the last failed attempt (None before any)."""
        history = self._history
        return history[-1][1] if history else None

    @property
    def in_flight(self) -> bool:
        """True while an attempt is being sent (between its start and its outcome)."""
        return self._in_flight

    @property
    def failed_attempts(self) -> int:
        """How many attempts failed (or were cut in flight) so far: ``len(attempts)``."""
        return len(self._history)

    @property
    def attempts(self) -> tuple[AttemptRecord, ...]:
        """Every failed attempt so far, oldest first (see :class:`AttemptRecord`)."""
        return self._records()

    @property
    def last_error(self) -> BaseException | None:
        """The last attempt's failure (its cause when it was a ``RetryableError``)."""
        return self._last_error

    # -- application control ----------------------------------------------------
    def cancel(self) -> None:
        """Cancel the request from the application (on the event loop's thread).

        A request waiting in retry backoff wakes at once, and so does an attempt in
        flight inside ``execute`` when the request has a timeout; the caller of
        ``maybe_retry``/``execute`` gets RequestCanceledException
        (CANCELLED_VIA_CONTEXT). Without a timeout, an attempt in flight runs to its
        end and its result is discarded. Cancelling a completed request does nothing.
        """
        if self._state is not RequestState.PENDING:
            return
        self._state = RequestState.CANCELLED
        self._cancellation = CancellationReason.CANCELLED_VIA_CONTEXT
        scope = self._cancel_scope
        if scope is not None:
            scope.cancel()

    # -- transitions (called by the doors and the hedging runner only) ------------
    # A request's retry state changes only through these methods: every other module
    # reads it through the properties above (rfc/0001, "Who changes a request").
    def _begin_attempt(self, now: float) -> None:
        """An attempt is being sent at ``now`` (the request's clock)."""
        self._in_flight = True
        self._sent_at = now

    def _dispatching(self) -> Any:
        """Mark this request as the one being sent in this task or thread (a reset token)."""
        return _DISPATCHING.set(self)

    @staticmethod
    def _dispatched_done(token: Any) -> None:
        _DISPATCHING.reset(token)

    def _first_dispatch(self) -> bool:
        """True the first time a door asks: the request's first attempt goes out."""
        if self._dispatched:
            return False
        self._dispatched = True
        return True

    def _attempt_failed(
        self,
        reason: RetryReason | None,
        effect: AttemptEffect,
        error: BaseException | None,
        now: float,
        started: float | None = None,
    ) -> None:
        """Book the attempt in flight (or the last one sent) as failed at ``now``.

        ``reason`` None: it failed otherwise (a final answer) or was cut in flight.
        Its backoff is booked by :meth:`_retry_booked` when it is retried.
        ``started``: when it was sent, on the same clock as ``now`` (a hedge's own
        start; default: the one :meth:`_begin_attempt` booked).
        """
        if started is None:
            started = self._sent_at
        self._history.append(
            [reason, effect, error, None if started < 0.0 else now - started, None]
        )
        self._in_flight = False
        self._sent_at = -1.0
        if error is not None:
            previous = self._last_error
            if previous is not None and previous is not error:
                # Only the last failure keeps its traceback (the final exception's
                # __cause__): the frames of older ones are freed at once, so a request
                # waiting in backoff holds one failed attempt's frames, not every one.
                previous.__traceback__ = None
            self._last_error = error
        if reason is not None:
            self._last_reason = reason
        if effect is not _NOT_SENT:
            self._sent = True
            if effect is _MAYBE:
                self._maybe_applied = True

    def _retry_booked(self, reason: RetryReason, delay: float | None) -> None:
        """The failed attempt is retried for ``reason`` after ``delay`` seconds."""
        self._attempts += 1
        if reason not in self._reasons:
            self._reasons.append(reason)
        history = self._history
        if history:
            history[-1][4] = delay

    def _hedge_sent(self) -> None:
        """One more copy of a hedged request went out (a retry, by the RFC's count)."""
        self._attempts += 1

    def _reason_seen(self, reason: RetryReason) -> None:
        """A hedge failed for ``reason``: listed in ``retry_reasons``."""
        if reason not in self._reasons:
            self._reasons.append(reason)

    def _resolved_by(self, door: object, resolve: Callable[[Request], tuple[Any, ...]]) -> Any:
        """What ``door`` (an orchestrator) works out once per request: ``(door, *resolve(self))``.

        The strategy to ask and the debug logger: inputs that do not change while the
        request runs. A hand-wired loop calls ``maybe_retry`` once per failure, and
        asking again each time cost about 0.7 us per retry (bench/README,
        "bench_doors.py").
        """
        memo = self._memo
        if memo is None or memo[0] is not door:
            memo = self._memo = (door, *resolve(self))
        return memo

    def _set_cancel_hook(self, hook: Any) -> Any:
        """``Request.cancel()`` calls ``hook.cancel()`` from now on; returns the previous hook."""
        previous = self._cancel_scope
        self._cancel_scope = hook
        return previous

    def _succeeded(self) -> None:
        """The request got its answer.

        The last failure lets go of its traceback (:meth:`_attempt_failed` freed the
        older ones): a traceback holds the frames it passed through, and those hold
        the request, whose history holds the failure: a reference cycle per retried
        call (about 1 us per retry in bench/bench_core.py). Types and messages stay
        for :attr:`attempts`.
        """
        if self._state is RequestState.PENDING:
            self._state = RequestState.SUCCEEDED
        error = self._last_error
        if error is not None:
            error.__traceback__ = None

    def _finish(self, state: RequestState, why: CancellationReason | None = None) -> None:
        """Complete the request (once: a completed request keeps its first ending)."""
        if self._state is RequestState.PENDING:
            self._state = state
            self._cancellation = why

    def _finish_by(self, exc: BaseException) -> None:
        """The call ended with ``exc``: FAILED for an error, CANCELLED (TASK_CANCELLED) else."""
        if isinstance(exc, Exception):
            self._finish(RequestState.FAILED)
        else:
            self._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)

    def _reopen_for_timeout(self) -> None:
        """Whatever a cut left behind (e.g. marked cancelled by the task), it timed out."""
        if self._cancellation is not CancellationReason.CANCELLED_VIA_CONTEXT:
            self._state = RequestState.PENDING
            self._cancellation = None

    def _records(self) -> tuple[AttemptRecord, ...]:
        return tuple(
            AttemptRecord(
                number=n,
                reason=reason,
                effect=effect,
                error=describe_error(error),
                duration=None if duration is None else timedelta(seconds=duration),
                delay=None if delay is None else timedelta(seconds=delay),
            )
            for n, (reason, effect, error, duration, delay) in enumerate(self._history, 1)
        )

    def error_context(
        self,
        reason: RetryReason | None = None,
        *,
        strategy: str | None = None,
        extra: Mapping[str, Any] | None = None,
        in_flight: bool = False,
    ) -> ErrorContext:
        """A snapshot of this request for an exception's ``context``."""
        return ErrorContext(
            request_id=self.id,
            request_name=self.name,
            idempotent=self.idempotent,
            retry_attempts=self._attempts,
            retry_reasons=tuple(self._reasons),
            timeout=self.timeout,
            elapsed=timedelta(seconds=self._clock() - self._start),
            reason=reason,
            cancellation_reason=self._cancellation,
            strategy=strategy,
            extra=_EMPTY if extra is None else MappingProxyType(dict(extra)),
            last_error=describe_error(self._last_error),
            in_flight=in_flight,
            attempts=self._records(),
        )

    def __repr__(self) -> str:
        return (
            f"<Request id={self.id} name={self.name!r} idempotent={self.idempotent} "
            f"retry_attempts={self._attempts} state={self._state.value}>"
        )
