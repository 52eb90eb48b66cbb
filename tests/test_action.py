"""RetryAction: immutable decision of a strategy."""

from __future__ import annotations

from datetime import timedelta

import attrs
import pytest

from sdkcore import (
    CouchbaseException,
    ErrorContext,
    RetryAction,
    RetryReason,
    ScopeNotFoundException,
)


def _context() -> ErrorContext:
    return ErrorContext(
        request_id=7,
        request_name="get",
        idempotent=True,
        retry_attempts=2,
        retry_reasons=(RetryReason.KV_LOCKED,),
        timeout=timedelta(seconds=1),
        elapsed=timedelta(milliseconds=10),
    )


def test_with_duration_timedelta() -> None:
    action = RetryAction.with_duration(timedelta(milliseconds=5))
    assert action.duration == timedelta(milliseconds=5)
    assert action.retries is True
    assert action.exception is None


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.25, timedelta(milliseconds=250)), (0, timedelta(0)), (2, timedelta(seconds=2))],
)
def test_with_duration_seconds_becomes_timedelta(seconds: float, expected: timedelta) -> None:
    action = RetryAction.with_duration(seconds)
    assert isinstance(action.duration, timedelta)
    assert action.duration == expected


@pytest.mark.parametrize(
    ("value", "exc"),
    [
        (-0.1, ValueError),
        (timedelta(seconds=-1), ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_with_duration_rejects_bad_values(value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc, match=r"RetryAction\.with_duration"):
        RetryAction.with_duration(value)  # type: ignore[arg-type]


def test_no_retry() -> None:
    action = RetryAction.no_retry()
    assert action.duration is None
    assert action.retries is False
    assert action.exception is None


def test_no_retry_with_exception_class_builds_it_with_the_context() -> None:
    action = RetryAction.no_retry(ScopeNotFoundException)
    assert action.duration is None
    assert action.exception is not None
    ctx = _context()
    exc = action.exception(ctx)
    assert type(exc) is ScopeNotFoundException
    assert isinstance(exc, CouchbaseException)
    assert exc.context is ctx


def test_no_retry_with_callable() -> None:
    seen: list[ErrorContext] = []

    def factory(ctx: ErrorContext) -> BaseException:
        seen.append(ctx)
        return LookupError(f"gone after {ctx.retry_attempts}")

    action = RetryAction.no_retry(factory)
    assert action.exception is factory
    exc = action.exception(_context())
    assert isinstance(exc, LookupError)
    assert str(exc) == "gone after 2"
    assert len(seen) == 1


@pytest.mark.parametrize("bad", [ValueError, 42, "CouchbaseException"])
def test_no_retry_rejects_non_couchbase_class_or_non_callable(bad: object) -> None:
    with pytest.raises(TypeError, match=r"no_retry\(exception=\.\.\.\).*CouchbaseException"):
        RetryAction.no_retry(bad)  # type: ignore[arg-type]


def test_actions_are_immutable() -> None:
    action = RetryAction.with_duration(1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        action.duration = timedelta(0)  # type: ignore[misc]
    refusal = RetryAction.no_retry()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        refusal.duration = timedelta(1)  # type: ignore[misc]


def test_equality_and_repr() -> None:
    assert RetryAction.with_duration(0.5) == RetryAction.with_duration(timedelta(milliseconds=500))
    assert RetryAction.with_duration(0.5) != RetryAction.with_duration(0.6)
    assert RetryAction.no_retry() != RetryAction.with_duration(0)
    assert "with_duration" in repr(RetryAction.with_duration(1))
    assert "no_retry" in repr(RetryAction.no_retry())
    assert "ScopeNotFoundException" in repr(RetryAction.no_retry(ScopeNotFoundException))
