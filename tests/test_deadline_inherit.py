"""Deadlines inherited, not leaked (issue 21, items 7, 9 and 10).

A request built inside another request's ``send`` inherits its deadline on every door
(``execute``, ``execute_sync``, ``attempt()``, ``hedge``), reports the time it
inherited, and names the outer request when that deadline ends it. Once the dispatch
is over, a task or context that outlived it inherits nothing and keeps nothing alive.
On trio and anyio, an enclosing cancel scope bounds ``time_left`` and
``dispatch_info()``; asyncio's own ``asyncio.timeout()`` is not seen.

Virtual clocks where the deadline is arithmetic; small real delays (with generous
tolerance) only where a real loop's scope or task must be involved.
"""

from __future__ import annotations

import contextvars
import gc
import sys
import weakref
from datetime import timedelta
from typing import Any

import anyio
import pytest

from sdkcore import (
    BestEffortRetryStrategy,
    HedgePolicy,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio

LOCKED = RetryReason.KV_LOCKED


def seconds(left: timedelta | None) -> float:
    assert left is not None
    return left.total_seconds()


# -- item 10: the inherited deadline is reported ---------------------------------------------


async def test_an_inner_request_without_timeout_reports_the_inherited_time_left() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    seen: list[tuple[Request, timedelta | None, float | None]] = []

    async def send(request: Request) -> str:
        clock.advance(1.0)
        inner = Request(name="inner", timeout=None, clock=clock.clock)
        seen.append((inner, inner.time_left, inner.dispatch_info().time_left))
        return "ok"

    outer = Request(name="outer", timeout=2.5, clock=clock.clock)
    assert await orch.execute(outer, send) == "ok"
    inner, time_left, info_left = seen[0]
    assert inner.timeout is None  # what it was built with
    assert inner.deadline == pytest.approx(outer.deadline)
    assert seconds(time_left) == pytest.approx(1.5)  # was None
    assert info_left == pytest.approx(1.5)


def test_an_inner_request_without_timeout_reports_the_inherited_time_left_sync() -> None:
    # A blocking client (SyncMemcachedClient(timeout=None)) bounds its socket by time_left.
    clock = VirtualClock()
    seen: list[timedelta | None] = []

    def send(request: Request) -> str:
        clock.advance(0.25)
        seen.append(Request(timeout=None, clock=clock.clock).time_left)
        return "ok"

    RetryOrchestrator().execute_sync(Request(timeout=0.5, clock=clock.clock), send)
    assert seconds(seen[0]) == pytest.approx(0.25)  # was None: the socket blocked for good


def test_time_left_is_none_when_nothing_bounds_the_request() -> None:
    request = Request(timeout=None)
    assert request.time_left is None
    assert request.dispatch_info().time_left is None
    assert request.deadline == float("inf")


async def test_a_later_deadline_is_not_inherited_and_not_named() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    inner: list[Request] = []

    async def send(request: Request) -> str:
        inner.append(Request(timeout=1.0, clock=clock.clock))
        return "ok"

    await orch.execute(Request(timeout=60, clock=clock.clock), send)
    assert seconds(inner[0].time_left) == pytest.approx(1.0)
    assert "deadline_from" not in inner[0].error_context().extra


# -- item 10: nothing leaks once the dispatch is over ----------------------------------------


async def test_a_task_spawned_in_send_inherits_nothing_once_the_request_ended() -> None:
    orch = RetryOrchestrator()
    later = anyio.Event()
    during: list[float] = []
    after: list[float] = []

    async def child() -> None:
        during.append(seconds(Request(timeout=5).time_left))
        await later.wait()
        after.append(seconds(Request(timeout=5).time_left))

    async with anyio.create_task_group() as tg:

        async def send(request: Request) -> str:
            tg.start_soon(child)
            await anyio.sleep(0.01)  # the child runs while the request is being sent
            return "ok"

        outer = Request(timeout=1.0)
        await orch.execute(outer, send)
        ref = weakref.ref(outer)
        del outer
        # On Python 3.12 trio keeps the last exception this task was resumed with (the
        # Cancelled of anyio.sleep's own deadline scope, in send) until its next
        # checkpoint, and with its traceback the frames of send and execute.
        await anyio.lowlevel.checkpoint()
        gc.collect()
        assert ref() is None  # the child's context no longer keeps the request alive
        later.set()
    assert during[0] <= 1.0  # while the request ran, the child stayed within its deadline
    assert after[0] > 4.0  # was 0 s (the finished request's deadline had passed) or 1 s


def _leak_check(mark_context: contextvars.Context, clock: VirtualClock) -> float:
    clock.advance(10.0)  # the outer deadline is long past
    return seconds(mark_context.run(Request, timeout=5, clock=clock.clock).time_left)


async def test_a_context_copied_inside_execute_inherits_nothing_afterwards() -> None:
    clock = VirtualClock()
    copied: list[contextvars.Context] = []

    async def send(request: Request) -> str:
        copied.append(contextvars.copy_context())  # what a spawned task holds
        return "ok"

    await RetryOrchestrator(sleep=clock.sleep).execute(Request(timeout=1, clock=clock.clock), send)
    assert _leak_check(copied[0], clock) == pytest.approx(5.0)  # was 0


def test_a_context_copied_inside_execute_sync_inherits_nothing_afterwards() -> None:
    clock = VirtualClock()
    copied: list[contextvars.Context] = []

    def send(request: Request) -> str:
        copied.append(contextvars.copy_context())  # what asyncio.to_thread / a task holds
        return "ok"

    RetryOrchestrator().execute_sync(Request(timeout=1, clock=clock.clock), send)
    assert _leak_check(copied[0], clock) == pytest.approx(5.0)  # was 0


async def test_a_context_copied_inside_attempt_inherits_nothing_afterwards() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request = Request(timeout=1, clock=clock.clock)
    with orch.attempt(request):
        inside = Request(timeout=60, clock=clock.clock)
        copied = contextvars.copy_context()
    orch.succeed(request)
    assert inside.deadline == pytest.approx(request.deadline)
    assert _leak_check(copied, clock) == pytest.approx(5.0)  # was 0


# -- item 10: hedge passes its deadline in ---------------------------------------------------


async def test_a_request_made_inside_a_hedge_keeps_within_its_deadline() -> None:
    inner: list[Request] = []
    copied: list[contextvars.Context] = []

    async def send(request: Request, index: int) -> str:
        inner.append(Request(timeout=60))
        copied.append(contextvars.copy_context())
        return "ok"

    hedged = Request(name="hedged", idempotent=True, timeout=0.5)
    assert await RetryOrchestrator().hedge(hedged, send, HedgePolicy(2, delay=5)) == "ok"
    assert inner[0].deadline == pytest.approx(hedged.deadline, abs=0.05)  # was 60 s later
    assert seconds(inner[0].time_left) <= 0.5
    after = copied[0].run(Request, timeout=60)
    assert seconds(after.time_left) > 59  # the copy's dispatch is over: nothing inherited


async def test_every_hedge_copy_inherits_the_deadline() -> None:
    clock = VirtualClock()
    inner: list[Request] = []

    async def send(request: Request, index: int) -> str:
        inner.append(Request(timeout=60, clock=clock.clock))
        if index == 0:
            await anyio.sleep_forever()  # hedge 1 is sent and wins
        return "ok"

    hedged = Request(idempotent=True, timeout=2, clock=clock.clock)
    assert await RetryOrchestrator().hedge(hedged, send, HedgePolicy(2, delay=0.01)) == "ok"
    assert len(inner) == 2
    assert all(r.deadline == pytest.approx(hedged.deadline) for r in inner)


# -- item 7: an inner request cut by the outer deadline names it -----------------------------


async def test_an_inner_timeout_names_the_outer_request() -> None:
    clock = VirtualClock()
    slow = BestEffortRetryStrategy(backoff=lambda attempt: 1.0)
    orch = RetryOrchestrator(slow, sleep=clock.sleep)
    caught: list[TimeoutException] = []

    async def inner_send(request: Request) -> str:
        raise RetryableError(LOCKED)

    async def outer_send(request: Request) -> str:
        clock.advance(0.5)  # 0.25 s left: the inner's 1 s backoff cannot fit
        inner = Request(name="get-config", idempotent=True, timeout=None, clock=clock.clock)
        try:
            return await orch.execute(inner, inner_send)
        except TimeoutException as exc:
            caught.append(exc)
            return "fallback"

    outer = Request(name="checkout", idempotent=True, timeout=0.75, clock=clock.clock)
    assert await orch.execute(outer, outer_send) == "fallback"
    exc = caught[0]
    assert isinstance(exc, UnambiguousTimeoutException)
    assert exc.context is not None
    assert exc.context.timeout is None  # its own: none
    assert exc.context.extra["deadline_from"] == {
        "request_id": outer.id,
        "request_name": "checkout",
        "timeout_ms": 750.0,
    }
    shown = f'"deadline_from": {{"request_id": {outer.id}, "request_name": "checkout"'
    assert shown in str(exc)


def test_an_inner_timeout_names_the_outer_request_sync() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator()
    caught: list[TimeoutException] = []

    def inner_send(request: Request) -> str:
        clock.advance(2.0)  # blocked past the inherited deadline
        raise ConnectionResetError("peer closed")

    def outer_send(request: Request) -> str:
        inner = Request(name="inner", timeout=30, clock=clock.clock)
        try:
            return orch.execute_sync(inner, inner_send)
        except TimeoutException as exc:
            caught.append(exc)
            raise

    outer = Request(name="outer", timeout=1.5, clock=clock.clock)
    with pytest.raises(TimeoutException) as outer_exc:
        orch.execute_sync(outer, outer_send)
    context = caught[0].context
    assert context is not None
    assert context.timeout == timedelta(seconds=30)
    assert context.extra["deadline_from"]["request_name"] == "outer"
    assert context.extra["deadline_from"]["timeout_ms"] == 1500.0
    # the outer request's own context names no other
    assert outer_exc.value.context is not None
    assert "deadline_from" not in outer_exc.value.context.extra


def test_deadline_from_names_the_request_whose_timeout_set_it() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator()
    contexts: list[Any] = []

    def innermost(request: Request) -> str:
        contexts.append(Request(name="c", timeout=None, clock=clock.clock).error_context())
        return "ok"

    def middle(request: Request) -> str:
        return orch.execute_sync(Request(name="b", timeout=None, clock=clock.clock), innermost)

    orch.execute_sync(Request(name="a", timeout=1, clock=clock.clock), middle)
    assert contexts[0].extra["deadline_from"]["request_name"] == "a"


def test_deadline_from_keeps_the_callers_extra() -> None:
    clock = VirtualClock()
    contexts: list[Any] = []

    def send(request: Request) -> str:
        inner = Request(name="inner", timeout=None, clock=clock.clock)
        contexts.append(inner.error_context(extra={"status": 503}))
        return "ok"

    RetryOrchestrator().execute_sync(Request(name="outer", timeout=1, clock=clock.clock), send)
    assert contexts[0].extra["status"] == 503
    assert contexts[0].extra["deadline_from"]["request_name"] == "outer"


# -- item 9: an enclosing cancel scope bounds time_left and dispatch_info --------------------


async def test_an_enclosing_cancel_scope_bounds_time_left_and_dispatch_info() -> None:
    # anyio's scopes: trio's own on trio, anyio's on asyncio; both are seen.
    with anyio.move_on_after(0.5):
        own = Request(timeout=60)
        unbounded = Request(timeout=None)
        assert 0.3 < seconds(own.time_left) <= 0.5  # was 60
        assert 0.3 < seconds(unbounded.time_left) <= 0.5  # was None
        info = own.dispatch_info().time_left
        assert info is not None
        assert 0.3 < info <= 0.5
        assert own.deadline == pytest.approx(own.clock() + 60, abs=1)  # what the doors enforce
        await anyio.lowlevel.checkpoint()
    assert seconds(own.time_left) > 59
    assert unbounded.time_left is None


async def test_dispatch_info_inside_execute_sees_the_enclosing_scope() -> None:
    seen: list[float | None] = []

    async def send(request: Request) -> str:
        seen.append(request.dispatch_info().time_left)
        return "ok"

    with anyio.move_on_after(0.5):
        await RetryOrchestrator().execute(Request(timeout=60), send)
        await RetryOrchestrator().execute(Request(timeout=None), send)
    assert all(left is not None and 0.3 < left <= 0.5 for left in seen), seen


async def test_a_cancelled_scope_leaves_no_time() -> None:
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert Request(timeout=60).time_left == timedelta(0)
        assert Request(timeout=None).dispatch_info().time_left == 0.0
        await anyio.lowlevel.checkpoint()  # the scope catches its own cancellation


async def test_a_shielded_scope_hides_the_outer_deadline() -> None:
    with anyio.move_on_after(0.5), anyio.CancelScope(shield=True):
        assert seconds(Request(timeout=60).time_left) > 59
        await anyio.lowlevel.checkpoint()


async def test_the_scope_still_cuts_as_a_cancellation() -> None:
    # The scope is not copied into the request's deadline: its cut stays the scope's own.
    async def send(request: Request) -> str:
        await anyio.sleep_forever()
        return "never"

    with anyio.move_on_after(0.05) as scope:
        await RetryOrchestrator().execute(Request(timeout=None), send)
    assert scope.cancelled_caught


async def test_an_injected_clock_does_not_mix_with_the_loops() -> None:
    clock = VirtualClock()
    with anyio.move_on_after(0.5):
        assert seconds(Request(timeout=60, clock=clock.clock).time_left) == 60.0
        await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_move_on_after_bounds_time_left() -> None:
    import trio

    with trio.move_on_after(0.5):
        assert 0.3 < seconds(Request(timeout=None).time_left) <= 0.5
        await trio.lowlevel.checkpoint()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is 3.11+")
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_timeout_is_not_seen() -> None:
    # Documented: asyncio keeps asyncio.timeout()'s deadline where no one can read it.
    import asyncio

    async with asyncio.timeout(0.5):  # type: ignore[attr-defined,unused-ignore]
        assert seconds(Request(timeout=60).time_left) > 59
        assert Request(timeout=None).time_left is None
        await asyncio.sleep(0)


async def test_the_inner_requests_events_name_the_outer_request() -> None:
    """The operator joins an inner request's log lines to the outer's without traces:
    ``deadline_from`` is the outer request's ``request_id`` on each of the inner's events,
    and on none of the outer's own."""
    from sdkcore.testing import capture_retry_events

    clock = VirtualClock()
    orch = RetryOrchestrator(
        BestEffortRetryStrategy(backoff=lambda attempt: 0.1), sleep=clock.sleep
    )
    inner_ids: list[int] = []

    async def inner_send(request: Request) -> str:
        raise RetryableError(LOCKED)

    async def outer_send(request: Request) -> str:
        if not inner_ids:
            inner_ids.append(0)
            raise RetryableError(LOCKED)  # the outer's own retry: an event of its own
        inner = Request(name="get-config", idempotent=True, timeout=None, clock=clock.clock)
        inner_ids.append(inner.id)
        return await orch.execute(inner, inner_send)  # retried until the outer's deadline

    outer = Request(name="checkout", idempotent=True, timeout=1.0, clock=clock.clock)
    with capture_retry_events() as events, pytest.raises(TimeoutException):
        await orch.execute(outer, outer_send)
    inner_events = [e for e in events if e["request_id"] == inner_ids[1]]
    outer_events = [e for e in events if e["request_id"] == outer.id]
    assert len(inner_events) > 1
    assert outer_events
    assert all(e["deadline_from"] == outer.id for e in inner_events)
    assert all("deadline_from" not in e for e in outer_events)


@pytest.mark.parametrize("idempotent", [True, False])
async def test_an_inner_request_cut_at_its_inherited_deadline_is_reported_at_info(
    idempotent: bool,
) -> None:
    """Its wait, capped at the outer request's deadline, ends at the instant the outer
    request's own deadline cuts it, and the outer's cut wins: the inner request ends
    cancelled (TASK_CANCELLED), as README says. Its retry.cancelled was debug, so at info
    an operator read only the outer's "attempt 1 was cut in flight" and nothing named
    KV_LOCKED (an operator's review). Cut at the deadline it inherited, it is logged at
    info, with deadline_reached and the outer request's id."""
    orchestrator = RetryOrchestrator()

    async def inner_send(request: Request) -> None:
        raise RetryableError(LOCKED)

    async def outer_send(request: Request) -> None:
        inner = Request(name="inner", idempotent=idempotent, timeout=5)
        await orchestrator.execute(inner, inner_send)

    outer = Request(name="outer", idempotent=True, timeout=0.05)
    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException):
        await orchestrator.execute(outer, outer_send)
    # Which timer runs first at that instant is the loop's: the outer request's cut (the
    # inner one then ends cancelled) or, as seen on Python 3.10, the inner one's own
    # timeout. Either way its failures reach an info log, naming the outer request.
    (ending,) = [
        e
        for e in events
        if e["request_name"] == "inner" and e["event"] in ("retry.cancelled", "retry.timed_out")
    ]
    assert ending["log_level"] == "info"
    assert ending["deadline_from"] == outer.id
    assert ending["reason"] == "KV_LOCKED"
    if ending["event"] == "retry.cancelled":
        assert ending["deadline_reached"] is True
        assert ending["cancellation_reason"] == "TASK_CANCELLED"


async def test_an_inner_request_the_caller_cancels_early_stays_at_debug() -> None:
    """Only the cut at the inherited deadline is raised to info: a caller's cancellation
    with time left is the application's own doing (debug, as before)."""
    orchestrator = RetryOrchestrator()

    async def inner_send(request: Request) -> None:
        raise RetryableError(LOCKED)

    async def outer_send(request: Request) -> None:
        await orchestrator.execute(Request(name="inner", idempotent=True, timeout=5), inner_send)

    with capture_retry_events() as events:
        with anyio.move_on_after(0.05):
            await orchestrator.execute(
                Request(name="outer", idempotent=True, timeout=10), outer_send
            )
    (cancelled,) = [
        e for e in events if e["event"] == "retry.cancelled" and e["request_name"] == "inner"
    ]
    assert cancelled["log_level"] == "debug"
    assert "deadline_reached" not in cancelled
