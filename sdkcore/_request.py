"""Request: what the orchestrator retries (RFC 0049 "Request Annotation")."""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ._context import AttemptEffect, AttemptRecord, CancellationReason, ErrorContext, describe_error
from ._duration import MAX_SECONDS, to_seconds
from ._reason import RetryReason

if TYPE_CHECKING:
    from ._strategy import RetryStrategy

__all__ = ["DEFAULT_TIMEOUT", "Request", "RequestState"]

#: The default request timeout: the Couchbase SDKs' KV timeout, 2.5 s.
DEFAULT_TIMEOUT = timedelta(milliseconds=2500)

_DEFAULT_SECONDS = DEFAULT_TIMEOUT.total_seconds()
_ids = itertools.count(1)
_NOT_SENT = AttemptEffect.NOT_SENT
_MAYBE = AttemptEffect.MAYBE_APPLIED
_EMPTY: Mapping[str, Any] = MappingProxyType({})


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
    the deadline starts when the request is created. ``clock`` (seconds, monotonic)
    is injectable for tests; it must be the clock the orchestrator waits on.
    """

    __slots__ = (
        "__weakref__",
        "_attempts",
        "_cancel_scope",
        "_cancellation",
        "_clock",
        "_context",
        "_deadline",
        "_history",
        "_id",
        "_idempotent",
        "_in_flight",
        "_last_error",
        "_last_reason",
        "_maybe_applied",
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
        if type(name) is not str and not isinstance(name, str):
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
        self._attempts = 0
        self._reasons: dict[RetryReason, None] = {}
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

        ``math.inf`` without a timeout. Call it from async code; it is what
        ``anyio.CancelScope(deadline=...)`` expects.
        """
        if self._deadline == math.inf:
            return math.inf
        import anyio  # already imported by any running anyio backend

        now = anyio.current_time()  # first: its first call may import the backend
        return now + (self._deadline - self._clock())

    @property
    def elapsed(self) -> timedelta:
        return timedelta(seconds=self._clock() - self._start)

    @property
    def time_left(self) -> timedelta | None:
        """Time until the deadline (zero once passed), or None without a timeout."""
        if self._timeout_s == math.inf:
            return None
        return timedelta(seconds=max(0.0, self._deadline - self._clock()))

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

    # -- orchestrator-only -----------------------------------------------------
    def _finish(self, state: RequestState, why: CancellationReason | None = None) -> None:
        if self._state is RequestState.PENDING:
            self._state = state
            self._cancellation = why

    def _finish_by(self, exc: BaseException) -> None:
        """The call ended with ``exc``: FAILED for an error, CANCELLED (TASK_CANCELLED) else."""
        if isinstance(exc, Exception):
            self._finish(RequestState.FAILED)
        else:
            self._finish(RequestState.CANCELLED, CancellationReason.TASK_CANCELLED)

    def _record(
        self,
        reason: RetryReason | None,
        effect: AttemptEffect,
        error: BaseException | None,
        duration: float | None,
    ) -> None:
        """Book one failed (or cut) attempt (its delay is set by the retry decision).

        ``RetryOrchestrator.execute`` inlines this for a RetryableError (its hot path).
        """
        self._history.append([reason, effect, error, duration, None])
        if error is not None:
            self._last_error = error
        if reason is not None:
            self._last_reason = reason
        if effect is not _NOT_SENT:
            self._sent = True
            if effect is _MAYBE:
                self._maybe_applied = True

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
