"""Cuts that reach a ``send`` in odd shapes (a trio edge review's repros, rfc/0001 and rfc/0004).

1. trio: a ``send`` running a nursery (a reader task beside the writer) whose task reports
   the cut as its own error raises a group of the cut's ``Cancelled`` and that error. The
   deadline's ``trio.CancelScope`` took its ``Cancelled`` out and raised the rest: the
   caller got an ``ExceptionGroup`` instead of the timeout, a write cut in flight ended
   FAILED and "not applied", ``attempt()`` left its request PENDING, a hedge's loser
   replaced the winner's answer, and the error escaped the caller's own cancel scope.
2. A hedge copy that turns the deadline's cut into a ``RetryableError`` whose reason ends
   the chain (not in ``non_fatal``, or refused by the strategy) ended the request "not
   retried" instead of timing out, as ``execute`` does with the same ``send``.
3. Copies booked just before the caller's cancellation: trio's runner skips them (on asyncio
   their send is called and cut at once, rfc/0004); a timeout inside hedge 0's send taken
   back in the turn a hedge fell due must not lose that hedge.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import anyio
import anyio.lowlevel
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    FailFastRetryStrategy,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)

pytestmark = pytest.mark.anyio

SAFETY = 10.0


class Reset(Exception):
    """What a driver's reader task raises when its read is cut."""


async def _reader(latency: float) -> None:
    try:
        await anyio.sleep(latency)
    except anyio.get_cancelled_exc_class():
        raise Reset("connection reset by the cut") from None


async def driver(latency: float) -> str:
    """A send with a task group: a reader beside the writer, both waiting ``latency``."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(_reader, latency)
        await anyio.sleep(latency)
    return f"answer after {latency}s"


async def test_a_write_cut_in_a_task_group_times_out_ambiguous() -> None:
    orch = RetryOrchestrator()
    request = Request(name="upsert", idempotent=False, timeout=0.05)
    with anyio.fail_after(SAFETY), pytest.raises(AmbiguousTimeoutException):
        await orch.execute(request, lambda r: driver(60))
    assert request.state is RequestState.CANCELLED
    assert request.maybe_applied


async def test_an_attempt_block_cut_in_a_task_group_times_out() -> None:
    orch = RetryOrchestrator()
    request = Request(name="upsert", idempotent=False, timeout=0.05)
    with anyio.fail_after(SAFETY), pytest.raises(AmbiguousTimeoutException), orch.attempt(request):
        await driver(60)
    assert request.state is RequestState.CANCELLED
    assert not request.in_flight


async def test_a_losing_copy_cut_in_a_task_group_leaves_the_winners_answer() -> None:
    orch = RetryOrchestrator()
    request = Request(name="get", idempotent=True, timeout=5)

    async def send(r: Request, index: int) -> str:
        return await driver([60.0, 0.005][index])

    with anyio.fail_after(SAFETY):
        answer = await orch.hedge(request, send, HedgePolicy(max_attempts=2, delay=0.01))
    assert answer == "answer after 0.005s"
    assert request.state is RequestState.SUCCEEDED


@pytest.mark.parametrize("cut_by", ["deadline", "Request.cancel()", "caller's scope"])
async def test_hedged_copies_cut_in_task_groups_end_as_the_cut_says(cut_by: str) -> None:
    orch = RetryOrchestrator()
    request = Request(name="get", idempotent=True, timeout=0.1 if cut_by == "deadline" else 5)

    async def send(r: Request, index: int) -> str:
        return await driver(60)

    policy = HedgePolicy(max_attempts=2, delay=0.01)
    with anyio.fail_after(SAFETY):
        if cut_by == "deadline":
            with pytest.raises(UnambiguousTimeoutException):
                await orch.hedge(request, send, policy)
        elif cut_by == "Request.cancel()":
            async with anyio.create_task_group() as tg:

                async def cancel_soon() -> None:
                    await anyio.sleep(0.05)
                    request.cancel()

                tg.start_soon(cancel_soon)
                with pytest.raises(RequestCanceledException):
                    await orch.hedge(request, send, policy)
        else:
            with anyio.move_on_after(0.05) as scope:
                await orch.hedge(request, send, policy)
            assert scope.cancelled_caught  # before, on trio: Reset escaped the scope
    assert request.state is RequestState.CANCELLED


async def test_a_timeout_inside_hedge_0s_send_just_after_the_hedge_was_due_keeps_it() -> None:
    """asyncio: hedge 0's send has its own read timeout (``anyio.move_on_after``), which
    cancels the caller's task for a moment and takes it back. Expiring in the turn the
    hedge's timer fired, just after it, the hedge was booked first and then skipped for
    good (the caller looked cancelled as its task began): the request waited for the slow
    copy. The copy waits while the caller is being cancelled, and goes out once the
    timeout is taken back. (A review's repro of the first version of the skip.)"""
    orch = RetryOrchestrator()
    sent: list[int] = []

    async def send(r: Request, index: int) -> str:
        sent.append(index)
        if index == 0:
            with anyio.move_on_after(0.021):  # the read timeout, just after the hedge is due
                await anyio.sleep(60)
            await anyio.sleep(1.0)
            return "slow"
        return "fast"

    async def stall() -> None:  # the loop late: the hedge's timer and the timeout in one turn
        await anyio.sleep(0.005)
        time.sleep(0.03)  # noqa: ASYNC251 - blocking on purpose: a late loop

    request = Request(name="get", idempotent=True, timeout=5)
    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stall)
            answer = await orch.hedge(request, send, HedgePolicy(max_attempts=2, delay=0.02))
    assert answer == "fast"
    assert sent == [0, 1]


@pytest.mark.parametrize("effect", [None, AttemptEffect.NOT_SENT], ids=["in_flight", "not_sent"])
@pytest.mark.parametrize("refused_by", ["non_fatal", "strategy"])
async def test_a_hedge_copy_turning_the_deadlines_cut_into_a_final_reason_times_out(
    refused_by: str, effect: AttemptEffect | None
) -> None:
    """A copy that turns the deadline's cut into a reason that would end the chain (not in
    ``non_fatal``, or refused by the strategy), also one saying it sent nothing: the
    timeout, as ``execute`` gives for the same send (was "not retried"/"not hedged further")."""
    orch = RetryOrchestrator()
    strategy = FailFastRetryStrategy() if refused_by == "strategy" else None
    request = Request(name="get", idempotent=True, timeout=0.05, retry_strategy=strategy)
    reason = (
        RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT
        if effect is None
        else RetryReason.SOCKET_NOT_AVAILABLE
    )

    async def send(r: Request, index: int) -> str:
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            raise RetryableError(reason, effect=effect) from None
        return "never"

    non_fatal = frozenset({RetryReason.KV_LOCKED}) if refused_by == "non_fatal" else None
    policy = HedgePolicy(max_attempts=2, delay=timedelta(milliseconds=10), non_fatal=non_fatal)
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await orch.hedge(request, send, policy)
    assert request.state is RequestState.CANCELLED
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await orch.execute(
            Request(name="get", idempotent=True, timeout=0.05, retry_strategy=strategy),
            lambda r: send(r, 0),
        )  # the same send through execute: the door's answer hedge must match


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_no_copy_is_sent_after_the_callers_cancellation(
    turns: int, anyio_backend: str
) -> None:
    """Every copy due at once (delay 0); the caller's scope is cancelled ``turns`` loop turns
    after ``hedge`` began. A copy whose send was called after the cancel is the bug."""
    if anyio_backend == "asyncio":
        pytest.skip("asyncio: such a copy's send is called and cut at once (rfc/0004)")
    orch = RetryOrchestrator()
    events: list[str] = []

    async def send(r: Request, index: int) -> None:
        events.append(f"send({index})")
        await anyio.sleep(60)

    request = Request(name="get", idempotent=True, timeout=5)
    with anyio.fail_after(SAFETY):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def canceller() -> None:
                    for _ in range(turns):
                        await anyio.lowlevel.checkpoint()
                    events.append("cancelled")
                    scope.cancel()

                tg.start_soon(canceller)
                await orch.hedge(request, send, HedgePolicy(max_attempts=3, delay=0))
    assert scope.cancelled_caught
    assert "cancelled" in events
    assert not any(e.startswith("send") for e in events[events.index("cancelled") :])
    assert request.state is RequestState.CANCELLED


# -- 4. a refusal whose reason says "not sent" by default (no effect given) -----------------------


async def test_a_block_refused_unsent_as_the_request_is_cancelled_is_booked_not_sent() -> None:
    """``attempt()``: the block's answer is a refusal whose reason means nothing was sent
    (``SERVICE_NOT_AVAILABLE``, no ``effect`` given: the reason's default), and
    ``Request.cancel()`` came as it was handed over. The door read only an explicit
    ``effect``, booked the attempt maybe applied, and never refunded the retry's budget
    token (the doors fuzz at 1,000 seeds, trio seed 378)."""
    from sdkcore import RetryBudget

    budget = RetryBudget()
    orch = RetryOrchestrator(retry_budget=budget)
    request = Request(name="upsert", idempotent=False)

    def refused(reason: RetryReason, cancel: bool) -> None:
        with orch.attempt(request):
            if cancel:
                request.cancel()
            raise RetryableError(reason)

    with pytest.raises(RetryableError):
        refused(RetryReason.KV_TEMPORARY_FAILURE, cancel=False)  # not applied: retried
    await orch.maybe_retry(request, RetryReason.KV_TEMPORARY_FAILURE)  # pays one token
    balance = budget.balance
    with pytest.raises(RequestCanceledException) as caught:
        refused(RetryReason.SERVICE_NOT_AVAILABLE, cancel=True)
    assert request.attempts[-1].effect is AttemptEffect.NOT_SENT
    assert not request.maybe_applied
    assert "not applied" in str(caught.value)
    assert budget.balance == balance + 1  # the token for the retry that sent nothing


async def test_a_write_cut_by_its_deadline_into_an_unsent_reason_times_out_unambiguous() -> None:
    """``execute``: the deadline cuts a write waiting for a connection, and its send turns
    the cut into ``SERVICE_NOT_AVAILABLE`` (nothing sent, by the reason's default): the
    timeout said "may have been applied" (only an explicit ``effect`` was read)."""
    orch = RetryOrchestrator()
    request = Request(name="upsert", idempotent=False, timeout=0.05)

    async def send(r: Request) -> str:
        try:
            await anyio.sleep(60)  # waiting for a connection
        except anyio.get_cancelled_exc_class():
            raise RetryableError(RetryReason.SERVICE_NOT_AVAILABLE) from None
        return "never"

    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await orch.execute(request, send)
    assert not request.maybe_applied


# -- 5. a final review's repros -------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("seconds", [1.0, None])
@pytest.mark.skipif(sys.version_info < (3, 11), reason="counts pending cancellations from 3.11")
async def test_hedge_0_turning_the_callers_cancellation_into_a_retry_is_the_cancellation(
    seconds: float | None,
) -> None:
    """asyncio runs hedge 0 in the caller's task: a send that turns the caller's own
    ``task.cancel()`` into a non-fatal ``RetryableError`` had the chain carry on, polling
    every millisecond until the deadline (timed out 0.95 s later) or for ever without one;
    ``execute`` gives the caller's cancellation at once. So does ``hedge`` now."""
    import asyncio

    orch = RetryOrchestrator()
    sent: list[int] = []

    async def send(r: Request, index: int) -> None:
        sent.append(index)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, "reset") from None

    request = Request(name="get", idempotent=True, timeout=seconds)
    task = asyncio.ensure_future(orch.hedge(request, send, HedgePolicy(max_attempts=3, delay=10)))
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.5)  # before: 0.95 s, or never
    assert task in done
    assert task.cancelled()
    assert sent == [0]
    assert request.state is RequestState.CANCELLED


async def test_a_losing_copy_turning_its_cut_into_a_retry_is_booked_cut() -> None:
    """Cut because another copy answered, a loser whose send turns the cut into a
    ``RetryableError`` is a cut copy (``hedge.cancelled``, maybe applied), as one raising a
    plain error is; it was booked a failure for its reason (rfc/0004 said cut)."""
    from sdkcore.testing import capture_retry_events

    orch = RetryOrchestrator()

    async def send(r: Request, index: int) -> str:
        if index == 1:
            return "fast"
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, "reset") from None
        return "never"

    request = Request(name="get", idempotent=True, timeout=5)
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        answer = await orch.hedge(request, send, HedgePolicy(max_attempts=2, delay=0.01))
    assert answer == "fast"
    cancelled = [e for e in events if e["event"] == "hedge.cancelled"]
    assert [e["hedge"] for e in cancelled] == [0]
    assert request.retry_reasons == ()
