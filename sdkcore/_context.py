"""ErrorContext (what every sdkcore exception carries) and CancellationReason."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import attrs

from ._reason import RetryReason

__all__ = ["CancellationReason", "ErrorContext"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class CancellationReason(enum.Enum):
    """Why a request ended without a result from the server."""

    #: The retry strategy declined to retry (RFC 0049 ``failRequest``).
    NO_MORE_RETRIES = "NO_MORE_RETRIES"
    #: The orchestrator's limit of requests waiting in retry was reached.
    TOO_MANY_REQUESTS_IN_RETRY = "TOO_MANY_REQUESTS_IN_RETRY"
    #: The request's timeout elapsed.
    TIMEOUT = "TIMEOUT"
    #: The application cancelled the request (``Request.cancel()``).
    CANCELLED_VIA_CONTEXT = "CANCELLED_VIA_CONTEXT"
    #: The surrounding task was cancelled (anyio/asyncio/trio cancellation).
    TASK_CANCELLED = "TASK_CANCELLED"


def _ms(d: timedelta | None) -> float | None:
    return None if d is None else round(d.total_seconds() * 1000.0, 3)


@attrs.frozen(slots=True)
class ErrorContext:
    """A snapshot of a request's state when it failed.

    ``str(context)`` renders one line of JSON, made to be pasted into a bug report.
    """

    request_id: int
    request_name: str
    idempotent: bool
    retry_attempts: int
    retry_reasons: tuple[RetryReason, ...]
    timeout: timedelta | None
    elapsed: timedelta
    #: The reason the failing call to ``maybe_retry`` was given, if any.
    reason: RetryReason | None = None
    cancellation_reason: CancellationReason | None = None
    #: The strategy that decided, by class name (``"controlled_backoff"`` for always-retry).
    strategy: str | None = None
    #: Free-form details added by mappers and adapters (status codes, server messages, ...).
    extra: Mapping[str, Any] = _EMPTY

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict of every field that is set."""
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "request_name": self.request_name,
            "idempotent": self.idempotent,
            "retry_attempts": self.retry_attempts,
            "retry_reasons": [r.name for r in self.retry_reasons],
            "timeout_ms": _ms(self.timeout),
            "elapsed_ms": _ms(self.elapsed),
        }
        if self.reason is not None:
            out["reason"] = self.reason.name
        if self.cancellation_reason is not None:
            out["cancellation_reason"] = self.cancellation_reason.name
        if self.strategy is not None:
            out["strategy"] = self.strategy
        if self.extra:
            out["extra"] = dict(self.extra)
        return out

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), default=str, sort_keys=False)

    def __reduce__(self) -> tuple[object, ...]:
        # ``extra`` is a read-only mappingproxy, which pickle cannot copy: rebuild it.
        fields = attrs.asdict(self, recurse=False)
        fields["extra"] = dict(self.extra)
        return (_rebuild_context, (fields,))

    def evolve(self, **changes: Any) -> ErrorContext:
        """A copy with some fields replaced (e.g. ``extra``)."""
        return attrs.evolve(self, **changes)


def _rebuild_context(fields: dict[str, Any]) -> ErrorContext:
    extra = fields.pop("extra")
    return ErrorContext(**fields, extra=MappingProxyType(extra) if extra else _EMPTY)
