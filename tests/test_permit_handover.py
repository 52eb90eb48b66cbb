"""A queued caller cancelled as its permit is handed over never runs its block (rfc/0009).

When a permit comes back, ``acquire()`` hands it to the first caller in line and wakes
it; trio reschedules that task at once. A cancellation requested after the hand-over
(``Request.cancel()`` in the same turn, a cancel scope, a hedge cutting its losers)
must cut the caller before its block runs: the block is where the request is
written, and a write after ``cancel()`` returned may be applied. The permit then goes
to the next in line, and nothing leaks. Both limiters share the queue
(``sdkcore._permits``); every test runs on asyncio and trio.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
from fuzz_kit import CountingBudget, wait_until

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AttemptEffect,
    ConcurrencyLimiter,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryBudget,
    RetryOrchestrator,
)

Limiter = ConcurrencyLimiter | AdaptiveConcurrencyLimiter

LIMITERS: list[Callable[[], Limiter]] = [
    lambda: ConcurrencyLimiter(1, max_queued=4),
    lambda: AdaptiveConcurrencyLimiter(1, 1, 1, max_queued=4),
]
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("make", LIMITERS, ids=["fixed", "adaptive"]),
]


async def test_a_scope_cancelled_as_the_permit_arrives_cuts_the_block(
    make: Callable[[], Limiter],
) -> None:
    limiter = make()
    ran: list[str] = []
    scope = anyio.CancelScope()
    done = anyio.Event()

    async def holder() -> None:
        async with limiter.acquire():
            await done.wait()
        scope.cancel()  # no checkpoint in between: the permit is the first waiter's

    async def first() -> None:
        with scope:
            async with limiter.acquire():
                ran.append("first")  # a write, after its cancellation: never
        assert scope.cancelled_caught

    async def second() -> None:
        async with limiter.acquire():
            ran.append("second")

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_until(lambda: limiter.in_flight == 1)
        tg.start_soon(first)
        await wait_until(lambda: limiter.queued == 1)
        tg.start_soon(second)
        await wait_until(lambda: limiter.queued == 2)
        done.set()
    assert ran == ["second"]  # the first one's permit went on to it
    assert (limiter.in_flight, limiter.queued) == (0, 0)


async def test_request_cancel_as_the_permit_arrives_sends_nothing(
    make: Callable[[], Limiter],
) -> None:
    limiter = make()
    orchestrator = RetryOrchestrator()
    written: list[str] = []
    done = anyio.Event()
    queued = Request(name="kv.append", timeout=5.0, idempotent=False)

    async def send_holder(request: Request) -> bytes:
        async with limiter.acquire():
            written.append("holder")
            await done.wait()
        queued.cancel()  # in the turn the permit is handed to the queued request
        return b"held"

    async def send_queued(request: Request) -> bytes:
        async with limiter.acquire():
            written.append("queued")  # the non-idempotent write
            return b"appended"

    outcome: list[BaseException] = []

    async def run_queued() -> None:
        with pytest.raises(RequestCanceledException) as caught:
            await orchestrator.execute(queued, send_queued)
        outcome.append(caught.value)

    async with anyio.create_task_group() as tg:
        tg.start_soon(orchestrator.execute, Request(name="kv.get", timeout=5.0), send_holder)
        await wait_until(lambda: limiter.in_flight == 1)
        tg.start_soon(run_queued)
        await wait_until(lambda: limiter.queued == 1)
        done.set()
    assert written == ["holder"]
    assert not queued.maybe_applied  # cut before its write: unambiguous
    assert [a.effect for a in queued.attempts] == [AttemptEffect.NOT_SENT]
    assert "not applied" in str(outcome[0])
    assert (limiter.in_flight, limiter.queued) == (0, 0)


async def test_hedge_copies_queued_behind_the_winner_are_never_sent(
    make: Callable[[], Limiter],
) -> None:
    limiter = make()
    problems: list[str] = []
    budget = CountingBudget(RetryBudget(), problems, lambda: None)
    orchestrator = RetryOrchestrator(retry_budget=budget)
    sent: list[int] = []
    answer = anyio.Event()
    request = Request(name="kv.get", idempotent=True, timeout=5.0)

    async def send(request: Request, index: int) -> bytes:
        async with limiter.acquire():
            sent.append(index)
            if index == 0:
                await answer.wait()
            return b"copy%d" % index

    result: list[bytes] = []

    async def run() -> None:
        result.append(await orchestrator.hedge(request, send, HedgePolicy(3, delay=0.001)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await wait_until(lambda: limiter.queued == 2)  # copies 1 and 2 wait for copy 0's permit
        answer.set()  # copy 0 wins as it hands its permit to copy 1
    assert result == [b"copy0"]
    assert sent == [0]  # nothing of the losers went out after the winner
    assert (limiter.in_flight, limiter.queued) == (0, 0)
    # The losers waited in the queue: booked not sent, their withdrawals given back (they
    # were booked maybe applied, and the budget drained by copies that never left).
    effects = [a.effect for a in request.error_context().attempts]
    assert effects.count(AttemptEffect.NOT_SENT) == 2
    assert budget.refunds == 2
    assert problems == []  # (no refund without its withdrawal)


async def test_a_cancelled_hedge_whose_only_cut_copy_waited_in_the_queue_says_none_in_flight(
    make: Callable[[], Limiter],
) -> None:
    """The copies cut in a limiter's queue were counted as cut in flight
    (``retry.cancelled`` in_flight=True with nothing sent)."""
    from sdkcore.testing import capture_retry_events

    limiter = make()
    held = anyio.Event()
    release = anyio.Event()

    async def holder() -> None:
        async with limiter.acquire():
            held.set()
            await release.wait()

    async def send(request: Request, index: int) -> bytes:
        async with limiter.acquire():
            return b"never"

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    # (a cancel scope without a deadline: with one, the queue would end just before it,
    # a refusal, as it ends before the request's own)
    scope = anyio.CancelScope()

    async def cancel_soon() -> None:
        await anyio.sleep(0.05)
        scope.cancel()

    with capture_retry_events() as events:
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await held.wait()
            tg.start_soon(cancel_soon)
            with scope:
                await RetryOrchestrator().hedge(request, send, HedgePolicy(1, delay=1.0))
            release.set()
    assert scope.cancelled_caught
    (event,) = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["in_flight"] is False
    assert not request.maybe_applied
