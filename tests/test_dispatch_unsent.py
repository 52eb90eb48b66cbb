"""``sdkcore.dispatch_unsent()``: a ``send`` says its attempt was cut before anything was
written, so a write's timeout stays unambiguous (rfc/0001, "Dispatch not sent").

A driver's ``send`` often waits before it writes (a connection's write lock, a pool):
cut there by the request's deadline, the attempt was booked cut in flight, "may have been
applied (ambiguous)", though nothing went out. On asyncio and trio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
    dispatch_unsent,
)

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def lock_wait(say_unsent: bool) -> AsyncIterator[None]:
    """A wait for a lock nobody releases, as a driver's before its write."""
    try:
        await anyio.Event().wait()
        yield
    except BaseException:
        if say_unsent:
            dispatch_unsent()
        raise


@pytest.mark.parametrize("say_unsent", [True, False])
async def test_a_write_cut_before_it_was_written_times_out_unambiguous(say_unsent: bool) -> None:
    async def send(request: Request) -> None:
        async with lock_wait(say_unsent):
            raise AssertionError("never reached")

    request = Request(name="kv.upsert", idempotent=False, timeout=0.1)
    expected = UnambiguousTimeoutException if say_unsent else AmbiguousTimeoutException
    with anyio.fail_after(5), pytest.raises(expected) as info:
        await RetryOrchestrator().execute(request, send)
    effect = AttemptEffect.NOT_SENT if say_unsent else AttemptEffect.MAYBE_APPLIED
    assert [a.effect for a in request.attempts] == [effect]
    if say_unsent:
        assert "it was not applied on the server (unambiguous)" in str(info.value)


async def test_in_an_attempt_block_too() -> None:
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=0.1)

    async def block() -> None:
        with orchestrator.attempt(request):
            async with lock_wait(True):
                pass

    with anyio.fail_after(5), pytest.raises(UnambiguousTimeoutException):
        await block()
    assert [a.effect for a in request.attempts] == [AttemptEffect.NOT_SENT]


async def test_an_error_after_the_mark_is_booked_as_itself() -> None:
    """Only a cancellation reads the mark: send that caught its own cut and went on to
    fail otherwise is booked with that failure."""

    async def send(request: Request) -> None:
        with anyio.move_on_after(0.01):
            async with lock_wait(True):
                pass
        raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)  # then: one more attempt

    calls = []

    async def counted(request: Request) -> str:
        calls.append(request.retry_attempts)
        if len(calls) == 1:
            await send(request)
        return "ok"

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    with anyio.fail_after(5):
        assert await RetryOrchestrator().execute(request, counted) == "ok"
    # booked with what the RetryableError says (its reason's default effect), not NOT_SENT
    assert [(a.reason, a.effect) for a in request.attempts] == [
        (RetryReason.KV_TEMPORARY_FAILURE, AttemptEffect.NOT_APPLIED)
    ]


def test_outside_any_door_it_does_nothing() -> None:
    try:
        raise KeyboardInterrupt  # stands for a cancellation being handled
    except KeyboardInterrupt:
        dispatch_unsent()  # no mark: nothing to say it to, and no error


async def test_called_outside_a_handler_it_is_refused() -> None:
    """Called before the write ("nothing written yet") rather than in the handler of the
    cut, it marked no cut, so that any later cut counted as unsent: a SET that went out
    and was cut waiting for its answer timed out "not applied (unambiguous)"."""
    written: list[str] = []

    async def send(request: Request) -> None:
        with pytest.raises(RuntimeError, match=r"in the handler of the cancellation"):
            dispatch_unsent()
        written.append("SET k1")
        await anyio.Event().wait()  # the answer never comes

    request = Request(name="kv.upsert", idempotent=False, timeout=0.05)
    with anyio.fail_after(5), pytest.raises(AmbiguousTimeoutException):
        await RetryOrchestrator().execute(request, send)
    assert written == ["SET k1"]
    assert [a.effect for a in request.attempts] == [AttemptEffect.MAYBE_APPLIED]


async def test_a_cut_send_got_past_does_not_mark_a_later_cut() -> None:
    """The mark stayed set: a send that caught its queue's cut, wrote elsewhere and was
    then cut by the deadline waiting for the answer was booked not sent, "not applied
    (unambiguous)", for a write that went out. Only the marked cancellation counts."""
    written: list[str] = []

    async def send(request: Request) -> None:
        with anyio.move_on_after(0.02):  # a queue the send gives up on by itself
            async with lock_wait(True):
                pass
        written.append("B")  # written to another replica
        await anyio.Event().wait()  # the answer never comes: the deadline cuts it

    request = Request(name="kv.upsert", idempotent=False, timeout=0.2)
    with anyio.fail_after(5), pytest.raises(AmbiguousTimeoutException):
        await RetryOrchestrator().execute(request, send)
    assert written == ["B"]
    assert [a.effect for a in request.attempts] == [AttemptEffect.MAYBE_APPLIED]


async def test_a_nested_execute_without_a_deadline_does_not_mark_the_outer_dispatch() -> None:
    """Inside an attempt() block without a deadline, an inner request's queue cut marked
    the outer's dispatch: the outer's write, cut later, was booked not sent."""
    orchestrator = RetryOrchestrator()
    outer = Request(name="outer.upsert", idempotent=False, timeout=None)
    written: list[str] = []

    async def inner_send(request: Request) -> None:
        async with lock_wait(True):
            pass

    async def block() -> None:
        with orchestrator.attempt(outer):
            inner = Request(name="inner.get", idempotent=True, timeout=None)
            with anyio.move_on_after(0.02):
                await orchestrator.execute(inner, inner_send)
            written.append("outer write")
            await anyio.Event().wait()  # cut by outer.cancel() below

    async def cancelled_block() -> None:
        with pytest.raises(RequestCanceledException, match="may have been applied"):
            await block()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled_block)
            await anyio.sleep(0.1)
            outer.cancel()
    assert written == ["outer write"]
    assert [a.effect for a in outer.attempts] == [AttemptEffect.MAYBE_APPLIED]


async def test_a_deadline_less_execute_inside_a_send_keeps_the_outer_deadline_in_view() -> None:
    """A mark of its own for a nested execute without a deadline (a first fix for the
    test above) hid the outer request's deadline from what its send builds."""
    orchestrator = RetryOrchestrator()
    inner = Request(name="inner.get", idempotent=True, timeout=None)  # built up front
    seen: list[float | None] = []

    async def inner_send(request: Request) -> str:
        built = Request(name="innermost.get", timeout=None)
        left = built.time_left
        seen.append(None if left is None else left.total_seconds())
        return "ok"

    async def outer_send(request: Request) -> str:
        return await orchestrator.execute(inner, inner_send)

    outer = Request(name="outer.get", idempotent=True, timeout=0.5)
    with anyio.fail_after(5):
        assert await orchestrator.execute(outer, outer_send) == "ok"
    [left] = seen
    assert left is not None
    assert 0.0 < left <= 0.5
