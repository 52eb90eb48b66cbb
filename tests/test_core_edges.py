"""Edge cases of the core found in review: each pins a behaviour that once was wrong."""

from __future__ import annotations

import copy
import inspect
import pickle
import sys
from datetime import timedelta
from typing import Any

import anyio
import pytest
import structlog

from sdkcore import (
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    CouchbaseException,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    ScopeNotFoundException,
    TimeoutException,
    exponential_backoff,
)
from sdkcore.testing import VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]


# -- execute: whatever leaves it completes the request -----------------------------------


async def test_exception_group_from_the_deadline_scope_completes_the_request() -> None:
    """A child's cleanup error at the deadline comes out as a group; the request ends."""
    orch = RetryOrchestrator()
    req = Request(timeout=0.05)

    async def child() -> None:
        try:
            await anyio.sleep(10)
        finally:
            raise OSError("close failed")

    async def send(_: Request) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
            await anyio.sleep(10)

    with anyio.fail_after(5), pytest.raises((OSError, BaseExceptionGroup, CouchbaseException)):
        await orch.execute(req, send)
    assert req.completed
    assert req.state is not RequestState.PENDING
    with pytest.raises((RuntimeError, RequestCanceledException, TimeoutException)):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert req.retry_attempts == 0


async def test_a_failing_injected_sleep_fails_the_request() -> None:
    async def broken_sleep(_: float) -> None:
        raise OSError("timer broken")

    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=broken_sleep)
    req = Request(idempotent=True)
    with pytest.raises(OSError, match="timer broken"):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert req.state is RequestState.FAILED
    assert req.cancellation_reason is None
    assert orch.requests_in_retry == 0


# -- timeouts and durations at the edges -------------------------------------------------


@pytest.mark.parametrize("timeout", [1e300, timedelta.max, 10**400])
def test_timeouts_a_timedelta_cannot_hold_are_rejected(timeout: Any) -> None:
    with pytest.raises(ValueError, match=r"Request\.timeout"):
        Request(timeout=timeout)


async def test_a_very_long_timeout_still_gives_proper_errors() -> None:
    orch, vc = RetryOrchestrator(sleep=VirtualClock().sleep), VirtualClock()
    req = Request(timeout=8.6e13, clock=vc.clock)
    assert req.timeout is not None
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(req, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    assert info.value.context is not None
    assert info.value.context.timeout == req.timeout


def test_exponential_backoff_follows_its_formula_past_the_table() -> None:
    slow = exponential_backoff(0.001, 0.5, 1.05)
    for attempt in (63, 64, 65, 100):
        expected = min(0.001 * 1.05**attempt, 0.5)
        assert slow(attempt).total_seconds() == pytest.approx(expected, abs=1e-6)
    flat = exponential_backoff(0.001, 0.5, 1.0)
    assert flat(64) == flat(1000) == timedelta(milliseconds=1)
    assert exponential_backoff()(10**6) == timedelta(milliseconds=500)  # no overflow
    with pytest.raises(ValueError, match="attempt"):
        slow(-1)


# -- RetryAction: refusals compare by the exception they choose --------------------------


def test_refusals_compare_by_chosen_exception() -> None:
    auth = RetryAction.no_retry(AuthenticationFailureException)
    assert auth != RetryAction.no_retry()
    assert auth == RetryAction.no_retry(AuthenticationFailureException)
    assert len({auth, RetryAction.no_retry(), RetryAction.no_retry(ScopeNotFoundException)}) == 3
    assert hash(auth) == hash(RetryAction.no_retry(AuthenticationFailureException))


def test_constructor_with_an_exception_class_builds_it_with_the_context() -> None:
    action = RetryAction(None, ScopeNotFoundException)  # type: ignore[arg-type]
    assert action == RetryAction.no_retry(ScopeNotFoundException)
    ctx = Request(name="kv.get").error_context(RetryReason.SCOPE_NOT_FOUND)
    assert action.exception is not None
    exc = action.exception(ctx)
    assert type(exc) is ScopeNotFoundException
    assert exc.context is ctx
    with pytest.raises(TypeError, match="CouchbaseException subclass"):
        RetryAction(None, ValueError)


# -- how a strategy is called: no cache, no inspect --------------------------------------


async def test_an_async_strategy_is_awaited_without_inspect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[object] = []
    real = inspect.iscoroutinefunction

    def counting(obj: object) -> bool:
        calls.append(obj)
        return real(obj)

    monkeypatch.setattr(inspect, "iscoroutinefunction", counting)
    monkeypatch.setattr(inspect, "isawaitable", counting)

    class Async:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(0)

    orch = RetryOrchestrator(Async())
    req = Request(timeout=None, idempotent=True)
    for _ in range(5):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert req.retry_attempts == 5
    assert calls == []


async def test_instance_level_retry_after_is_honoured() -> None:
    class Plain(BestEffortRetryStrategy):  # not slotted: instances have a __dict__
        pass

    strategy = Plain()
    orch = RetryOrchestrator(strategy)
    await orch.maybe_retry(Request(timeout=None), RetryReason.KV_LOCKED)  # the built-in
    strategy.retry_after = lambda request, reason: RetryAction.no_retry(  # type: ignore[method-assign,assignment,return-value]
        AuthenticationFailureException
    )
    with pytest.raises(AuthenticationFailureException):
        await orch.maybe_retry(Request(timeout=None), RetryReason.KV_LOCKED)


async def test_a_class_patched_after_first_use_is_reclassified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Mine(BestEffortRetryStrategy):
        __slots__ = ()

    orch = RetryOrchestrator(Mine())
    await orch.maybe_retry(Request(timeout=None), RetryReason.KV_LOCKED)

    async def refuse(self: Any, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.no_retry(ScopeNotFoundException)

    monkeypatch.setattr(Mine, "retry_after", refuse)
    with pytest.raises(ScopeNotFoundException):
        await orch.maybe_retry(Request(timeout=None), RetryReason.KV_LOCKED)


# -- exceptions survive pickle and copy -------------------------------------------------


async def test_exceptions_pickle_and_copy_with_their_context() -> None:
    orch = RetryOrchestrator()
    req = Request(name="kv.upsert", timeout=1)
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(req, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    exc = info.value
    exc.context = exc.context.evolve(extra={"status": 7}) if exc.context else None
    for clone in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
        assert type(clone) is RequestCanceledException
        assert clone.context == exc.context
        assert str(clone) == str(exc)
    failure = RetryableError(RetryReason.KV_LOCKED, "locked by another client")
    for clone in (pickle.loads(pickle.dumps(failure)), copy.copy(failure)):
        assert clone.reason is RetryReason.KV_LOCKED
        assert str(clone) == str(failure)


# -- capture_retry_events leaves structlog as it found it -------------------------------


def test_capture_leaves_an_unconfigured_structlog_unconfigured() -> None:
    structlog.reset_defaults()
    assert not structlog.is_configured()
    with capture_retry_events():
        assert not structlog.is_configured()  # capture never configures structlog
    assert not structlog.is_configured()


class _SlowLookup(BestEffortRetryStrategy):
    """An async strategy asking a remote service whose driver turns the cancellation that
    cuts it into its own error (as grpc.aio and many drivers do)."""

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        try:
            await anyio.sleep(10)  # the request's deadline (or its cancel) comes meanwhile
        except anyio.get_cancelled_exc_class():
            raise ConnectionError("lookup aborted") from None
        return self.decide(request, reason)


@pytest.mark.parametrize("ended_by", ["deadline", "cancel"])
@pytest.mark.parametrize("door", ["execute", "maybe_retry"])
async def test_a_cut_async_strategy_is_not_reported_as_the_strategy_failing(
    door: str, ended_by: str
) -> None:
    """The deadline or ``Request.cancel()`` cut the strategy: a timeout (a cancellation),
    not ``retry.strategy_failed`` and a FAILED request. ``execute`` with a deadline warned
    that the strategy failed (without one, and ``maybe_retry``, did not)."""
    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=0.05, retry_strategy=_SlowLookup())

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED)

    async def run() -> None:
        if door == "execute":
            await orch.execute(request, send)
        else:
            with orch.attempt(request):
                pass
            await orch.maybe_retry(request, RetryReason.KV_LOCKED)

    expected = TimeoutException if ended_by == "deadline" else RequestCanceledException
    with capture_retry_events() as events:
        async with anyio.create_task_group() as tg:
            if ended_by == "cancel":
                tg.start_soon(_cancel_later, request)
            with pytest.raises(expected):
                await run()
    assert "retry.strategy_failed" not in [e["event"] for e in events]
    assert request.state is RequestState.CANCELLED


async def _cancel_later(request: Request) -> None:
    await anyio.sleep(0.01)
    request.cancel()
