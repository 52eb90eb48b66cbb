"""The retry budget, server hints and deadline propagation, wired into every door.

Fake clocks throughout; async tests run on asyncio and trio, the sync door with threads.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import anyio
import pytest

from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    CancellationReason,
    CircuitBreaker,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio

LOCKED = RetryReason.KV_LOCKED  # reached the server: a retry spends budget


def budget(clock: VirtualClock, reserve_per_sec: float = 0.0, percent: float = 0.0) -> RetryBudget:
    return RetryBudget(
        ttl=10, min_retries_per_sec=reserve_per_sec, retry_ratio=percent, clock=clock.clock
    )


class Failing:
    """A send failing ``fails`` times with ``reason`` (and ``hint``), then answering."""

    def __init__(self, fails: int, reason: RetryReason = LOCKED, hint: Any = None) -> None:
        self.fails, self.reason, self.hint, self.calls = fails, reason, hint, 0

    def _step(self) -> str:
        self.calls += 1
        if self.calls <= self.fails:
            raise RetryableError(self.reason, retry_after=self.hint) from OSError(
                f"attempt {self.calls}"
            )
        return "ok"

    async def __call__(self, request: Request) -> str:
        return self._step()

    def sync(self, request: Request) -> str:
        return self._step()


# -- the retry budget -----------------------------------------------------------------------


async def test_a_refused_withdrawal_ends_the_request_with_the_last_error() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(
        BestEffortRetryStrategy(), sleep=clock.sleep, retry_budget=budget(clock)
    )
    send = Failing(5)
    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await orch.execute(Request(idempotent=True, clock=clock.clock), send)
    assert send.calls == 1  # min 0 and percent 0: every withdrawal is refused
    context = info.value.context
    assert context is not None
    assert context.cancellation_reason is CancellationReason.RETRY_BUDGET_EXHAUSTED
    assert context.last_error == "OSError: attempt 1"
    assert isinstance(info.value.__cause__, OSError)
    assert "retry budget is exhausted" in info.value.message
    (refusal,) = [e for e in events if e["event"] == "retry.not_retried"]
    assert refusal["why"] == "retry_budget_exhausted"
    assert orch.requests_in_retry == 0


async def test_first_attempts_deposit_and_retries_withdraw() -> None:
    clock = VirtualClock()
    shared = budget(clock, percent=1.0)  # each first attempt pays for one retry
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep, retry_budget=shared)
    assert await orch.execute(Request(idempotent=True, clock=clock.clock), Failing(0)) == "ok"
    assert shared.balance == 1
    assert await orch.execute(Request(idempotent=True, clock=clock.clock), Failing(1)) == "ok"
    assert shared.balance == 1  # deposited one, withdrew one
    with pytest.raises(RequestCanceledException):
        await orch.execute(Request(idempotent=True, clock=clock.clock), Failing(3))
    assert shared.balance == 0


@pytest.mark.parametrize(
    "reason",
    [
        RetryReason.CIRCUIT_BREAKER_OPEN,
        RetryReason.SOCKET_NOT_AVAILABLE,
        RetryReason.NODE_NOT_AVAILABLE,
    ],
)
async def test_reasons_that_sent_nothing_do_not_withdraw(reason: RetryReason) -> None:
    clock = VirtualClock()
    shared = budget(clock)
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep, retry_budget=shared)
    send = Failing(3, reason)
    assert await orch.execute(Request(idempotent=True, clock=clock.clock), send) == "ok"
    assert send.calls == 4
    assert shared.refused == 0


async def test_the_hand_wired_loop_deposits_once_and_withdraws_per_retry() -> None:
    clock = VirtualClock()
    shared = budget(clock, percent=2.0)
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep, retry_budget=shared)
    request = Request(idempotent=True, clock=clock.clock)
    for _ in range(2):
        with orch.attempt(request):
            pass
        await orch.maybe_retry(request, LOCKED)
    with orch.attempt(request):
        pass
    with pytest.raises(RequestCanceledException):  # deposited 2, withdrew 2: empty
        await orch.maybe_retry(request, LOCKED)


def test_one_budget_is_shared_by_threads_on_the_sync_door() -> None:
    clock = VirtualClock()
    shared = budget(clock, reserve_per_sec=1.0)  # a reserve of 10 retries
    orch = RetryOrchestrator(BestEffortRetryStrategy(), retry_budget=shared)
    outcomes: list[str] = []
    lock = threading.Lock()

    def work() -> None:
        send = Failing(100)
        try:
            orch.execute_sync(
                Request(idempotent=True, timeout=None, clock=clock.clock),
                send.sync,
                sleep=lambda seconds: None,
            )
        except RequestCanceledException as exc:
            why = exc.context.cancellation_reason if exc.context is not None else None
            with lock:
                outcomes.append("none" if why is None else why.name)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert outcomes == ["RETRY_BUDGET_EXHAUSTED"] * 8
    assert shared.balance == 0
    assert orch.requests_in_retry == 0


def test_a_retry_budget_must_look_like_one() -> None:
    with pytest.raises(TypeError, match="retry_budget"):
        RetryOrchestrator(retry_budget=object())  # type: ignore[arg-type]


# -- server hints -----------------------------------------------------------------------------


async def test_best_effort_waits_the_longer_of_its_backoff_and_the_hint() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(idempotent=True, timeout=10, clock=clock.clock)
    assert await orch.execute(request, Failing(2, hint=timedelta(milliseconds=300))) == "ok"
    delays = [a.delay for a in request.attempts]
    assert delays == [timedelta(milliseconds=300)] * 2  # the hint beats 1 ms and 2 ms
    assert clock.now - 1000.0 == pytest.approx(0.6)


async def test_a_backoff_longer_than_the_hint_wins() -> None:
    clock = VirtualClock()
    strategy = BestEffortRetryStrategy(backoff=lambda n: 0.5)
    orch = RetryOrchestrator(strategy, sleep=clock.sleep)
    request = Request(idempotent=True, timeout=10, clock=clock.clock)
    assert await orch.execute(request, Failing(1, hint=0.1)) == "ok"
    assert request.attempts[0].delay == timedelta(seconds=0.5)


async def test_a_hint_past_the_deadline_times_out_at_once_naming_it() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.set", idempotent=False, timeout=1.0, clock=clock.clock)
    with capture_retry_events() as events, pytest.raises(TimeoutException) as info:
        await orch.execute(request, Failing(1, hint=30))
    # KV LOCKED proves the write was not applied: unambiguous, though not idempotent
    assert isinstance(info.value, UnambiguousTimeoutException)
    assert "30.000 s" in info.value.message
    assert clock.now == 1000.0  # no silent sleep until the deadline
    (timed_out,) = [e for e in events if e["event"] == "retry.timed_out"]
    assert timed_out["retry_after_ms"] == 30000.0
    assert timed_out["hinted_by"] == "server"


async def test_an_open_breakers_refusal_past_the_deadline_says_the_breaker_asked() -> None:
    """An OPEN breaker's sleep window past the deadline ends the request at once as a
    timeout: the event says the breaker asked for the wait, not the server (an operator
    read "retry.timed_out" as a slow server)."""
    clock = VirtualClock()
    breaker = CircuitBreaker(name="10.0.0.1:11210", volume_threshold=1, clock=clock.clock)
    breaker.record_failure(ConnectionResetError("down"))
    orch = RetryOrchestrator(sleep=clock.sleep)

    async def send(request: Request) -> str:
        with breaker.guard():
            return "never"

    request = Request(name="kv.get", idempotent=True, timeout=1.0, clock=clock.clock)
    with capture_retry_events() as events, pytest.raises(TimeoutException):
        await orch.execute(request, send)
    (timed_out,) = [e for e in events if e["event"] == "retry.timed_out"]
    assert timed_out["hinted_by"] == "circuit_breaker"
    assert timed_out["reason"] == "CIRCUIT_BREAKER_OPEN"
    assert timed_out["retry_after_ms"] > 1000.0


async def test_maybe_retry_takes_the_hint_from_the_cause() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(idempotent=True, timeout=10, clock=clock.clock)
    failure = RetryableError(LOCKED, retry_after=0.25)
    assert await orch.maybe_retry(request, LOCKED, cause=failure) == timedelta(seconds=0.25)
    assert await orch.maybe_retry(request, LOCKED, retry_after=0.5) == timedelta(seconds=0.5)


def test_the_sync_door_honours_hints() -> None:
    clock = VirtualClock()
    slept: list[float] = []
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    request = Request(idempotent=True, timeout=5, clock=clock.clock)
    assert orch.execute_sync(request, Failing(1, hint=0.2).sync, sleep=slept.append) == "ok"
    assert slept == [0.2]
    with pytest.raises(UnambiguousTimeoutException, match=r"9\.000 s"):
        orch.execute_sync(
            Request(idempotent=True, timeout=5, clock=clock.clock),
            Failing(1, hint=9).sync,
            sleep=slept.append,
        )


def test_fail_fast_ignores_hints() -> None:
    from sdkcore._strategy import FailFastRetryStrategy

    orch = RetryOrchestrator(FailFastRetryStrategy())
    with pytest.raises(RequestCanceledException):
        orch.execute_sync(Request(idempotent=True), Failing(1, hint=0.1).sync)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "soon", True])
def test_a_bad_hint_is_a_clear_error(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"RetryableError\.retry_after"):
        RetryableError(LOCKED, retry_after=bad)


# -- deadline propagation ------------------------------------------------------------------


async def test_a_request_made_inside_send_never_outlives_the_outer_deadline() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    inner: list[Request] = []

    async def send(request: Request) -> str:
        clock.advance(1.0)
        inner.append(Request(name="inner", timeout=60, clock=clock.clock))
        return "ok"

    outer = Request(name="outer", timeout=2.5, clock=clock.clock)
    assert await orch.execute(outer, send) == "ok"
    assert inner[0].deadline == pytest.approx(outer.deadline)  # 1.5 s left, not 60
    assert Request(timeout=60, clock=clock.clock).deadline == pytest.approx(clock.now + 60)


def test_deadline_in_on_the_sync_door() -> None:
    clock = VirtualClock()
    seen: list[float | None] = []

    def send(request: Request) -> str:
        seen.append(Request(timeout=None, clock=clock.clock).dispatch_info().time_left)
        return "ok"

    RetryOrchestrator().execute_sync(Request(timeout=0.75, clock=clock.clock), send)
    assert seen == [pytest.approx(0.75)]


async def test_dispatch_info_gives_the_time_left_and_the_attempt_number() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.1), sleep=clock.sleep)
    seen: list[tuple[int, float | None]] = []

    async def send(request: Request) -> str:
        info = request.dispatch_info()
        seen.append((info.attempt, info.time_left))
        if info.attempt < 3:
            raise RetryableError(LOCKED)
        return "ok"

    assert await orch.execute(Request(idempotent=True, timeout=1, clock=clock.clock), send)
    assert seen == [(1, pytest.approx(1.0)), (2, pytest.approx(0.9)), (3, pytest.approx(0.8))]  # type: ignore[comparison-overlap]  # pytest.approx
    assert Request(timeout=None).dispatch_info().time_left is None


async def test_dispatch_info_numbers_every_door_s_attempts() -> None:
    """A hand-wired loop that tries again without ``maybe_retry`` (``attempt()`` books the
    earlier block when the next opens) numbers its attempts 1, 2, 3 (it said 1, 1, 1), and a
    hedge's copies are numbered as they go out, before any fails."""
    from sdkcore import HedgePolicy

    orch = RetryOrchestrator()
    request = Request(idempotent=True, timeout=1.0)
    seen = []
    for _ in range(3):
        with orch.attempt(request):
            seen.append(request.dispatch_info().attempt)
    assert seen == [1, 2, 3]

    copies: list[int] = []

    async def copy(request: Request, index: int) -> str:
        copies.append(request.dispatch_info().attempt)
        await anyio.sleep(0.05 if index == 0 else 0.0)
        return "ok"

    policy = HedgePolicy(2, delay=timedelta(milliseconds=1))
    assert await orch.hedge(Request(idempotent=True, timeout=1.0), copy, policy) == "ok"
    assert copies == [1, 2]


async def test_the_outer_request_is_forgotten_once_execute_returns() -> None:
    orch = RetryOrchestrator()

    async def send(request: Request) -> str:
        return "ok"

    await orch.execute(Request(timeout=0.01), send)
    left = Request(timeout=60).time_left
    assert left is not None
    assert left > timedelta(seconds=59)


# -- hedges draw on the same budget --------------------------------------------------------


async def test_every_hedge_after_the_first_withdraws_from_the_budget() -> None:
    from sdkcore import HedgePolicy

    clock = VirtualClock()
    shared = budget(clock, percent=1.0)  # the first attempt pays for exactly one hedge
    orch = RetryOrchestrator(retry_budget=shared)
    sent: list[int] = []

    async def send(request: Request, index: int) -> str:
        sent.append(index)
        raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)

    request = Request(idempotent=True, timeout=5)
    with pytest.raises(RequestCanceledException) as info:
        await orch.hedge(request, send, HedgePolicy(4, delay=0))
    assert sorted(sent) == [0, 1]  # hedges 2 and 3 were not paid for
    assert shared.balance == 0
    context = info.value.context
    assert context is not None
    assert context.cancellation_reason is CancellationReason.RETRY_BUDGET_EXHAUSTED
    assert context.extra["hedge_stopped_by"] == "retry_budget"
    assert "retry budget refused more hedges" in info.value.message


async def test_a_hedge_stopped_by_a_named_budget_names_it_as_execute_does() -> None:
    """The operator reads which budget refused: in the message, the context and the event
    (execute's refusal named it; the hedge's said only "the retry budget")."""
    from sdkcore import HedgePolicy

    clock = VirtualClock()
    shared = RetryBudget(
        ttl=10, min_retries_per_sec=0.0, retry_ratio=1.0, clock=clock.clock, name="cluster-A"
    )
    orch = RetryOrchestrator(retry_budget=shared)

    async def send(request: Request, index: int) -> str:
        raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)

    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await orch.hedge(Request(idempotent=True, timeout=5), send, HedgePolicy(4, delay=0))
    assert "the retry budget 'cluster-A' refused more hedges" in info.value.message
    context = info.value.context
    assert context is not None
    assert context.extra["budget"] == "cluster-A"
    (refusal,) = [e for e in events if e["event"] == "retry.not_retried"]
    assert refusal["why"] == "retry_budget_exhausted"
    assert refusal["budget"] == "cluster-A"


@pytest.mark.parametrize("door", ["execute", "execute_sync"])
async def test_a_paid_retry_refused_by_an_open_breaker_is_refunded(door: str) -> None:
    """A retry after an attempt that reached the server withdraws; the breaker, open
    meanwhile, refuses it before anything is written. It added no load, yet it was never
    refunded: an outage (every retry refused) emptied the budget for its ttl without a
    retry reaching the server. A hedge's refused copy was refunded already."""
    clock = VirtualClock()
    budget = RetryBudget(ttl=10, min_retries_per_sec=10, retry_ratio=0.0, clock=clock.clock)
    breaker = CircuitBreaker(volume_threshold=1, sleep_window=60.0, clock=clock.clock)
    orch = RetryOrchestrator(sleep=clock.sleep, retry_budget=budget)
    before = budget.balance

    def attempt(request: Request) -> str:
        try:
            with breaker.guard():  # OPEN after the first failure: nothing more is written
                raise ConnectionResetError("reset after the write")
        except ConnectionResetError as exc:
            raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT) from exc

    async def send(request: Request) -> str:
        return attempt(request)

    request = Request(name="kv.get", idempotent=True, timeout=1.0, clock=clock.clock)

    async def run() -> None:
        if door == "execute":
            await orch.execute(request, send)
        else:
            orch.execute_sync(request, attempt, sleep=clock.sleep_sync)

    with pytest.raises(TimeoutException):
        await run()
    effects = [a.effect for a in request.attempts]
    assert effects[0] is AttemptEffect.MAYBE_APPLIED
    assert set(effects[1:]) == {AttemptEffect.NOT_SENT}
    assert budget.balance == before  # the one paid retry never went out: given back
