"""Exception hierarchy, ErrorContext and what str(exc) shows."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    CancellationReason,
    CircuitBreaker,
    CollectionNotFoundException,
    CouchbaseException,
    ErrorContext,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    ScopeNotFoundException,
    TimeoutException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import VirtualClock

ALL = [
    CouchbaseException,
    TimeoutException,
    AmbiguousTimeoutException,
    UnambiguousTimeoutException,
    RequestCanceledException,
    AuthenticationFailureException,
    ScopeNotFoundException,
    CollectionNotFoundException,
]


def test_hierarchy() -> None:
    assert issubclass(CouchbaseException, Exception)
    assert issubclass(TimeoutException, CouchbaseException)
    assert issubclass(AmbiguousTimeoutException, TimeoutException)
    assert issubclass(UnambiguousTimeoutException, TimeoutException)
    assert not issubclass(AmbiguousTimeoutException, UnambiguousTimeoutException)
    assert not issubclass(UnambiguousTimeoutException, AmbiguousTimeoutException)
    for cls in (
        RequestCanceledException,
        AuthenticationFailureException,
        ScopeNotFoundException,
        CollectionNotFoundException,
    ):
        assert issubclass(cls, CouchbaseException)
        assert not issubclass(cls, TimeoutException)
    # A retryable failure report is not an application-facing error.
    assert not issubclass(RetryableError, CouchbaseException)


def _context(**overrides: Any) -> ErrorContext:
    fields: dict[str, Any] = {
        "request_id": 4242,
        "request_name": "kv.upsert",
        "idempotent": False,
        "retry_attempts": 3,
        "retry_reasons": (RetryReason.KV_LOCKED, RetryReason.SOCKET_NOT_AVAILABLE),
        "timeout": timedelta(milliseconds=2500),
        "elapsed": timedelta(milliseconds=1234.5),
    }
    fields.update(overrides)
    return ErrorContext(**fields)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_str_shows_the_whole_context(cls: type[CouchbaseException]) -> None:
    exc = cls(context=_context(cancellation_reason=CancellationReason.NO_MORE_RETRIES))
    text = str(exc)
    assert text.startswith(exc.message)
    for fragment in (
        '"retry_attempts": 3',
        '"retry_reasons": ["KV_LOCKED", "SOCKET_NOT_AVAILABLE"]',
        '"idempotent": false',
        '"request_id": 4242',
        '"request_name": "kv.upsert"',
        '"timeout_ms": 2500.0',
        '"elapsed_ms": 1234.5',
        '"cancellation_reason": "NO_MORE_RETRIES"',
    ):
        assert fragment in text, (fragment, text)
    assert exc.context is not None
    assert exc.context.retry_attempts == 3


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_default_and_custom_messages(cls: type[CouchbaseException]) -> None:
    assert str(cls()) == cls.default_message
    assert cls().context is None
    assert str(cls("boom")) == "boom"
    exc = cls("boom", context=_context())
    assert str(exc).startswith("boom {")
    assert "context=" in repr(exc)


def test_context_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        CouchbaseException("m", _context())  # type: ignore[call-arg]


def test_context_json_is_one_line_and_parses() -> None:
    ctx = _context(
        reason=RetryReason.KV_LOCKED,
        strategy="BestEffortRetryStrategy",
        extra={"status": 0x09},
    )
    text = str(ctx)
    assert "\n" not in text
    data = json.loads(text)
    assert data == {
        "request_id": 4242,
        "request_name": "kv.upsert",
        "idempotent": False,
        "retry_attempts": 3,
        "retry_reasons": ["KV_LOCKED", "SOCKET_NOT_AVAILABLE"],
        "timeout_ms": 2500.0,
        "elapsed_ms": 1234.5,
        "reason": "KV_LOCKED",
        "strategy": "BestEffortRetryStrategy",
        "extra": {"status": 9},
    }


def test_a_context_of_many_attempts_shows_the_first_and_the_last_ones() -> None:
    """A one-step failing script under instant_retries() made 157,000 attempts before its
    timeout, and str(exc) was 23 MB. The message shows the first and the last ten, and
    how many are left out; the context itself keeps them all."""
    from sdkcore import AttemptEffect, AttemptRecord

    records = tuple(
        AttemptRecord(
            number=n,
            reason=RetryReason.KV_LOCKED,
            effect=AttemptEffect.NOT_APPLIED,
            error=f"Locked: #{n}",
            duration=timedelta(milliseconds=1),
            delay=None,
        )
        for n in range(1, 1001)
    )
    ctx = _context(attempts=records)
    data = json.loads(str(ctx))
    shown = [a["attempt"] for a in data["attempts"]]
    assert shown == [*range(1, 11), *range(991, 1001)]
    assert data["attempts_omitted"] == 980
    assert len(str(ctx)) < 5_000
    assert len(ctx.attempts) == len(ctx.to_dict()["attempts"]) == 1000
    few = _context(attempts=records[:20])
    assert "attempts_omitted" not in json.loads(str(few))


def test_context_without_timeout_renders_null() -> None:
    assert json.loads(str(_context(timeout=None)))["timeout_ms"] is None


def test_context_evolve() -> None:
    ctx = _context()
    other = ctx.evolve(extra={"a": 1})
    assert other.extra == {"a": 1}
    assert ctx.extra == {}
    assert other.request_id == ctx.request_id


def test_retryable_error() -> None:
    cause = OSError("reset")
    err = RetryableError(RetryReason.KV_LOCKED, cause=cause)
    assert err.reason is RetryReason.KV_LOCKED
    assert err.__cause__ is cause
    assert "KV_LOCKED" in str(err)
    with pytest.raises(TypeError, match="RetryReason"):
        RetryableError("KV_LOCKED")  # type: ignore[arg-type]


@pytest.mark.parametrize("by_keyword", [False, True])
def test_retryable_error_text_args_and_pickle(by_keyword: bool) -> None:
    """Its ``args`` are what it was given; its text, repr and pickled copy keep the message."""
    import pickle

    reason = RetryReason.KV_LOCKED
    if by_keyword:
        err = RetryableError(reason, message="locked by another client", retry_after=0.5)
        assert err.args == (reason,)
    else:
        err = RetryableError(reason, "locked by another client", retry_after=0.5)
        assert err.args == (reason, "locked by another client")
    assert str(err) == "KV_LOCKED: locked by another client"
    assert repr(err) == (
        "RetryableError(RetryReason.KV_LOCKED, 'locked by another client', retry_after=0.5)"
    )
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), repr(copy), copy.retry_after) == (str(err), repr(err), 0.5)
    bare = RetryableError(reason)
    assert (bare.args, str(bare), repr(bare)) == (
        (reason,),
        "KV_LOCKED",
        "RetryableError(RetryReason.KV_LOCKED)",
    )


@pytest.mark.anyio
async def test_exception_from_orchestrator_has_real_context() -> None:
    """The fields shown come from the request that failed."""
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=vc.sleep)
    req = Request(name="kv.append", timeout=2.0, clock=vc.clock)
    await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    await orch.maybe_retry(req, RetryReason.SOCKET_NOT_AVAILABLE)
    vc.advance(0.5)
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(req, RetryReason.UNKNOWN)
    ctx = info.value.context
    assert ctx is not None
    assert ctx.request_id == req.id
    assert ctx.request_name == "kv.append"
    assert ctx.idempotent is False
    assert ctx.retry_attempts == 2
    assert ctx.retry_reasons == (RetryReason.KV_LOCKED, RetryReason.SOCKET_NOT_AVAILABLE)
    assert ctx.timeout == timedelta(seconds=2)
    assert abs(ctx.elapsed - timedelta(seconds=0.503)) < timedelta(microseconds=10)
    assert ctx.reason is RetryReason.UNKNOWN
    assert ctx.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    assert ctx.strategy == "BestEffortRetryStrategy"
    text = str(info.value)
    for fragment in (
        f'"request_id": {req.id}',
        '"request_name": "kv.append"',
        '"retry_attempts": 2',
        '"KV_LOCKED", "SOCKET_NOT_AVAILABLE"',
        '"idempotent": false',
        '"timeout_ms": 2000.0',
        '"elapsed_ms": 503.0',
    ):
        assert fragment in text, (fragment, text)


# -- issue 21: messages and units ------------------------------------------------------------


def test_a_reason_given_as_its_name_suggests_the_member() -> None:
    with pytest.raises(TypeError, match=r"use RetryReason\.SERVICE_NOT_AVAILABLE, not the string"):
        RetryableError("SERVICE_NOT_AVAILABLE")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"use AttemptEffect\.MAYBE_APPLIED"):
        RetryableError(RetryReason.UNKNOWN, effect="maybe_applied")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass a member such as RetryReason\.KV_LOCKED"):
        RetryableError(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass a member such as AttemptEffect\.MAYBE_APPLIED"):
        RetryableError(RetryReason.UNKNOWN, effect=3)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_status_or_an_exception_given_as_a_reason_says_how_to_map_it() -> None:
    from sdkcore.mapping import KvStatus

    orchestrator = RetryOrchestrator()
    with pytest.raises(TypeError, match=r"KvStatus\.LOCKED is a status, not a retry reason"):
        await orchestrator.maybe_retry(Request(), KvStatus.LOCKED)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"an exception is not a reason"):
        await orchestrator.maybe_retry(Request(), KeyError("k"))  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_maybe_retry_suggests_the_member_too() -> None:
    with pytest.raises(TypeError, match=r"use RetryReason\.KV_LOCKED"):
        await RetryOrchestrator().maybe_retry(Request(), "kv_locked")  # type: ignore[arg-type]


def test_timeout_exception_is_a_builtin_timeout_error() -> None:
    for cls in (TimeoutException, AmbiguousTimeoutException, UnambiguousTimeoutException):
        error = cls("late")
        assert isinstance(error, TimeoutError)
        assert isinstance(error, CouchbaseException)
        assert str(error) == "late"
    with pytest.raises(TimeoutError):
        raise UnambiguousTimeoutException()


@pytest.mark.anyio
async def test_a_breaker_s_retry_after_timeout_names_the_breaker() -> None:
    breaker = CircuitBreaker(volume_threshold=1, sleep_window=5, name="10.0.0.1:11210")
    breaker.record_failure(TimeoutError())

    async def send(request: Request) -> None:
        with breaker.guard():
            pass

    with pytest.raises(UnambiguousTimeoutException) as info:
        await RetryOrchestrator().execute(Request(timeout=0.5), send)
    message = info.value.message
    assert "circuit breaker 10.0.0.1:11210 is OPEN" in message
    assert "from the server" not in message
