"""gRPC status codes by number and name, without importing grpc."""

from __future__ import annotations

__all__ = ["STATUS_BY_NAME", "STATUS_NAMES", "status_name"]

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
