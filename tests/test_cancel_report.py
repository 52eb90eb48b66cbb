"""What ``Request.cancel()`` tells the caller and the operator (rfc/0001, "Application cancel"):
the exception says whether the request may have been applied, the attempt it cut (or whose
answer it dropped) is booked as maybe applied, and ``retry.cancelled`` is logged (info for a
request that is not idempotent and may have been applied, else debug)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    CancellationReason,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio

SAFETY = 10.0


async def execute_then_cancel(
    request: Request, send: Any, after: float, ready: anyio.Event | None = None
) -> tuple[RequestCanceledException, list[Any]]:
    """``execute(request, send)`` in a task, ``request.cancel()`` after ``after`` seconds
    (counted from ``ready``, when given): the exception the caller got, and the events."""
    caught: list[RequestCanceledException] = []

    async def run() -> None:
        try:
            await RetryOrchestrator().execute(request, send)
        except RequestCanceledException as exc:
            caught.append(exc)

    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            if ready is not None:
                await ready.wait()
            await anyio.sleep(after)
            request.cancel()
    assert len(caught) == 1
    return caught[0], events


async def cancelled_in_flight(idempotent: bool) -> tuple[RequestCanceledException, Request, Any]:
    request = Request(name="kv.replace", idempotent=idempotent, timeout=5.0)

    async def send(_: Request) -> None:
        await anyio.sleep_forever()

    error, events = await execute_then_cancel(request, send, 0.02)
    return error, request, events


async def test_a_write_cancelled_in_flight_says_it_may_have_been_applied() -> None:
    error, request, events = await cancelled_in_flight(idempotent=False)
    assert "with attempt 1 in flight" in str(error)
    assert "it may have been applied on the server (ambiguous)" in str(error)
    assert request.maybe_applied
    assert error.context is not None
    assert error.context.in_flight
    assert error.context.attempts[0].effect is AttemptEffect.MAYBE_APPLIED
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["log_level"] == "info"
    assert event["in_flight"] is True
    assert event["ambiguous"] is True
    assert event["maybe_applied"] is True
    assert event["cancellation_reason"] == "CANCELLED_VIA_CONTEXT"
    assert event["request_name"] == "kv.replace"


async def test_an_idempotent_request_cancelled_in_flight_logs_at_debug() -> None:
    error, _, events = await cancelled_in_flight(idempotent=True)
    assert "safe to retry (unambiguous)" in str(error)
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["log_level"] == "debug"
    assert event["ambiguous"] is False


async def test_cancelled_in_backoff_nothing_in_flight() -> None:
    request = Request(name="kv.get", idempotent=False, timeout=5.0)

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)  # the server applied nothing

    error, events = await execute_then_cancel(request, send, 0.05)
    assert "in flight" not in str(error)
    assert "it was not applied on the server (unambiguous)" in str(error)
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    # the default strategy decided its retries: named as on its retry.scheduled lines
    # (it was null for every request on the orchestrator's default strategy)
    scheduled = [e["strategy"] for e in events if e["event"] == "retry.scheduled"]
    assert event["strategy"] == scheduled[0] == "FastFailOnTerminalErrorRetryStrategy"
    assert event["in_flight"] is False
    assert event["log_level"] == "debug"


async def test_an_answer_after_the_cancel_is_dropped_and_said_so() -> None:
    request = Request(name="kv.replace", idempotent=False, timeout=None)

    async def send(req: Request) -> str:
        req.cancel()  # the application cancels as the answer comes in
        return "ok"

    with pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().execute(request, send)
    assert "as attempt 1 answered; its answer was dropped" in str(info.value)
    assert "may have been applied on the server (ambiguous)" in str(info.value)
    assert request.maybe_applied


def test_execute_sync_says_the_same() -> None:
    request = Request(name="kv.replace", idempotent=False, timeout=5.0)

    def send(req: Request) -> str:
        req.cancel()
        return "ok"

    with pytest.raises(RequestCanceledException) as info:
        RetryOrchestrator().execute_sync(request, send)
    assert "as attempt 1 answered; its answer was dropped" in str(info.value)
    assert request.maybe_applied


async def test_a_request_cancelled_before_it_was_sent() -> None:
    request = Request(name="kv.get", idempotent=False)
    request.cancel()

    async def send(_: Request) -> str:
        raise AssertionError("never sent")

    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().execute(request, send)
    assert "it was not applied on the server (unambiguous)" in str(info.value)
    assert not request.maybe_applied
    assert [e["event"] for e in events] == ["retry.cancelled"]


@pytest.mark.parametrize("deadline", [None, 5.0])
async def test_cancel_cuts_an_async_strategy_execute_is_waiting_for(deadline: float | None) -> None:
    """Without a deadline execute armed no scope, so Request.cancel() waited for a slow
    async strategy to answer before it was seen; maybe_retry's did not."""
    answered: list[bool] = []

    class Slow(BestEffortRetryStrategy):
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            await anyio.sleep(SAFETY)  # asks a slow service
            answered.append(True)
            return RetryAction.with_duration(0.001)

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    request = Request(name="kv.get", idempotent=True, timeout=deadline, retry_strategy=Slow())
    started = anyio.current_time()
    error, _ = await execute_then_cancel(request, send, 0.05)
    assert anyio.current_time() - started < SAFETY / 2  # not after the strategy answered
    assert answered == []
    assert "cancelled" in str(error)
    assert request.retry_attempts == 0  # no retry was booked


async def caller_cancels(
    request: Request, send: Any, after: float, ready: anyio.Event | None = None
) -> list[Any]:
    """``execute(request, send)`` inside a cancel scope the caller cancels after ``after``
    seconds (counted from ``ready``, when given; its own cancellation, not
    ``Request.cancel()``): the events."""
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        if ready is None:
            with anyio.move_on_after(after) as scope:
                await RetryOrchestrator().execute(request, send)
        else:
            scope = anyio.CancelScope()

            async def cancel_later() -> None:
                await ready.wait()
                await anyio.sleep(after)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_later)
                with scope:
                    await RetryOrchestrator().execute(request, send)
        assert scope.cancelled_caught
    return events


@pytest.mark.parametrize("deadline", [None, 5.0])
async def test_the_callers_own_cancellation_of_a_write_in_flight_is_reported(
    deadline: float | None,
) -> None:
    """The caller's cancellation cut a write in flight: the operator sees it (it logged
    nothing), and the request says it may have been applied, as after Request.cancel()."""
    request = Request(name="kv.replace", idempotent=False, timeout=deadline)

    async def send(_: Request) -> None:
        await anyio.sleep_forever()

    events = await caller_cancels(request, send, 0.02)
    assert request.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert request.maybe_applied
    assert request.error_context().attempts[-1].effect is AttemptEffect.MAYBE_APPLIED
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["log_level"] == "info"
    assert event["cancellation_reason"] == "TASK_CANCELLED"
    assert event["in_flight"] is True
    assert event["ambiguous"] is True


async def test_the_callers_own_cancellation_in_backoff_is_reported_at_debug() -> None:
    request = Request(name="kv.replace", idempotent=False, timeout=5.0)

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)  # the server applied nothing

    events = await caller_cancels(request, send, 0.05)
    assert not request.maybe_applied
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["log_level"] == "debug"
    assert event["cancellation_reason"] == "TASK_CANCELLED"
    assert event["in_flight"] is False


class _CancelledWhileDeciding(BestEffortRetryStrategy):
    """Request.cancel() lands while the strategy decides (from another thread on the
    sync door), and the strategy then declines."""

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        request.cancel()
        return RetryAction.no_retry()


@pytest.mark.parametrize("door", ["execute", "execute_sync"])
async def test_a_cancel_during_a_declining_strategy_is_reported_as_the_cancel(door: str) -> None:
    """The message blamed the strategy ("declined to retry") for a request the caller had
    cancelled, and no retry.cancelled was logged."""

    async def send(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    def send_sync(_: Request) -> None:
        raise RetryableError(RetryReason.KV_LOCKED)

    request = Request(
        name="kv.get", idempotent=True, timeout=5.0, retry_strategy=_CancelledWhileDeciding()
    )

    async def run() -> None:
        if door == "execute":
            await RetryOrchestrator().execute(request, send)
        else:
            RetryOrchestrator().execute_sync(request, send_sync)

    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await run()
    assert "request was cancelled" in str(info.value)
    assert "declined" not in str(info.value)
    assert request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    names = [e["event"] for e in events]
    assert "retry.cancelled" in names
    assert "retry.not_retried" not in names


async def test_the_callers_cancellation_of_a_hedge_says_its_copies_were_in_flight() -> None:
    """The chain books the copies it cut; the event said in_flight=False all the same."""
    request = Request(name="kv.get", idempotent=True, timeout=5.0)

    async def send(_: Request, index: int) -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        with anyio.move_on_after(0.05) as scope:
            await RetryOrchestrator().hedge(request, send, HedgePolicy(2, delay=0.01))
        assert scope.cancelled_caught
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["cancellation_reason"] == "TASK_CANCELLED"
    assert event["in_flight"] is True
    assert request.maybe_applied


def test_execute_sync_cancelled_while_send_blocks_books_its_answer_dropped() -> None:
    """The answer (an error) came after Request.cancel() from another thread: the message
    said "not applied" and the attempt was not booked, though the write was in flight."""
    import threading

    request = Request(name="kv.replace", idempotent=False, timeout=5.0)
    started, cancelled = threading.Event(), threading.Event()

    def canceller() -> None:
        started.wait(5)
        request.cancel()
        cancelled.set()

    def send(_: Request) -> None:
        started.set()
        cancelled.wait(5)
        raise ValueError("the server said no")

    thread = threading.Thread(target=canceller)
    thread.start()
    try:
        with pytest.raises(RequestCanceledException, match="answered; its answer was dropped"):
            RetryOrchestrator().execute_sync(request, send)
    finally:
        thread.join(5)
    assert request.maybe_applied
    assert [a.effect for a in request.error_context().attempts] == [AttemptEffect.MAYBE_APPLIED]


@pytest.mark.parametrize("who", ["Request.cancel()", "the caller"])
async def test_an_attempt_cut_in_flight_is_reported_as_cut_not_as_the_failure_before_it(
    who: str,
) -> None:
    """retry.cancelled gave the cut attempt 2 the reason and caused_by of attempt 1's
    KV_LOCKED (an operator's review): it was not locked, it was cut. As retry.timed_out
    reports an attempt its deadline cut: reason null, caused_by naming the cut, the
    failure before it as previous_reason and previous_error. The cut comes once attempt 2
    is in flight, however the loop stalls (a ~0.2 s pause in a full run once put it in
    the backoff before attempt 2)."""
    request = Request(name="kv.replace", idempotent=False, timeout=5.0)
    sends = 0
    second = anyio.Event()

    async def send(_: Request) -> None:
        nonlocal sends
        sends += 1
        if sends == 1:
            raise RetryableError(RetryReason.KV_LOCKED)  # the server applied nothing
        second.set()
        await anyio.sleep_forever()

    if who == "the caller":
        events = await caller_cancels(request, send, 0.01, second)
    else:
        error, events = await execute_then_cancel(request, send, 0.01, second)
        assert error.context is not None
        assert error.context.reason is None  # the cut attempt's: it raised nothing
    assert sends == 2
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["attempt"] == 2
    assert event["reason"] is None
    assert event["caused_by"] == "attempt 2 was cut in flight by the cancellation"
    assert event["previous_reason"] == "KV_LOCKED"
    assert event["previous_error"] == "RetryableError: KV_LOCKED"
    assert event["in_flight"] is True


@pytest.mark.parametrize("who", ["Request.cancel()", "the caller"])
async def test_a_hedges_copies_cut_are_reported_as_cut_not_as_the_failure_before(
    who: str,
) -> None:
    """As for execute's attempt in flight: a hedged request whose copies the cancellation
    cut said reason KV_LOCKED and caused_by KV_LOCKED, the failure of an earlier copy (a
    review)."""
    request = Request(name="kv.get", idempotent=True, timeout=5.0)

    async def send(_: Request, index: int) -> None:
        if index == 0:
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)  # non-fatal: next copy
        await anyio.sleep_forever()

    policy = HedgePolicy(3, delay=0.01)
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        if who == "the caller":
            with anyio.move_on_after(0.05):
                await RetryOrchestrator().hedge(request, send, policy)
        else:

            async def run() -> None:
                with pytest.raises(RequestCanceledException):
                    await RetryOrchestrator().hedge(request, send, policy)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.sleep(0.05)
                request.cancel()
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["reason"] is None
    assert event["caused_by"] == "the hedge's copies in flight were cut by the cancellation"
    assert event["previous_reason"] == "KV_TEMPORARY_FAILURE"
    assert event["in_flight"] is True


async def test_a_write_cancelled_in_flight_then_failing_is_reported_as_on_execute_sync() -> None:
    """``Request.cancel()`` while a write is in flight, then the write fails (no deadline,
    so nothing cuts it): the attempt went out, so it may have been applied, as
    ``execute_sync`` reports it. ``execute`` said "it was not applied on the server
    (unambiguous)" and left the attempt in flight."""

    def sync_send(request: Request) -> str:
        request.cancel()  # another thread's cancel landing while the write is in flight
        raise ConnectionResetError("connection reset after the frame went out")

    async def async_send(request: Request) -> str:
        request.cancel()  # another task's
        await anyio.lowlevel.checkpoint()
        raise ConnectionResetError("connection reset after the frame went out")

    on_threads = Request(name="set", idempotent=False, timeout=None)
    with pytest.raises(RequestCanceledException) as sync_error:
        RetryOrchestrator().execute_sync(on_threads, sync_send)
    on_loop = Request(name="set", idempotent=False, timeout=None)
    with pytest.raises(RequestCanceledException) as async_error:
        await RetryOrchestrator().execute(on_loop, async_send)
    assert "may have been applied" in str(async_error.value)
    assert on_loop.maybe_applied
    assert not on_loop.in_flight
    assert on_loop.failed_attempts == on_threads.failed_attempts == 1
    assert str(async_error.value).split(" {")[0] == str(sync_error.value).split(" {")[0]
