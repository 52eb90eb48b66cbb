"""gRPC status codes by number and name, without importing grpc."""

from __future__ import annotations

from typing import Any

from .._context import AttemptEffect, CancellationReason
from .._request import RequestState

__all__ = ["STATUS_BY_NAME", "STATUS_NAMES", "status_name", "time_out_at_deadline"]

#: Canonical status names, indexed by code.
STATUS_NAMES: tuple[str, ...] = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)

STATUS_BY_NAME: dict[str, int] = {name: code for code, name in enumerate(STATUS_NAMES)}


def status_name(code: int) -> str:
    """``"UNAVAILABLE"`` for 14; ``"CODE_99"`` for a number outside the table."""
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else f"CODE_{code}"


_DEADLINE_EXCEEDED = STATUS_BY_NAME["DEADLINE_EXCEEDED"]


def time_out_at_deadline(request: Any, error: BaseException, *, book: bool = True) -> None:
    """End a call's ``request`` as timed out when ``error`` is the call's own deadline.

    DEADLINE_EXCEEDED once the request's time is up is its timeout, not a failure: the
    request ends CANCELLED with TIMEOUT (telemetry's outcome ``timeout``, as a deadline
    reached in the backoff). ``book``: record ``error`` as the last attempt's failure
    first. Anything else (a server's own DEADLINE_EXCEEDED with time left included)
    leaves the request for the caller to fail.
    """
    if request.state is not RequestState.PENDING:
        return
    code = getattr(error, "code", None)
    if not callable(code):
        return
    try:
        value = code().value[0]
    except Exception:  # not a grpc status
        return
    if value == _DEADLINE_EXCEEDED and request.deadline - request.clock() <= 0.0:
        if book:
            request._attempt_failed(None, AttemptEffect.MAYBE_APPLIED, error, request.clock())
        request._finish(RequestState.CANCELLED, CancellationReason.TIMEOUT)
