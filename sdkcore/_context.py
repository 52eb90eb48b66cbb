"""ErrorContext (what every sdkcore exception carries) and CancellationReason."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import attrs

from ._reason import RetryReason

__all__ = [
    "DEFAULT_EFFECT",
    "AttemptEffect",
    "AttemptRecord",
    "CancellationReason",
    "ErrorContext",
    "describe_error",
]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class CancellationReason(enum.Enum):
    """Why a request ended without a result from the server."""

    #: Not retried (RFC 0049 ``failRequest``): the strategy declined, a request that is
    #: not idempotent could be applied twice, or every hedge of a hedged request failed.
    NO_MORE_RETRIES = "NO_MORE_RETRIES"
    #: The orchestrator's limit of requests waiting in retry was reached.
    TOO_MANY_REQUESTS_IN_RETRY = "TOO_MANY_REQUESTS_IN_RETRY"
    #: The request's timeout elapsed.
    TIMEOUT = "TIMEOUT"
    #: The application cancelled the request (``Request.cancel()``).
    CANCELLED_VIA_CONTEXT = "CANCELLED_VIA_CONTEXT"
    #: The surrounding task was cancelled (anyio/asyncio/trio cancellation).
    TASK_CANCELLED = "TASK_CANCELLED"
    #: The orchestrator's retry budget refused the retry (``RetryOrchestrator(retry_budget=...)``).
    RETRY_BUDGET_EXHAUSTED = "RETRY_BUDGET_EXHAUSTED"


class AttemptEffect(enum.Enum):
    """What is known about the server side of one failed attempt (see rfc/0001, "Ambiguity").

    A timeout of a non-idempotent request is unambiguous only if no attempt is
    ``MAYBE_APPLIED``.
    """

    #: The attempt never left the client (no connection, circuit open, rejected locally).
    NOT_SENT = "not_sent"
    #: The server answered with a status that by its protocol proves nothing was applied
    #: (e.g. KV LOCKED, TEMPORARY_FAILURE, NOT_MY_VBUCKET).
    NOT_APPLIED = "not_applied"
    #: The attempt reached, or may have reached, the server and may have been applied
    #: (socket closed in flight, gRPC UNAVAILABLE from the server, cut at the deadline, ...).
    MAYBE_APPLIED = "maybe_applied"

    @classmethod
    def for_reason(cls, reason: RetryReason) -> AttemptEffect:
        """The default for a failure with ``reason``, from its RFC 0049 flags.

        ``after_dispatch`` false: never sent. Sent, but the reason allows retrying a
        non-idempotent request: the RFC allows that only because the server provably
        did not apply it. Otherwise (UNKNOWN, SOCKET_CLOSED_WHILE_IN_FLIGHT): maybe applied.
        """
        return DEFAULT_EFFECT[reason]


#: :meth:`AttemptEffect.for_reason` for every reason, as a table (the doors read it once
#: per failed attempt: a dict lookup, not a method call).
DEFAULT_EFFECT: dict[RetryReason, AttemptEffect] = {
    r: (
        AttemptEffect.NOT_SENT
        if not r.after_dispatch
        else AttemptEffect.NOT_APPLIED
        if r.allows_non_idempotent_retry
        else AttemptEffect.MAYBE_APPLIED
    )
    for r in RetryReason
}


def describe_error(error: BaseException | None) -> str | None:
    """``"Type: message"`` for logs and error contexts (None for None).

    gRPC errors (objects with ``code()`` and ``details()``, e.g. ``grpc.aio.AioRpcError``)
    render as ``"AioRpcError: UNAVAILABLE: <details>"``. An error raised ``from``
    another (a driver error under an SDK error) names that one too:
    ``"DocumentNotFoundException: ... (from ConnectionResetError: ...)"``. Never
    raises, whatever the error's ``__str__`` does; a message is cut at 500
    characters, the whole text at 600.
    """
    if error is None:
        return None
    if not isinstance(error, BaseException):
        raise TypeError(f"describe_error(error) must be an exception or None, got {error!r}")
    text = _describe_one(error)
    cause = error.__cause__
    if cause is not None and cause is not error:
        inner = _describe_one(cause)
        context = getattr(cause, "context", None)
        if isinstance(context, ErrorContext) and context.attempts:
            # e.g. a gRPC channel's own A6 retries inside one attempt of an outer request;
            # not when the message says the count already ("all 4 attempts (maxAttempts) used")
            count = len(context.attempts)
            if f" {count} attempt" not in inner:
                inner = f"{inner} after {count} attempts"
        text = f"{text} (from {inner})"
        if len(text) > _LIMIT:
            text = text[: _LIMIT - 4] + "...)"
    return text


_LIMIT = 600  # one error with its cause: every text sdkcore builds from errors is bounded


def _clip(text: str) -> str:
    return text if len(text) <= 500 else text[:497] + "..."


def _describe_one(error: BaseException) -> str:
    name = type(error).__name__
    try:
        code = getattr(error, "code", None)
        details = getattr(error, "details", None)
        if callable(code) and callable(details):
            try:
                status = code()
                text = details()
            except Exception:  # a half-built error object: fall back to str()
                pass
            else:
                status_name = getattr(status, "name", status)
                return _clip(f"{name}: {status_name}: {text}" if text else f"{name}: {status_name}")
        message = getattr(error, "message", None)  # CouchbaseException: without its context
        if not isinstance(message, str):
            message = str(error)
    except Exception:  # a broken __str__ (or property) must not hide the failure it describes
        return name
    return f"{name}: {_clip(message)}" if message else name


_CLIENT_ENTRIES = 20  # client_context entries shown in a context or an event, at most
_CLIENT_TEXT = 100  # characters of a key or a value, at most


def client_context_text(context: Mapping[str, Any]) -> Mapping[str, str]:
    """A request's ``client_context`` as bounded text, for error contexts and log events.

    What the application attached to its request (a document key, a bucket, an
    endpoint) is what an operator correlates a failure with, as the Java SDK's
    exported ``clientContext``. At most 20 entries; keys and values (``str()``, which
    may not raise here) cut at 100 characters; sdkcore's own keys (``sdkcore.*``,
    e.g. a gRPC call's state) are left out. Empty: the shared empty mapping.
    """
    if not context:
        return _EMPTY
    out: dict[str, str] = {}
    for key, value in context.items():
        name = key if isinstance(key, str) else _text(key)
        if name.startswith("sdkcore."):
            continue
        if len(out) == _CLIENT_ENTRIES:
            out["..."] = f"{len(context) - _CLIENT_ENTRIES} more"
            break
        out[name[:_CLIENT_TEXT]] = _text(value)
    return MappingProxyType(out) if out else _EMPTY


def _text(value: object) -> str:
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # a broken __str__ never hides the failure being reported
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _CLIENT_TEXT else text[: _CLIENT_TEXT - 3] + "..."


def _ms(d: timedelta | None) -> float | None:
    return None if d is None else round(d.total_seconds() * 1000.0, 3)


@attrs.frozen(slots=True)
class AttemptRecord:
    """One failed (or cut) attempt of a request, as its error context reports it.

    ``number`` is 1-based (the first send is attempt 1). ``reason`` is the retry
    reason it failed with (None: it failed otherwise, or was cut in flight);
    ``effect`` what is known of it on the server (:class:`AttemptEffect`: not sent, not
    applied, or maybe applied); ``error`` the failure as ``"Type: message"``;
    ``duration`` how long the attempt
    was in flight (None when not measured: a hand-wired ``maybe_retry`` loop without
    ``attempt()``);
    ``delay`` the backoff scheduled after it (None: not retried).
    """

    number: int
    reason: RetryReason | None = attrs.field(
        validator=attrs.validators.optional(attrs.validators.instance_of(RetryReason))
    )
    effect: AttemptEffect = attrs.field(validator=attrs.validators.instance_of(AttemptEffect))
    error: str | None = None
    duration: timedelta | None = None
    delay: timedelta | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attempt": self.number}
        if self.reason is not None:
            out["reason"] = self.reason.name
        out["effect"] = self.effect.value
        if self.error is not None:
            out["error"] = self.error
        if self.duration is not None:
            out["duration_ms"] = _ms(self.duration)
        if self.delay is not None:
            out["delay_ms"] = _ms(self.delay)
        return out


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
    #: The retry reason of the failure the door was deciding on when the request ended
    #: (None: no attempt failed with one, e.g. an attempt cut in flight).
    reason: RetryReason | None = None
    cancellation_reason: CancellationReason | None = None
    #: The strategy that decided, by class name (``"controlled_backoff"`` for always-retry,
    #: ``"hedge"`` for a hedged request's timeout).
    strategy: str | None = None
    #: Free-form details added by mappers and adapters (status codes, server messages, ...).
    extra: Mapping[str, Any] = _EMPTY
    #: The last attempt's failure as ``"Type: message"`` (None if no attempt failed).
    last_error: str | None = None
    #: True when the request ended while an attempt was in flight (it was cut).
    in_flight: bool = False
    #: Every attempt so far, oldest first.
    attempts: tuple[AttemptRecord, ...] = ()
    #: The request's ``client_context`` as bounded text (:func:`client_context_text`).
    client_context: Mapping[str, str] = _EMPTY

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
        if self.last_error is not None:
            out["last_error"] = self.last_error
        if self.in_flight:
            out["in_flight"] = True
        if self.attempts:
            out["attempts"] = [a.to_dict() for a in self.attempts]
        if self.extra:
            out["extra"] = dict(self.extra)
        if self.client_context:
            out["client_context"] = dict(self.client_context)
        return out

    def __str__(self) -> str:
        # json is imported here, not with sdkcore: only rendering a context for a person
        # (``str(exc)``, a bug report) needs it, never a request on its way (errors are
        # described without their context while a request runs, see describe_error).
        import json

        attempts = self.attempts
        if len(attempts) <= 2 * SHOWN_ATTEMPTS:
            return json.dumps(self.to_dict(), default=str, sort_keys=False)
        # A message a person reads: the first and the last attempts, and how many are
        # left out (instant retries until a timeout made 157,000 of them, 23 MB).
        # ``attempts`` and to_dict() keep every one.
        shown = attempts[:SHOWN_ATTEMPTS] + attempts[-SHOWN_ATTEMPTS:]
        out = attrs.evolve(self, attempts=shown).to_dict()
        out["attempts_omitted"] = len(attempts) - 2 * SHOWN_ATTEMPTS
        return json.dumps(out, default=str, sort_keys=False)

    def __reduce__(self) -> tuple[object, ...]:
        # ``extra`` is a read-only mappingproxy, which pickle cannot copy: rebuild it.
        fields = attrs.asdict(self, recurse=False)
        fields["extra"] = dict(self.extra)
        fields["client_context"] = dict(self.client_context)
        return (_rebuild_context, (fields,))

    def evolve(self, **changes: Any) -> ErrorContext:
        """A copy with some fields replaced (e.g. ``extra``)."""
        return attrs.evolve(self, **changes)


#: ``str(ErrorContext)`` shows this many of the first attempts and of the last ones.
SHOWN_ATTEMPTS = 10


def _rebuild_context(fields: dict[str, Any]) -> ErrorContext:
    extra = fields.pop("extra")
    client = fields.pop("client_context", None)
    return ErrorContext(
        **fields,
        extra=MappingProxyType(extra) if extra else _EMPTY,
        client_context=MappingProxyType(client) if client else _EMPTY,
    )
