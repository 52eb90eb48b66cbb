"""Connection-level failures by stage (RFC 0049 "Different Stage Retry Semantics").

* Client dispatch: the request was not written to a socket. Nothing reached the
  server, so any request may be retried: SOCKET_NOT_AVAILABLE, NODE_NOT_AVAILABLE,
  SERVICE_NOT_AVAILABLE or CIRCUIT_BREAKER_OPEN (all allow non-idempotent retry).
* Network time: the request was written and the socket closed before a response:
  SOCKET_CLOSED_WHILE_IN_FLIGHT. Its flags forbid retrying a non-idempotent
  request, so the orchestrator's strategies retry it only when the request is
  idempotent; the reason is the same for both, so the error context always says
  what happened.

Response-received failures are mapped by the KV/HTTP/gRPC helpers.
"""

from __future__ import annotations

import enum
from typing import NoReturn

from .._context import AttemptEffect
from .._errors import CouchbaseException, RetryableError
from .._reason import RetryReason
from .._request import Request
from .._untrusted import show as _show

__all__ = ["FailureStage", "dispatch_failure_reason", "raise_failure", "retry_allowed"]


class FailureStage(enum.Enum):
    """Where a connection-level failure happened."""

    #: No node can take the request (not in the topology, or marked down).
    NODE_NOT_AVAILABLE = "node_not_available"
    #: The cluster (or the chosen node) does not run the service the request needs.
    SERVICE_NOT_AVAILABLE = "service_not_available"
    #: The endpoint's circuit breaker is open: the request is not sent into it.
    CIRCUIT_BREAKER_OPEN = "circuit_breaker_open"
    #: No connected, writable socket; or the socket failed before the write began.
    SOCKET_NOT_AVAILABLE = "socket_not_available"
    #: Written to the socket, then the socket closed before the response arrived.
    IN_FLIGHT = "in_flight"

    @property
    def written(self) -> bool:
        """True when the request may have reached the server."""
        return self is FailureStage.IN_FLIGHT


_REASONS: dict[FailureStage, RetryReason] = {
    FailureStage.NODE_NOT_AVAILABLE: RetryReason.NODE_NOT_AVAILABLE,
    FailureStage.SERVICE_NOT_AVAILABLE: RetryReason.SERVICE_NOT_AVAILABLE,
    FailureStage.CIRCUIT_BREAKER_OPEN: RetryReason.CIRCUIT_BREAKER_OPEN,
    FailureStage.SOCKET_NOT_AVAILABLE: RetryReason.SOCKET_NOT_AVAILABLE,
    FailureStage.IN_FLIGHT: RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT,
}


def dispatch_failure_reason(stage: FailureStage) -> RetryReason:
    """The RetryReason for a connection-level failure at ``stage``.

    Hand it to the orchestrator whatever the request's idempotency: the reason's
    ``allows_non_idempotent_retry`` flag (False only for
    SOCKET_CLOSED_WHILE_IN_FLIGHT) is what keeps a written non-idempotent request
    from being retried. :func:`retry_allowed` applies that rule directly.
    """
    reason = _REASONS.get(stage)
    if reason is None:
        raise TypeError(
            f"dispatch_failure_reason(stage) must be a FailureStage, got {_show(stage)}; "
            f"one of {', '.join(s.name for s in FailureStage)}"
        )
    return reason


def retry_allowed(reason: RetryReason, *, idempotent: bool) -> bool:
    """RFC 0049's safety rule: may a request with this idempotency be retried for ``reason``?

    True when the request is idempotent or the reason allows non-idempotent retry.
    It is the test the best-effort strategy applies; it does not consult any
    strategy, backoff or timeout.
    """
    if not isinstance(reason, RetryReason):
        raise TypeError(f"retry_allowed(reason) must be a RetryReason, got {_show(reason)}")
    if not isinstance(idempotent, bool):
        raise TypeError(f"retry_allowed(idempotent) must be a bool, got {_show(idempotent)}")
    return idempotent or reason.allows_non_idempotent_retry


def raise_failure(
    result: RetryReason | BaseException,
    *,
    cause: BaseException | None = None,
    request: Request | None = None,
    effect: AttemptEffect | None = None,
) -> NoReturn:
    """Raise what a mapper returned, from a ``send`` given to ``RetryOrchestrator.execute``.

    A RetryReason becomes :class:`RetryableError` (the orchestrator decides), with
    ``effect`` when given (else the reason's default, ``AttemptEffect.for_reason``);
    an exception (a ``RetryableError`` from :func:`~sdkcore.mapping.grpc_failure`
    included, with the effect it carries) is raised as is. ``cause`` is chained.
    Given the ``request``, a CouchbaseException without a context gets the
    request's (``execute`` also does this for whatever its ``send`` raises).
    """
    if effect is not None and type(effect) is not AttemptEffect:
        raise TypeError(
            f"raise_failure(effect) must be an AttemptEffect or None, got {_show(effect)}"
        )
    if request is not None and not isinstance(request, Request):
        raise TypeError(
            f"raise_failure(request) must be an sdkcore.Request or None, got {_show(request)}"
        )
    if isinstance(result, RetryReason):
        raise RetryableError(result, cause=cause, effect=effect)
    if isinstance(result, BaseException):
        if effect is not None:
            raise TypeError(
                "raise_failure(effect) applies to a RetryReason; an exception "
                f"({type(result).__name__}) is raised as it is"
            )
        if (
            request is not None
            and isinstance(result, CouchbaseException)
            and result.context is None
        ):
            result.context = request.error_context(request.last_reason)
        if cause is not None:
            raise result from cause
        raise result
    raise TypeError(
        f"raise_failure(result) takes a RetryReason or an exception, got {_show(result)}"
    )
