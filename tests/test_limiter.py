"""ConcurrencyLimiter: a fixed bulkhead per endpoint (rfc/0009, "Concurrency limiter").

``guard()`` refuses at once when every permit is held; ``acquire()`` waits in a FIFO
queue of at most ``max_queued`` callers, never past the dispatching request's
deadline, and a caller that leaves the queue (cancelled, deadline) never takes a
permit with it nor holds up the ones behind. Refusals are RetryableErrors raised
before anything is sent. Async tests run on asyncio and trio.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from bad_numbers import judge
from fuzz_kit import wait_until

from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    HedgePolicy,
    Request,
    RequestState,
    RetryableError,
    RetryAction,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore._limiter import ConcurrencyLimiter
from sdkcore._permits import LIMITED, MAX_PERMITS, MAX_SLACK
from sdkcore.testing import VirtualClock


def refusal(call: Callable[[], Any]) -> RetryableError:
    with pytest.raises(RetryableError) as caught:
        call()
    return caught.value


def enter_guard(limiter: ConcurrencyLimiter) -> None:
    with limiter.guard():
        pytest.fail("a refused block must not run")


# -- the fixed limit --------------------------------------------------------------------


def test_defaults_and_properties() -> None:
    limiter = ConcurrencyLimiter(3)
    assert (limiter.limit, limiter.in_flight, limiter.queued, limiter.max_queued) == (3, 0, 0, 0)
    assert limiter.name == ""
    named = ConcurrencyLimiter(25, max_queued=10, name="10.0.0.1:11210")
    assert repr(named) == (
        "<ConcurrencyLimiter '10.0.0.1:11210' limit=25 in_flight=0 queued=0 max_queued=10>"
    )


def test_guard_admits_up_to_the_limit_then_refuses_before_anything_is_sent() -> None:
    limiter = ConcurrencyLimiter(2, name="node:11210")
    with limiter.guard(), limiter.guard():
        assert limiter.in_flight == 2
        error = refusal(lambda: enter_guard(limiter))
        assert limiter.in_flight == 2  # the refusal took nothing
    assert limiter.in_flight == 0
    assert error.reason is LIMITED
    assert error.effect is AttemptEffect.NOT_SENT
    assert error.retry_after is None  # a fixed limit measures nothing to hint with
    assert "node:11210" in str(error)
    assert "nothing was sent" in str(error)
    assert "2 in flight, limit 2" in str(error)


def test_the_refusal_reason_allows_retrying_a_non_idempotent_request() -> None:
    # RFC 0049 flags of the reason (CONCURRENCY_LIMITED once _reason.py has it; until then
    # SERVICE_NOT_AVAILABLE, which has the same flags): never written, not always retried
    assert LIMITED.allows_non_idempotent_retry is True
    assert LIMITED.always_retry is False
    assert LIMITED.after_dispatch is False
    assert LIMITED.name in {"CONCURRENCY_LIMITED", "SERVICE_NOT_AVAILABLE"}


def test_guard_is_one_shared_object_and_gives_the_permit_back_however_the_block_ends() -> None:
    limiter = ConcurrencyLimiter(1)
    assert limiter.guard() is limiter.guard()  # nothing per dispatch: no allocation
    with pytest.raises(KeyError), limiter.guard():
        raise KeyError("user code")
    assert limiter.in_flight == 0
    with pytest.raises(KeyboardInterrupt), limiter.guard():
        raise KeyboardInterrupt
    assert limiter.in_flight == 0
    with pytest.raises(SystemExit), limiter.guard():
        raise SystemExit(3)
    assert limiter.in_flight == 0
    with limiter.guard():
        pass
    assert limiter.in_flight == 0


# -- bad input ----------------------------------------------------------------------------

BAD: list[Any] = [
    float("inf"),
    float("-inf"),
    float("nan"),
    10**400,
    -(10**400),
    10**5000,
    True,
    False,
    -1,
    0.5,
    2.0,
    "3",
    None,
]
BAD_IDS = ["inf", "-inf", "nan", "1e400", "-1e400", "1e5000", "True", "False", "-1", "0.5", "2.0"]
BAD_IDS += ["str", "None"]


@pytest.mark.parametrize("value", BAD, ids=BAD_IDS)
@pytest.mark.parametrize(
    ("field", "build"),
    [
        ("ConcurrencyLimiter(limit)", lambda v: ConcurrencyLimiter(v)),
        ("ConcurrencyLimiter(max_queued)", lambda v: ConcurrencyLimiter(1, max_queued=v)),
        ("ConcurrencyLimiter(name)", lambda v: ConcurrencyLimiter(1, name=v)),
    ],
    ids=lambda f: f if isinstance(f, str) else "",
)
def test_bad_input_names_the_field(field: str, build: Callable[[Any], object], value: Any) -> None:
    judge(build, value, named=field)
    if field.endswith("(limit)") or field.endswith("(max_queued)"):
        with pytest.raises((TypeError, ValueError)):
            build(value)


def test_bounds_are_inclusive_and_the_message_says_what_is_allowed() -> None:
    assert ConcurrencyLimiter(MAX_PERMITS, max_queued=MAX_PERMITS).limit == MAX_PERMITS
    assert ConcurrencyLimiter(1, max_queued=0).max_queued == 0
    with pytest.raises(ValueError, match=r"ConcurrencyLimiter\(limit\) must be an int from 1 to"):
        ConcurrencyLimiter(0)
    with pytest.raises(ValueError, match=r"ConcurrencyLimiter\(max_queued\) must be an int from 0"):
        ConcurrencyLimiter(1, max_queued=-1)
    with pytest.raises(TypeError, match=r"ConcurrencyLimiter\(limit\) .* got True \(bool\)"):
        ConcurrencyLimiter(True)
    with pytest.raises(ValueError, match="ConcurrencyLimiter"):
        ConcurrencyLimiter(MAX_PERMITS + 1)


# -- acquire(): the queue ---------------------------------------------------------------


@pytest.mark.anyio
async def test_acquire_without_a_queue_refuses_at_once() -> None:
    limiter = ConcurrencyLimiter(1)
    async with limiter.acquire():
        with pytest.raises(RetryableError) as caught:
            async with limiter.acquire():
                pytest.fail("refused")
        assert "max_queued 0" in str(caught.value)
        assert caught.value.effect is AttemptEffect.NOT_SENT
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_waiters_get_their_permit_in_arrival_order() -> None:
    limiter = ConcurrencyLimiter(1, max_queued=8)
    order: list[int] = []
    release = anyio.Event()

    async def holder() -> None:
        async with limiter.acquire():
            await release.wait()

    async def waiter(i: int) -> None:
        async with limiter.acquire():
            order.append(i)
            await anyio.lowlevel.checkpoint()  # hold it across a turn of the loop

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_until(lambda: limiter.in_flight == 1)
        for i in range(6):
            tg.start_soon(waiter, i)
            await wait_until(lambda i=i: limiter.queued == i + 1)  # type: ignore[misc]
        assert limiter.in_flight == 1
        release.set()
    assert order == [0, 1, 2, 3, 4, 5]
    assert (limiter.in_flight, limiter.queued) == (0, 0)


@pytest.mark.anyio
async def test_a_full_queue_refuses_and_guard_never_barges_past_it() -> None:
    limiter = ConcurrencyLimiter(1, max_queued=1, name="n1")
    release = anyio.Event()
    got: list[str] = []

    async def holder() -> None:
        async with limiter.acquire():
            await release.wait()

    async def queued() -> None:
        async with limiter.acquire():
            got.append("queued")

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_until(lambda: limiter.in_flight == 1)
        tg.start_soon(queued)
        await wait_until(lambda: limiter.queued == 1)
        with pytest.raises(RetryableError, match=r"1 queued \(max_queued 1\)"):
            async with limiter.acquire():
                pytest.fail("the queue is full")
        error = refusal(lambda: enter_guard(limiter))
        assert "1 in flight, limit 1" in str(error)
        release.set()
        # the holder's permit goes straight to the queued caller: the count never drops,
        # so a guard() in between finds no free permit
    assert got == ["queued"]
    assert (limiter.in_flight, limiter.queued) == (0, 0)


@pytest.mark.anyio
async def test_a_cancelled_waiter_leaves_the_queue_and_takes_nothing() -> None:
    limiter = ConcurrencyLimiter(1, max_queued=4)
    release = anyio.Event()
    got: list[int] = []

    async def holder() -> None:
        async with limiter.acquire():
            await release.wait()

    async def waiter(i: int, scope: anyio.CancelScope | None = None) -> None:
        if scope is None:
            async with limiter.acquire():
                got.append(i)
            return
        with scope:
            async with limiter.acquire():
                got.append(i)

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_until(lambda: limiter.in_flight == 1)
        tg.start_soon(waiter, 1, scope)
        await wait_until(lambda: limiter.queued == 1)
        tg.start_soon(waiter, 2)
        await wait_until(lambda: limiter.queued == 2)
        scope.cancel()  # the first in line gives up
        await wait_until(lambda: limiter.queued == 1)
        assert limiter.in_flight == 1
        release.set()
    assert got == [2]  # the one behind was not held up
    assert (limiter.in_flight, limiter.queued) == (0, 0)


@pytest.mark.anyio
async def test_a_waiter_cancelled_as_its_permit_arrives_passes_it_on() -> None:
    # the holder ends its block and, in the same step, the first waiter is cancelled:
    # the permit was handed to it, and it goes on to the next in line
    limiter = ConcurrencyLimiter(1, max_queued=4)
    got: list[int] = []
    scope = anyio.CancelScope()
    holding = anyio.Event()
    done = anyio.Event()

    async def holder() -> None:
        async with limiter.acquire():
            holding.set()
            await done.wait()
        scope.cancel()  # no await in between: the permit is already the waiter's

    async def first() -> None:
        with scope:
            async with limiter.acquire():
                got.append(1)

    async def second() -> None:
        async with limiter.acquire():
            got.append(2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await holding.wait()
        tg.start_soon(first)
        await wait_until(lambda: limiter.queued == 1)
        tg.start_soon(second)
        await wait_until(lambda: limiter.queued == 2)
        done.set()
    # the first waiter takes one checkpoint with the permit before its block runs: the
    # cancel cuts it there (on trio its task was already rescheduled; anyio's scope on
    # asyncio cancels a task a turn later), and the permit goes on to the second
    assert got == [2]
    assert (limiter.in_flight, limiter.queued) == (0, 0)


def test_an_asyncio_task_cancelled_as_its_permit_arrives_passes_it_on() -> None:
    # Task.cancel() on a task whose wait is already over: it resumes with CancelledError
    # while holding the permit it was handed; the permit goes to the next in line
    import asyncio

    limiter = ConcurrencyLimiter(1, max_queued=4)
    got: list[int] = []

    async def waiter(i: int) -> None:
        async with limiter.acquire():
            got.append(i)

    async def main() -> None:
        first = second = None
        with limiter.guard():
            first = asyncio.ensure_future(waiter(1))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(waiter(2))
            await asyncio.sleep(0)
            assert limiter.queued == 2
        first.cancel()  # the permit is the first waiter's already
        await asyncio.gather(first, second, return_exceptions=True)
        assert first.cancelled()

    asyncio.run(main())
    assert got == [2]
    assert (limiter.in_flight, limiter.queued) == (0, 0)


@pytest.mark.anyio
async def test_an_exception_or_cancellation_inside_the_block_gives_the_permit_back() -> None:
    limiter = ConcurrencyLimiter(1, max_queued=1)
    with pytest.raises(KeyError):
        async with limiter.acquire():
            raise KeyError("user code")
    assert limiter.in_flight == 0
    with anyio.move_on_after(0.01):
        async with limiter.acquire():
            await anyio.sleep(10)
    assert limiter.in_flight == 0
    with pytest.raises(KeyboardInterrupt):
        async with limiter.acquire():
            raise KeyboardInterrupt
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_outside_a_request_the_wait_is_bounded_by_the_callers_scope_only() -> None:
    limiter = ConcurrencyLimiter(1, max_queued=1)
    with limiter.guard():
        with anyio.move_on_after(0.05) as scope:
            async with limiter.acquire():
                pytest.fail("never granted")
        assert scope.cancelled_caught  # the caller's own cancellation, not a refusal
        assert (limiter.in_flight, limiter.queued) == (1, 0)
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_a_permit_given_back_on_another_thread_wakes_the_waiter() -> None:
    limiter = ConcurrencyLimiter(1, max_queued=1)
    entered = threading.Event()
    leave = threading.Event()

    def hold_in_a_thread() -> None:
        with limiter.guard():
            entered.set()
            leave.wait(5)

    thread = threading.Thread(target=hold_in_a_thread)
    thread.start()
    try:
        assert await anyio.to_thread.run_sync(entered.wait, 5)

        async def later() -> None:
            await wait_until(lambda: limiter.queued == 1)
            leave.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            with anyio.fail_after(5):
                async with limiter.acquire():
                    assert limiter.in_flight == 1
    finally:
        leave.set()
        thread.join(5)
    assert (limiter.in_flight, limiter.queued) == (0, 0)


# -- inside the doors: the request's deadline bounds the queue ------------------------------


@contextlib.asynccontextmanager
async def only_permit_held(limiter: ConcurrencyLimiter) -> AsyncIterator[None]:
    """The limiter's one permit held by another task until the block ends."""
    release = anyio.Event()

    async def holder() -> None:
        async with limiter.acquire():
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_until(lambda: limiter.in_flight == 1)
        try:
            yield
        finally:
            release.set()


def queueing_send(limiter: ConcurrencyLimiter) -> Callable[[Request], Any]:
    """A send that queues for a permit it must never be granted."""

    async def send(request: Request) -> bytes:
        async with limiter.acquire():
            pytest.fail("never granted")
        return b""

    return send


@pytest.mark.anyio
async def test_queueing_never_outlasts_the_request_and_the_timeout_is_unambiguous() -> None:
    # A non-idempotent request queues behind a permit held for 5 s. Its 0.2 s deadline
    # ends the wait just before the door's own deadline scope would cut it, as a refusal
    # (nothing sent): the timeout is unambiguous, and the queue is left clean.
    limiter = ConcurrencyLimiter(1, max_queued=4, name="kv")
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    async with only_permit_held(limiter):
        request = Request(name="kv.set", idempotent=False, timeout=0.2)
        began = time.monotonic()
        with pytest.raises(UnambiguousTimeoutException) as caught:
            await orchestrator.execute(request, queueing_send(limiter))
        waited = time.monotonic() - began
        assert limiter.queued == 0
    assert 0.2 - MAX_SLACK - 0.01 <= waited < 1.0  # ends at the deadline, not at the release
    assert not request.maybe_applied
    assert caught.value.context is not None
    assert caught.value.context.reason is LIMITED
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_no_time_left_to_queue_is_refused_at_once() -> None:
    clock = VirtualClock()
    limiter = ConcurrencyLimiter(1, max_queued=4)
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    tries: list[float] = []

    async def send(request: Request) -> bytes:
        tries.append(clock.now)
        clock.advance(0.5)  # the attempt began with 0.5 s left; now nothing is
        async with limiter.acquire():
            pytest.fail("never granted")
        return b""

    with limiter.guard():
        request = Request(name="kv.get", idempotent=True, timeout=0.5, clock=clock.clock)
        with pytest.raises(UnambiguousTimeoutException):
            await orchestrator.execute(request, send)
    assert tries == [1000.0]
    assert (limiter.in_flight, limiter.queued) == (0, 0)


@pytest.mark.anyio
async def test_execute_retries_a_refused_non_idempotent_request_until_a_permit_frees() -> None:
    limiter = ConcurrencyLimiter(1, name="kv")
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    sent: list[str] = []
    release = anyio.Event()

    async def holder() -> None:
        async with limiter.acquire():
            await release.wait()

    async def send(request: Request) -> bytes:
        with limiter.guard():  # no queue: refused while the holder has the permit
            sent.append(request.name)
            return b"stored"

    async def free_later() -> None:
        await anyio.sleep(0.05)
        release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await wait_until(lambda: limiter.in_flight == 1)
        tg.start_soon(free_later)
        request = Request(name="kv.set", idempotent=False, timeout=5.0)
        assert await orchestrator.execute(request, send) == b"stored"
    assert sent == ["kv.set"]  # refusals sent nothing
    assert request.retry_attempts >= 1
    assert set(request.retry_reasons) == {LIMITED}
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_a_hedge_copy_the_limiter_refuses_is_not_sent_and_costs_no_budget() -> None:
    # one permit, held by copy 0 while it waits for its slow answer: copies 1 and 2 are
    # refused (nothing sent), the budget gets their withdrawals back, copy 0 wins
    limiter = ConcurrencyLimiter(1, name="replica")
    budget = RetryBudget()
    orchestrator = RetryOrchestrator(retry_budget=budget)
    sent: list[int] = []

    async def send(request: Request, index: int) -> bytes:
        with limiter.guard():
            sent.append(index)
            await anyio.sleep(0.1)
            return b"value"

    before = budget.balance
    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    result = await orchestrator.hedge(request, send, HedgePolicy(3, delay=0.01))
    assert result == b"value"
    assert sent == [0]
    assert budget.balance == before
    # the failed copies (the winner is not a failed attempt): both refused, not sent
    assert [a.effect for a in request.attempts] == [AttemptEffect.NOT_SENT] * 2
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_a_hand_wired_loop_retries_a_refusal() -> None:
    clock = VirtualClock()
    limiter = ConcurrencyLimiter(1)
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.set", idempotent=False, timeout=2.5, clock=clock.clock)
    holder = limiter.guard()
    holder.__enter__()
    tries = 0
    while True:
        tries += 1
        if tries == 3:
            holder.__exit__(None, None, None)  # the permit frees before the third try
        try:
            with orchestrator.attempt(request), limiter.guard():
                reply = b"stored"
        except RetryableError as failure:
            await orchestrator.maybe_retry(request, failure.reason, cause=failure)
            continue
        orchestrator.succeed(request)
        break
    assert reply == b"stored"
    assert request.retry_attempts == 2
    assert set(request.retry_reasons) == {LIMITED}
    assert not request.maybe_applied
    assert limiter.in_flight == 0


def test_execute_sync_from_32_threads_shares_one_limit() -> None:
    limiter = ConcurrencyLimiter(3, name="kv")
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    lock = threading.Lock()
    inside = [0, 0]  # now, most ever
    barrier = threading.Barrier(32)
    results: list[bytes] = []

    def send(request: Request) -> bytes:
        with limiter.guard():
            with lock:
                inside[0] += 1
                inside[1] = max(inside[1], inside[0])
            time.sleep(0.002)
            with lock:
                inside[0] -= 1
            return b"ok"

    def work() -> None:
        barrier.wait()
        for _ in range(5):
            reply = orchestrator.execute_sync(Request(name="kv.get", timeout=30.0), send)
            with lock:
                results.append(reply)

    threads = [threading.Thread(target=work) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [b"ok"] * 160
    assert inside[1] <= 3
    assert (limiter.in_flight, limiter.queued) == (0, 0)


def test_guard_from_32_threads_never_lets_more_than_the_limit_through() -> None:
    limiter = ConcurrencyLimiter(4)
    lock = threading.Lock()
    inside = [0, 0]
    counts = [0, 0]  # admitted, refused
    barrier = threading.Barrier(32)

    def work() -> None:
        barrier.wait()
        for _ in range(200):
            try:
                with limiter.guard():
                    with lock:
                        inside[0] += 1
                        inside[1] = max(inside[1], inside[0])
                        counts[0] += 1
                    time.sleep(0)
                    with lock:
                        inside[0] -= 1
            except RetryableError:
                with lock:
                    counts[1] += 1

    threads = [threading.Thread(target=work) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(counts) == 32 * 200
    assert counts[0] > 0
    assert inside[1] <= 4
    assert limiter.in_flight == 0


@pytest.mark.anyio
async def test_tasks_queued_behind_8_threads_all_get_through() -> None:
    # permits taken and given back on threads while tasks queue for them on the loop:
    # a permit returned as a task joins the line is never left free while it waits
    limiter = ConcurrencyLimiter(2, max_queued=64)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            try:
                with limiter.guard():
                    time.sleep(0.0002)
            except RetryableError:
                time.sleep(0.0001)

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    got = [0]
    try:

        async def task() -> None:
            for _ in range(20):
                async with limiter.acquire():
                    got[0] += 1

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(task)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert got[0] == 16 * 20
    assert (limiter.in_flight, limiter.queued) == (0, 0)


# -- helpers ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("door", ["execute", "attempt"])
async def test_a_wait_cut_by_the_requests_own_deadline_is_not_ambiguous(
    monkeypatch: pytest.MonkeyPatch, door: str
) -> None:
    """A loop too late for the queue's margin: the door's deadline scope cuts the wait
    first. Nothing was sent, so a non-idempotent request's timeout is unambiguous."""
    from sdkcore import _permits

    monkeypatch.setattr(_permits, "SLACK", -0.05)  # the queue would give up after the door
    monkeypatch.setattr(_permits, "MAX_SLACK", -0.05)
    limiter = ConcurrencyLimiter(1, max_queued=4, name="kv")
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    send = queueing_send(limiter)
    with anyio.fail_after(10):
        async with only_permit_held(limiter):
            request = Request(name="kv.set", idempotent=False, timeout=0.1)

            async def one_attempt() -> None:
                if door == "execute":
                    await orchestrator.execute(request, send)
                else:  # a hand-wired loop's attempt
                    with orchestrator.attempt(request):
                        await send(request)

            with pytest.raises(UnambiguousTimeoutException):
                await one_attempt()
            assert limiter.queued == 0
    assert not request.maybe_applied
    assert [(a.reason, a.effect) for a in request.attempts] == [(LIMITED, AttemptEffect.NOT_SENT)]


@pytest.mark.anyio
async def test_an_enclosing_scope_cuts_a_queued_wait_as_its_cancellation() -> None:
    """The queue's margin came from the request's time left with the enclosing scope's
    deadline in it: at the scope's time the wait ended as a CONCURRENCY_LIMITED refusal,
    and a strategy that does not retry that reason (README's shedding recipe) ended the
    request with it, escaping ``move_on_after`` though the request had seconds left."""

    class Shed(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            if reason is RetryReason.CONCURRENCY_LIMITED:
                return RetryAction.no_retry()
            return super().decide(request, reason)

    limiter = ConcurrencyLimiter(1, max_queued=8)
    held, release = anyio.Event(), anyio.Event()
    sent: list[str] = []

    async def holder() -> None:
        async with limiter.acquire():
            held.set()
            await release.wait()

    async def send(request: Request) -> str:
        async with limiter.acquire():
            sent.append(request.name)
            return "ok"

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await held.wait()
            request = Request(name="r", timeout=5.0, retry_strategy=Shed())
            with anyio.move_on_after(0.2) as scope:
                await RetryOrchestrator().execute(request, send)
            release.set()
    assert scope.cancelled_caught  # the scope's cancellation, caught by it: nothing escaped
    assert sent == []
    assert limiter.queued == 0
    assert limiter.in_flight == 0
    assert request.state is RequestState.CANCELLED
