"""Request.cancel(), the retry budget and bad arguments at every door's edges.

A cancelled request never reports success, a backoff wakes on ``Request.cancel()``
with or without a deadline, a retry that is never sent gives its budget withdrawal
back, and a refused argument leaves the request as it was.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import anyio
import pytest
from fuzz_kit import GrantingBudget

from sdkcore import (
    AttemptEffect,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryAction,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio
LOCKED = RetryReason.KV_LOCKED
BOUND = 10.0  # seconds: a test that hangs fails here instead of hanging the suite


class Wait:
    """A strategy that retries every reason after ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.with_duration(timedelta(seconds=self.seconds))


def reserve(retries: int) -> RetryBudget:
    """A budget of exactly ``retries`` retries (no deposits count: ratio 0).

    The tests' backoffs (3 s) end before their requests' deadlines (5 s): a backoff that
    reaches the deadline is a timeout, for which nothing is withdrawn."""
    return RetryBudget(min_retries_per_sec=retries / 10, retry_ratio=0.0, ttl=10)


async def cancel_soon(request: Request, after: float = 0.05) -> None:
    await anyio.sleep(after)
    request.cancel()


async def cancelled_in_flight(request: Request, call: Callable[[], Awaitable[object]]) -> None:
    """``call()`` (a door on ``request``) raises RequestCanceledException once
    ``Request.cancel()`` comes, 50 ms in; bounded, so a door that never wakes fails."""
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon, request)
            with pytest.raises(RequestCanceledException):
                await call()


def locked_sync(_: Request) -> str:
    raise RetryableError(LOCKED)


def execute_sync_cancelled_from_another_thread(orch: RetryOrchestrator, request: Request) -> None:
    """``execute_sync`` of a send that always fails retryably, with ``Request.cancel()``
    from another thread 50 ms in: it raises RequestCanceledException."""
    canceller = threading.Timer(0.05, request.cancel)
    canceller.start()
    try:
        with pytest.raises(RequestCanceledException):
            orch.execute_sync(request, locked_sync)
    finally:
        canceller.join(BOUND)


# -- hedge: a cancelled request never reports success ------------------------------------


async def test_hedge_raises_when_cancelled_after_a_copy_answered() -> None:
    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=5.0)

    async def send(r: Request, index: int) -> str:
        await anyio.sleep(0.01)
        r.cancel()  # the application cancels while the answer is on its way back
        return "answer"

    with anyio.fail_after(BOUND), pytest.raises(RequestCanceledException):
        await orch.hedge(request, send, HedgePolicy(max_attempts=2, delay=timedelta(seconds=5)))
    assert request.cancelled


async def test_hedge_fails_with_the_error_of_a_budget_that_raises() -> None:
    class Broken:
        def deposit(self) -> None:
            pass

        def try_withdraw(self) -> bool:
            raise OSError("budget store down")

    orch = RetryOrchestrator(retry_budget=Broken())
    request = Request(idempotent=True, timeout=5.0)

    async def send(r: Request, index: int) -> str:
        await anyio.sleep(3.0)  # the first copy is slow: the hedge is due after 10 ms
        return "late"

    policy = HedgePolicy(max_attempts=2, delay=timedelta(milliseconds=10))
    with anyio.fail_after(BOUND), pytest.raises(OSError, match="budget store down"):
        await orch.hedge(request, send, policy)


async def test_hedge_gives_back_the_cancel_hook_it_found() -> None:
    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=5.0)

    class Hook:
        def cancel(self) -> None:
            pass

    outer = Hook()
    request._set_cancel_hook(outer)  # as an enclosing door holds it

    async def send(r: Request, index: int) -> str:
        return "ok"

    assert await orch.hedge(request, send, HedgePolicy(max_attempts=2)) == "ok"
    assert request._set_cancel_hook(None) is outer


# -- attempt() and execute without a deadline ------------------------------------------------


async def test_attempt_without_a_timeout_is_cut_by_request_cancel() -> None:
    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=None)
    reached_end: list[bool] = []

    async def hand_wired_attempt() -> None:
        with orch.attempt(request):
            await anyio.sleep(3.0)  # the attempt in flight
            reached_end.append(True)

    await cancelled_in_flight(request, hand_wired_attempt)
    assert not reached_end
    assert request.cancelled


async def test_execute_without_a_timeout_wakes_from_its_backoff_on_cancel() -> None:
    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=None, retry_strategy=Wait(60.0))

    async def send(_: Request) -> str:
        raise RetryableError(LOCKED)

    started = time.monotonic()
    await cancelled_in_flight(request, lambda: orch.execute(request, send))
    assert time.monotonic() - started < BOUND  # not the 60 s backoff
    assert orch.requests_in_retry == 0


async def test_a_request_cancelled_in_flight_books_no_retry() -> None:
    budget = reserve(3)
    orch = RetryOrchestrator(retry_budget=budget)
    request = Request(idempotent=True, timeout=None)
    sent = 0

    async def send(r: Request) -> str:
        nonlocal sent
        sent += 1
        r.cancel()  # no deadline: the attempt runs to its end, then fails retryably
        raise RetryableError(LOCKED)

    before = budget.balance
    with capture_retry_events() as events, pytest.raises(RequestCanceledException):
        await orch.execute(request, send)
    assert sent == 1
    assert budget.balance == before
    assert request.retry_attempts == 0
    assert "retry.scheduled" not in [e["event"] for e in events]


# -- a retry never sent gives its budget withdrawal back -------------------------------------


@pytest.mark.parametrize("request_timeout", [None, 5.0], ids=["no deadline", "deadline"])
async def test_execute_refunds_a_retry_whose_backoff_request_cancel_cut(
    request_timeout: float | None,
) -> None:
    budget = reserve(2)
    orch = RetryOrchestrator(retry_budget=budget)
    before = budget.balance
    for _ in range(4):  # more requests than the budget holds: each must give its retry back
        request = Request(idempotent=True, timeout=request_timeout, retry_strategy=Wait(3.0))

        async def send(_: Request) -> str:
            raise RetryableError(LOCKED)

        await cancelled_in_flight(request, functools.partial(orch.execute, request, send))
    assert budget.balance == before


async def test_execute_refunds_a_retry_whose_backoff_the_caller_cancelled() -> None:
    budget = reserve(2)
    orch = RetryOrchestrator(retry_budget=budget)
    before = budget.balance
    request = Request(idempotent=True, timeout=5.0, retry_strategy=Wait(3.0))

    async def send(_: Request) -> str:
        raise RetryableError(LOCKED)

    with anyio.move_on_after(0.1):
        await orch.execute(request, send)
    assert request.cancelled
    assert budget.balance == before


async def test_maybe_retry_refunds_a_retry_whose_backoff_was_cut() -> None:
    budget = reserve(2)
    orch = RetryOrchestrator(Wait(3.0), retry_budget=budget)
    before = budget.balance
    request = Request(idempotent=True, timeout=5.0)
    await cancelled_in_flight(request, lambda: orch.maybe_retry(request, LOCKED))
    assert budget.balance == before


async def test_a_hand_wired_retry_cancelled_before_its_attempt_gives_its_withdrawal_back() -> None:
    """``Request.cancel()`` after ``maybe_retry`` returned and before the next ``attempt()``:
    the retry it paid for is never sent (it was kept before: the deadline's case gave it
    back, this one did not)."""
    budget = GrantingBudget()
    orch = RetryOrchestrator(Wait(0.0), retry_budget=budget)
    request = Request(idempotent=True, timeout=5.0)
    with orch.attempt(request):
        pass
    await orch.maybe_retry(request, LOCKED)
    request.cancel()
    for _ in range(2):  # asked again: given back once
        with pytest.raises(RequestCanceledException), orch.attempt(request):
            pass
    assert (budget.withdrawals, budget.refunds) == (1, 1)


async def test_a_hand_wired_retry_whose_backoff_was_cut_is_given_back_once() -> None:
    budget = GrantingBudget()
    orch = RetryOrchestrator(Wait(3.0), retry_budget=budget)
    request = Request(idempotent=True, timeout=5.0)
    with orch.attempt(request):
        pass
    await cancelled_in_flight(request, lambda: orch.maybe_retry(request, LOCKED))
    with pytest.raises(RequestCanceledException), orch.attempt(request):
        pass
    assert (budget.withdrawals, budget.refunds) == (1, 1)


async def test_an_attempt_that_went_out_keeps_what_it_was_paid() -> None:
    """A retry's attempt that answered, or that went out and was never booked (a loop that
    tries again by itself), spent its withdrawal: a later refusal gives nothing back."""
    budget = GrantingBudget()
    orch = RetryOrchestrator(Wait(0.0), retry_budget=budget)
    answered = Request(idempotent=True, timeout=5.0)
    with orch.attempt(answered):
        pass
    await orch.maybe_retry(answered, LOCKED)
    with orch.attempt(answered):
        pass
    orch.succeed(answered)
    with pytest.raises(RuntimeError, match="already succeeded"), orch.attempt(answered):
        pass
    unbooked = Request(idempotent=True, timeout=5.0)
    with orch.attempt(unbooked):
        pass
    await orch.maybe_retry(unbooked, LOCKED)
    with orch.attempt(unbooked):
        pass  # went out; the loop never books it
    unbooked.cancel()
    with pytest.raises(RequestCanceledException), orch.attempt(unbooked):
        pass
    assert (budget.withdrawals, budget.refunds) == (2, 0)


def test_execute_sync_refunds_a_retry_cancelled_during_its_backoff() -> None:
    budget = reserve(2)
    orch = RetryOrchestrator(Wait(0.3), retry_budget=budget)
    before = budget.balance
    request = Request(idempotent=True, timeout=5.0)
    execute_sync_cancelled_from_another_thread(orch, request)
    assert budget.balance == before


# -- maybe_retry refuses bad arguments before it books anything -----------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"retry_after": -1}, ValueError, "retry_after"),
        ({"retry_after": "1s"}, TypeError, "retry_after"),
        ({"cause": "boom"}, TypeError, "cause"),
        ({"effect": "NOT_SENT"}, TypeError, "effect"),
    ],
    ids=["negative hint", "text hint", "cause not an exception", "effect not an AttemptEffect"],
)
async def test_maybe_retry_leaves_the_request_as_it_was_on_a_bad_argument(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    budget = reserve(2)
    orch = RetryOrchestrator(retry_budget=budget)
    before = budget.balance
    request = Request(idempotent=True, timeout=5.0)
    call: Callable[..., Awaitable[timedelta]] = orch.maybe_retry
    with pytest.raises(error, match=message):
        await call(request, LOCKED, **kwargs)
    assert request.failed_attempts == 0
    assert request.last_reason is None
    assert not request.completed
    assert budget.balance == before
    assert orch.requests_in_retry == 0
    # and the request can still be retried with good arguments
    await orch.maybe_retry(request, LOCKED, effect=AttemptEffect.NOT_SENT, retry_after=0)
    assert request.retry_attempts == 1


# -- execute_sync: Request.cancel() from another thread -------------------------------------


def test_execute_sync_wakes_from_its_backoff_on_cancel_from_another_thread() -> None:
    orch = RetryOrchestrator(Wait(5.0))
    request = Request(idempotent=True, timeout=30.0)
    started = time.monotonic()
    execute_sync_cancelled_from_another_thread(orch, request)
    assert time.monotonic() - started < 4.0  # woken, not the 5 s backoff
    assert orch.requests_in_retry == 0


def test_execute_sync_cancelled_during_a_send_that_fails_past_the_deadline_is_cancelled() -> None:
    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=0.05)

    def send(r: Request) -> str:
        r.cancel()  # as another thread would, while the send blocks
        time.sleep(0.1)  # past the deadline
        raise RetryableError(LOCKED)

    with pytest.raises(RequestCanceledException):
        orch.execute_sync(request, send)
    assert request.cancelled


# -- asyncio: whose cancellation is it? ------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_task_that_swallowed_a_cancel_still_gets_its_timeout() -> None:
    import asyncio

    if not hasattr(asyncio.Task, "cancelling"):
        pytest.skip("Python 3.10 cannot count a task's cancellations")
    got: list[BaseException] = []

    async def send(_: Request) -> str:
        await asyncio.sleep(5)
        return "late"

    async def worker() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)  # cleanup swallows a shutdown's cancel, then runs a request
        try:
            await RetryOrchestrator().execute(Request(timeout=0.05), send)
        except BaseException as exc:
            got.append(exc)

    with anyio.fail_after(BOUND):
        task = asyncio.create_task(worker())
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [type(e).__name__ for e in got] == ["AmbiguousTimeoutException"]


async def test_a_send_that_cancels_its_own_request_is_cut_at_its_next_await() -> None:
    reached: list[str] = []

    async def send(r: Request) -> str:
        r.cancel()
        await anyio.sleep(5)  # cut here, on asyncio as on trio
        reached.append("after the await")
        return "late"

    with anyio.fail_after(BOUND), pytest.raises(RequestCanceledException):
        await RetryOrchestrator().execute(Request(timeout=30.0), send)
    assert reached == []


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_scope_cancelled_from_its_own_code_never_takes_the_callers_cancellation() -> None:
    import asyncio

    from sdkcore._runtime import _asyncio

    scope = _asyncio.Scope(math.inf)
    scope.cancel()  # from its own task: sent only at the loop's next turn
    # the caller's own cancellation ends the code first: it is the caller's, not the scope's
    assert scope.exit(asyncio.CancelledError()) is False
    await asyncio.sleep(0)  # the deferred send finds the scope closed: nothing is sent
    task = asyncio.current_task()
    assert task is not None
    if hasattr(task, "cancelling"):  # Python 3.11+
        assert not task.cancelling()
