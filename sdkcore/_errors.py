"""The exception hierarchy (SDK3 error handling names) and RetryableError."""

from __future__ import annotations

from datetime import timedelta
from typing import TypeGuard

from ._context import DEFAULT_EFFECT, AttemptEffect, ErrorContext
from ._duration import to_seconds
from ._reason import RetryReason, suggest_member

__all__ = [
    "AmbiguousTimeoutException",
    "AuthenticationFailureException",
    "CasMismatchException",
    "CollectionNotFoundException",
    "CouchbaseException",
    "DocumentExistsException",
    "DocumentLockedException",
    "DocumentNotFoundException",
    "FeatureNotAvailableException",
    "InternalServerFailureException",
    "InvalidArgumentException",
    "QuotaLimitedException",
    "RateLimitedException",
    "RequestCanceledException",
    "RetryableError",
    "ScopeNotFoundException",
    "ServiceNotAvailableException",
    "TemporaryFailureException",
    "TimeoutException",
    "UnambiguousTimeoutException",
]


def _rebuild(
    cls: type[CouchbaseException], message: str, context: ErrorContext | None
) -> CouchbaseException:
    return cls(message, context=context)


class CouchbaseException(Exception):
    """Base of every error sdkcore raises to the application.

    ``context`` is an :class:`ErrorContext` (or ``None`` when raised outside a
    request); ``str(exc)`` shows the message followed by the context as JSON.
    """

    default_message = "operation failed"

    #: What this error, the final answer of an attempt, proves of that attempt's command on
    #: the server: ``AttemptEffect.NOT_APPLIED`` for an answer that proves it changed
    #: nothing (an ADD answered "exists": the KV mapper sets it), None when nothing is known
    #: (the doors book it maybe applied, the safe side). It describes one command: a
    #: ``send`` that issues several lets it through only for the first. Anything but an
    #: AttemptEffect (a subclass's own ``effect``) counts as None (:func:`final_effect`).
    effect: AttemptEffect | None = None

    def __init__(self, message: str | None = None, *, context: ErrorContext | None = None) -> None:
        if message is not None and not isinstance(message, str):
            raise TypeError(
                f"{type(self).__name__}(message) must be a str or None, got {message!r}"
            )
        if context is not None and not isinstance(context, ErrorContext):
            raise TypeError(
                f"{type(self).__name__}(context=...) must be an sdkcore.ErrorContext or None, "
                f"got {context!r}"
            )
        self.message = message if message is not None else self.default_message
        self.context = context
        super().__init__(self.message)

    def __str__(self) -> str:
        if self.context is None:
            return self.message
        return f"{self.message} {self.context}"

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only context: rebuild through a helper so pickle/copy work.
        return (_rebuild, (type(self), self.message, self.context), self.__dict__ or None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, context={self.context!r})"


class TimeoutException(CouchbaseException, TimeoutError):
    """The request did not complete before its timeout.

    Also a builtin :class:`TimeoutError` (so ``except TimeoutError`` and
    ``asyncio.wait_for`` callers catch it, as they catch other libraries' timeouts);
    ``errno`` and ``strerror`` are None.
    """

    default_message = "request timed out"


class AmbiguousTimeoutException(TimeoutException):
    """Timed out; the request is not idempotent and an attempt may have been applied
    (``Request.maybe_applied``), so it may or may not have run: retrying it could apply
    it twice."""

    default_message = "request timed out; it may have been applied on the server (ambiguous)"


class UnambiguousTimeoutException(TimeoutException):
    """Timed out, and whether it ran does not matter: no attempt may have been applied
    (none is ``AttemptEffect.MAYBE_APPLIED``), or the request is idempotent, so one that
    may have been applied is safe to send again (applying it again changes nothing)."""

    default_message = "request timed out; it was not applied on the server (unambiguous)"


class RequestCanceledException(CouchbaseException):
    """The request was cancelled; ``context.cancellation_reason`` says why:

    * ``NO_MORE_RETRIES``: the strategy declined to retry (without an exception of its
      own), a request that is not idempotent may not be sent again, or a hedged request
      may send no more copies;
    * ``TOO_MANY_REQUESTS_IN_RETRY``: ``max_requests_in_retry`` requests were waiting;
    * ``RETRY_BUDGET_EXHAUSTED``: the retry budget refused the retry (or more hedges);
    * ``CANCELLED_VIA_CONTEXT``: the application called ``Request.cancel()``.

    A request that times out raises a :class:`TimeoutException` (``TIMEOUT``), also when
    it is handed to a door again; one whose task is cancelled lets the task's own
    cancellation propagate (``TASK_CANCELLED``), and handing it to a door again raises
    this exception with that reason. ``sdkcore.mapping`` also maps a gRPC ``CANCELLED``
    status to it.
    """

    default_message = "request canceled"


class AuthenticationFailureException(CouchbaseException):
    """The server rejected the credentials (RetryReason.AUTHENTICATION_ERROR)."""

    default_message = "authentication failed"


class ScopeNotFoundException(CouchbaseException):
    """The scope does not exist in the collections manifest."""

    default_message = "scope not found"


class CollectionNotFoundException(CouchbaseException):
    """The collection does not exist in the collections manifest."""

    default_message = "collection not found"


class RetryableError(Exception):
    """Raised by a ``send`` callable given to ``RetryOrchestrator.execute``.

    It reports that one attempt failed for ``reason``; the orchestrator then
    decides whether to retry. Chain the original error
    (``raise RetryableError(reason) from exc``) or pass ``cause=``: it is logged as
    ``caused_by``, recorded as the context's ``last_error``, and becomes the
    ``__cause__`` of the final exception when the request is not retried.

    ``effect`` says what is known about the server side of this attempt (see
    :class:`AttemptEffect`); the default follows from the reason's flags. Pass
    ``AttemptEffect.MAYBE_APPLIED`` when the server answered with a status that does
    not prove the operation was not applied (e.g. gRPC UNAVAILABLE from the server).

    ``retry_after`` (a ``timedelta`` or seconds) says the server asked for at least
    this long before the next attempt (HTTP ``Retry-After``, gRPC pushback, a circuit
    breaker's sleep window): the retry waits the longer of it and the strategy's
    backoff, and a hint that ends past the deadline times the request out at once.
    """

    __slots__ = ("_message", "effect", "reason", "retry_after")

    def __init__(
        self,
        reason: RetryReason,
        message: str = "",
        *,
        cause: BaseException | None = None,
        effect: AttemptEffect | None = None,
        retry_after: timedelta | float | None = None,
    ):
        if type(reason) is not RetryReason:
            raise TypeError(
                f"RetryableError reason must be a RetryReason, got {reason!r}"
                + suggest_member(reason, RetryReason)
            )
        if effect is not None and type(effect) is not AttemptEffect:
            raise TypeError(
                f"RetryableError effect must be an AttemptEffect or None, got {effect!r}"
                + suggest_member(effect, AttemptEffect)
            )
        # No Exception.__init__: BaseException.__new__ has already kept the positional
        # arguments as ``args`` ((reason,) or (reason, message)), and replacing them with
        # (message,) cost 0.2 us of the 0.5 us this constructor took; it runs once per
        # failed attempt (bench/README, "Cancellation races and RetryableError").
        self.reason = reason
        self._message = message  # the text given with the reason ("" for none)
        self.effect = effect
        #: Seconds the server asked to wait at least (None: no hint).
        self.retry_after: float | None = (
            None if retry_after is None else to_seconds(retry_after, "RetryableError.retry_after")
        )
        if cause is not None:
            self.__cause__ = cause

    def __str__(self) -> str:
        message = self._message
        return f"{self.reason.name}: {message}" if message else self.reason.name

    def __repr__(self) -> str:
        parts = [f"RetryReason.{self.reason.name}"]
        if self._message:
            parts.append(repr(self._message))
        if self.effect is not None:
            parts.append(f"effect=AttemptEffect.{self.effect.name}")
        if self.retry_after is not None:
            parts.append(f"retry_after={self.retry_after!r}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_retryable,
            (type(self), self.reason, self._message, self.effect, self.retry_after),
        )


def final_effect(error: BaseException, request_id: int) -> AttemptEffect:
    """How a door books an attempt of request ``request_id`` that ``error`` answered (not a
    RetryableError): what a ``CouchbaseException`` proves of it
    (:attr:`CouchbaseException.effect`), else maybe applied (nothing proves otherwise).

    Only an answer to this request: an error whose context is another request's (an inner
    request's final answer that ``send`` let through) proves something of that request's
    command, not of this attempt, which may have written other things: maybe applied."""
    if isinstance(error, CouchbaseException):
        effect = getattr(error, "effect", None)
        if type(effect) is AttemptEffect:
            context = error.context
            if context is None or context.request_id == request_id:
                return effect
    return AttemptEffect.MAYBE_APPLIED


def sent_nothing(error: BaseException) -> TypeGuard[RetryableError]:
    """Whether ``error`` is a RetryableError saying the attempt never left the client: its
    ``effect``, else its reason's default (:meth:`AttemptEffect.for_reason`), is NOT_SENT."""
    if not isinstance(error, RetryableError):
        return False
    effect = error.effect
    if effect is None:
        effect = DEFAULT_EFFECT[error.reason]
    return effect is AttemptEffect.NOT_SENT


def _rebuild_retryable(
    cls: type[RetryableError],
    reason: RetryReason,
    message: str,
    effect: AttemptEffect | None,
    retry_after: float | None = None,
) -> RetryableError:
    return cls(reason, message, effect=effect, retry_after=retry_after)


# -- errors produced by the failure mappers (sdkcore.mapping) and adapters --------------


class CasMismatchException(CouchbaseException):
    """The document's CAS did not match (also: KV_LOCKED on Unlock)."""

    default_message = "CAS mismatch"


class DocumentNotFoundException(CouchbaseException):
    """The document does not exist (KV KEY_NOT_FOUND, gRPC NOT_FOUND)."""

    default_message = "document not found"


class DocumentExistsException(CouchbaseException):
    """The document already exists (KV KEY_EXISTS without a CAS, NOT_STORED on ADD; gRPC
    ALREADY_EXISTS)."""

    default_message = "document already exists"


class DocumentLockedException(CouchbaseException):
    """The document is locked (KV LOCKED on any operation but UNLOCK)."""

    default_message = "document locked"


class FeatureNotAvailableException(CouchbaseException):
    """The server does not support the operation (KV UNKNOWN_COMMAND, NOT_SUPPORTED; gRPC
    UNIMPLEMENTED)."""

    default_message = "feature not available"


class InvalidArgumentException(CouchbaseException):
    """The request is malformed: the server said so (KV INVALID_ARGUMENTS,
    DELTA_BAD_VALUE; gRPC INVALID_ARGUMENT, OUT_OF_RANGE), or ``RetryOrchestrator.hedge``
    was given a request that is not idempotent (nothing is sent)."""

    default_message = "invalid argument"


class InternalServerFailureException(CouchbaseException):
    """The server failed internally (KV INTERNAL_ERROR; gRPC INTERNAL, UNKNOWN,
    ABORTED as the gRPC mapper's final answer)."""

    default_message = "internal server failure"


class RateLimitedException(CouchbaseException):
    """The server refused the request for a rate limit (KV RATE_LIMITED_*, HTTP 429 with a
    limit marker, gRPC RESOURCE_EXHAUSTED); not retried."""

    default_message = "rate limited"


class QuotaLimitedException(CouchbaseException):
    """The server refused the request for a quota (KV SCOPE_SIZE_LIMIT_EXCEEDED, HTTP 429
    with a quota marker); not retried."""

    default_message = "quota limited"


class ServiceNotAvailableException(CouchbaseException):
    """The service a request needs is not available. For an SDK's own code: sdkcore's
    mappers report a service not available as a retryable SERVICE_NOT_AVAILABLE instead."""

    default_message = "service not available"


class TemporaryFailureException(CouchbaseException):
    """The server is temporarily unable to serve (KV NO_MEMORY, BUSY, TEMPORARY_FAILURE;
    rfc/0002)."""

    default_message = "temporary failure"
