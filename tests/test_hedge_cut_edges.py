"""Hedged requests cut while a copy is still sending (rfc/0004; an edge review's repros).

1. A copy cut by the deadline (or Request.cancel()) whose send raises an error of its
   own as its cancellation reaches it ("connection reset", as a driver's cut read
   does) ended the request FAILED with that error; execute gives the timeout whatever
   the cut attempt raised (rfc/0001). The copy is booked cut, in flight.
2. Request.cancel() landing after a copy answered, before hedge() resumed: the error
   had none of the hedges' bookkeeping (rfc/0004: every hedged request's context has it).
3. asyncio: the caller cancelled while hedge 0's send took its time to clean up: the
   timer kept sending copies meanwhile (trio sent none).

On asyncio and trio (3: asyncio only, a task's pending cancellations are counted on 3.11+).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import anyio
import pytest

from sdkcore import (
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryOrchestrator,
    UnambiguousTimeoutException,
)
from sdkcore.testing import capture_retry_events

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_gc_pauses")]

SAFETY = 10.0


class DriverError(Exception):
    pass


class ResetOnCut:
    """send(request, index): hangs; cut, it raises DriverError("connection reset")."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.two = anyio.Event()  # two copies are in flight

    async def __call__(self, request: Request, index: int) -> Any:
        self.sent.append(index)
        if len(self.sent) == 2:
            self.two.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            raise DriverError(f"copy {index}: connection reset") from None


async def test_a_copy_cut_by_the_deadline_that_raises_its_own_error_is_a_timeout() -> None:
    send = ResetOnCut()
    request = Request(name="kv.get", idempotent=True, timeout=0.15)
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException) as info:
        await RetryOrchestrator().hedge(request, send, HedgePolicy(3, delay=0.03))
    sent = len(send.sent)  # 3 on time; fewer if the loop was late (the deadline is what matters)
    assert sorted(send.sent) == list(range(sent))
    context = info.value.context
    assert context is not None
    assert context.in_flight
    assert [h["outcome"] for h in context.extra["hedges"]] == ["cancelled"] * sent
    assert [a.effect.name for a in context.attempts] == ["MAYBE_APPLIED"] * sent
    assert request.cancellation_reason is not None
    assert request.cancellation_reason.name == "TIMEOUT"


async def test_a_copy_cut_by_request_cancel_that_raises_its_own_error_is_in_flight() -> None:
    send = ResetOnCut()
    request = Request(name="kv.get", idempotent=True, timeout=SAFETY)
    caught: list[BaseException] = []

    async def run() -> None:
        try:
            await RetryOrchestrator().hedge(request, send, HedgePolicy(2, delay=0.02))
        except RequestCanceledException as exc:
            caught.append(exc)

    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await send.two.wait()
            request.cancel()
    [error] = caught
    assert isinstance(error, RequestCanceledException)
    assert error.context is not None
    assert error.context.in_flight
    assert [h["outcome"] for h in error.context.extra["hedges"]] == ["cancelled"] * 2


async def test_request_cancel_after_a_copy_answered_keeps_the_hedges_context() -> None:
    request = Request(name="kv.get", idempotent=True, timeout=SAFETY)

    all_out = anyio.Event()

    async def send(request: Request, index: int) -> Any:
        if index == 0:
            await all_out.wait()
            request.cancel()  # the application's other task, in the turn the answer came
            return "answer"
        if index == 2:
            all_out.set()
        await anyio.sleep_forever()

    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().hedge(request, send, HedgePolicy(3, delay=0.02))
    context = info.value.context
    assert context is not None
    assert {"hedge_winner", "hedges_sent", "hedges"} <= set(context.extra)
    assert context.in_flight  # the losers it cut
    assert [a.effect.name for a in context.attempts] == ["MAYBE_APPLIED"] * 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 cannot count a task's cancellations")
async def test_no_copy_goes_out_while_the_cancelled_caller_unwinds_hedge_0() -> None:
    sent: list[int] = []

    out = asyncio.Event()

    async def send(request: Request, index: int) -> Any:
        sent.append(index)
        out.set()
        try:
            await asyncio.sleep(SAFETY)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # an orderly close of the connection
            raise

    request = Request(name="kv.get", idempotent=True, timeout=SAFETY)
    task = asyncio.ensure_future(
        RetryOrchestrator().hedge(request, send, HedgePolicy(4, delay=0.05))
    )
    await out.wait()  # copy 0 in flight, the next due at 50 ms: cut well before it
    task.cancel()
    with anyio.fail_after(SAFETY), pytest.raises(asyncio.CancelledError):
        await task
    assert sent == [0]
    assert request.cancellation_reason is not None
    assert request.cancellation_reason.name == "TASK_CANCELLED"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is Python 3.11+")
async def test_a_timeout_inside_hedge_0s_send_is_not_the_callers_cancellation() -> None:
    """A driver's own read timeout inside hedge 0's send cancels the caller's task for a
    moment (asyncio.timeout takes it back): a hedge due in that turn was taken for one
    after the caller's cancellation, and no hedge was ever sent again."""
    sent: list[int] = []

    async def send(request: Request, index: int) -> Any:
        sent.append(index)
        if index == 0:
            try:
                async with asyncio.timeout(0.019):  # type: ignore[attr-defined,unused-ignore]  # the driver's own read timeout
                    await asyncio.sleep(SAFETY)
            except TimeoutError:
                pass  # it reads again (a slow replica)
            await asyncio.sleep(SAFETY)
            return "slow"
        return "fast"

    async def stall() -> None:  # the loop late: the timeout and the hedge due in one turn
        await asyncio.sleep(0.005)
        time.sleep(0.03)  # noqa: ASYNC251 - the stall is the point

    stalling = asyncio.ensure_future(stall())
    request = Request(name="kv.get", idempotent=True, timeout=SAFETY)
    with anyio.fail_after(SAFETY):
        result = await RetryOrchestrator().hedge(request, send, HedgePolicy(3, delay=0.02))
    await stalling
    assert result == "fast"
    assert sent[:2] == [0, 1]


async def test_copies_cut_for_the_callers_cancellation_that_raise_are_booked_cut(
    anyio_backend: str,
) -> None:
    """The caller's cancel scope cuts the request with copies in flight, and their sends
    raise "connection reset" for it: copy 1 is booked cut in flight (maybe applied), not a
    fatal failure of its own (asyncio booked it fatal and logged hedge.failed). Copy 0
    runs in the caller's task on asyncio: its error is the caller's, as with a bare await
    (on trio every copy is a child task, cut by the caller's scope)."""
    send = ResetOnCut()
    request = Request(name="kv.get", idempotent=True, timeout=SAFETY)
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_when_two_are_out() -> None:
                    await send.two.wait()
                    scope.cancel()

                tg.start_soon(cancel_when_two_are_out)
                await RetryOrchestrator().hedge(request, send, HedgePolicy(2, delay=0.02))
    assert scope.cancelled_caught
    assert request.cancellation_reason is not None
    assert request.cancellation_reason.name == "TASK_CANCELLED"
    effects = [a.effect.name for a in request.attempts]
    assert effects[1:] == ["MAYBE_APPLIED"]  # copy 1, cut
    failed = [e["hedge"] for e in events if e["event"] == "hedge.failed"]
    assert failed == ([] if anyio_backend == "trio" else [0])
