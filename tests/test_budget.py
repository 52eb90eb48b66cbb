"""RetryBudget: Finagle's numbers and bounds, the 10-slice window, on a fake clock."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from sdkcore import RetryBudget
from sdkcore.testing import capture_retry_events


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_fresh_default_budget_holds_100() -> None:
    budget = RetryBudget()
    assert budget.balance == 100
    assert budget.ttl == timedelta(seconds=10)
    assert budget.min_retries_per_sec == 10
    assert budget.retry_ratio == 0.2


def test_each_deposit_adds_retry_ratio_of_a_retry() -> None:
    budget = RetryBudget(clock=Clock())
    for _ in range(4):
        budget.deposit()
    assert budget.balance == 100  # 0.8 of a retry
    budget.deposit()
    assert budget.balance == 101
    for _ in range(500):
        budget.deposit()
    assert budget.balance == 201


def test_withdrawals_until_refused_leave_the_balance_intact() -> None:
    budget = RetryBudget(clock=Clock())
    assert all(budget.try_withdraw() for _ in range(100))
    assert budget.balance == 0
    assert not budget.try_withdraw()
    assert budget.balance == 0
    assert budget.refused == 1
    for _ in range(5):
        budget.deposit()
    assert budget.try_withdraw()  # five first attempts bought one retry
    assert not budget.try_withdraw()


def test_min_zero_and_percent_zero_refuse_everything() -> None:
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0, clock=Clock())
    for _ in range(1000):
        budget.deposit()
    assert budget.balance == 0
    assert not budget.try_withdraw()


def test_reserve_only_deposits_earn_nothing() -> None:
    budget = RetryBudget(ttl=2, min_retries_per_sec=3, retry_ratio=0, clock=Clock())
    assert budget.balance == 6
    for _ in range(100):
        budget.deposit()
    assert budget.balance == 6


def test_percent_above_one_gives_several_retries_per_deposit() -> None:
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=2.0, clock=Clock())
    budget.deposit()
    assert budget.balance == 2
    assert budget.try_withdraw()
    assert budget.try_withdraw()
    assert not budget.try_withdraw()


def test_deposits_expire_after_ttl() -> None:
    clock = Clock(1000.0)
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    budget.deposit()
    assert budget.balance == 1
    clock.now = 1009.999  # the ninth slice after it: still in the window
    assert budget.balance == 1
    clock.now = 1010.0  # ten slices later: gone
    assert budget.balance == 0
    assert not budget.try_withdraw()


def test_the_window_has_ten_slices() -> None:
    clock = Clock(1000.0)
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    for second in range(10):
        clock.now = 1000.0 + second + 0.5
        budget.deposit()
    assert budget.balance == 10
    for gone in range(1, 11):  # each further second, one slice leaves the window
        clock.now = 1010.0 + gone - 1 + 0.5
        assert budget.balance == 10 - gone


def test_withdrawals_expire_after_ttl() -> None:
    clock = Clock(1000.0)
    budget = RetryBudget(ttl=5, min_retries_per_sec=2, retry_ratio=0, clock=clock)
    assert budget.balance == 10
    assert all(budget.try_withdraw() for _ in range(10))
    assert not budget.try_withdraw()
    clock.now += 2.5  # half the window: those withdrawals still count
    assert not budget.try_withdraw()
    clock.now = 1005.0
    assert budget.balance == 10


def test_a_long_pause_empties_the_window() -> None:
    clock = Clock()
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    for _ in range(50):
        budget.deposit()
    clock.now += 3600.0
    assert budget.balance == 0


def test_balance_is_never_negative() -> None:
    # a deposit expires before the withdrawal it paid for: Finagle's count goes below zero
    clock = Clock(1000.0)
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    budget.deposit()
    clock.now = 1009.5
    assert budget.try_withdraw()
    clock.now = 1010.0
    assert budget.balance == 0
    budget.deposit()  # pays the debt back first
    assert budget.balance == 0
    assert not budget.try_withdraw()


def test_a_clock_that_goes_back_keeps_the_newer_slice() -> None:
    clock = Clock(1000.0)
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    clock.now = 1005.0
    budget.deposit()
    clock.now = 1003.0
    budget.deposit()
    clock.now = 1014.999  # both were counted in the slice of 1005
    assert budget.balance == 2
    clock.now = 1015.0
    assert budget.balance == 0


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("ttl", 0.999, ValueError),
        ("ttl", 60.001, ValueError),
        ("ttl", timedelta(minutes=2), ValueError),
        ("ttl", -1, ValueError),
        ("ttl", "10", TypeError),
        ("min_retries_per_sec", -1, ValueError),
        ("min_retries_per_sec", float("nan"), ValueError),
        ("min_retries_per_sec", "10", TypeError),
        ("min_retries_per_sec", True, TypeError),
        ("retry_ratio", -0.01, ValueError),
        ("retry_ratio", 1000.5, ValueError),
        ("retry_ratio", float("inf"), ValueError),
        ("retry_ratio", None, TypeError),
        ("clock", 3, TypeError),
        ("name", b"x", TypeError),
    ],
)
def test_bad_settings_name_the_field(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"RetryBudget\({field}\)"):
        RetryBudget(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": 1},
        {"ttl": timedelta(seconds=60)},
        {"min_retries_per_sec": 0},
        {"retry_ratio": 0},
        {"retry_ratio": 1000},
    ],
)
def test_finagle_bounds_are_inclusive(kwargs: dict[str, Any]) -> None:
    budget = RetryBudget(**kwargs)
    assert budget.balance >= 0


def test_exhausted_event_once_per_exhaustion() -> None:
    budget = RetryBudget(ttl=1, min_retries_per_sec=1, retry_ratio=0, clock=Clock())
    with capture_retry_events() as events:
        assert budget.try_withdraw()
        assert not budget.try_withdraw()
        assert not budget.try_withdraw()
    assert [e["event"] for e in events] == ["budget.exhausted"]
    assert events[0]["balance"] == 0
    assert events[0]["min_retries_per_sec"] == 1


def test_shared_by_threads_grants_exactly_the_balance() -> None:
    budget = RetryBudget(clock=Clock())  # 100 retries, the clock stands still
    granted: list[bool] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        mine = [budget.try_withdraw() for _ in range(50)]
        with lock:
            granted.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(granted) == 400
    assert granted.count(True) == 100
    assert budget.refused == 300


def test_repr_shows_the_balance() -> None:
    assert "balance=100" in repr(RetryBudget(name="kv"))


def test_lock_free_deposits_from_threads_are_all_counted() -> None:
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=1.0, clock=Clock())

    def work() -> None:
        for _ in range(5000):
            budget.deposit()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert budget.balance == 40000


# -- issue 21: the budget on edge paths ---------------------------------------------------


def test_a_vanishing_percentage_is_a_budget_not_an_overflow() -> None:
    budget = RetryBudget(retry_ratio=5e-324, min_retries_per_sec=1, ttl=10)
    assert budget.balance == 10  # the reserve only: no deposit ever earns a retry
    for _ in range(1000):
        budget.deposit()
    assert budget.balance == 10
    assert RetryBudget(retry_ratio=5e-324, min_retries_per_sec=0).try_withdraw() is False


def test_refund_gives_back_a_withdrawal() -> None:
    budget = RetryBudget(min_retries_per_sec=1, ttl=10)
    assert budget.try_withdraw()
    assert budget.balance == 9
    budget.refund()
    assert budget.balance == 10


@pytest.mark.anyio
async def test_hedge_copies_an_open_breaker_refused_cost_nothing() -> None:
    """Before: 5 copies refused by an OPEN breaker (nothing sent) cost 4 withdrawals."""
    import anyio

    from sdkcore import (
        CircuitBreaker,
        HedgePolicy,
        Request,
        RequestCanceledException,
        RetryOrchestrator,
        RetryReason,
    )

    budget = RetryBudget(min_retries_per_sec=1, ttl=10, retry_ratio=0.0)
    breaker = CircuitBreaker(volume_threshold=1, sleep_window=60)
    breaker.record_failure(TimeoutError())
    sent = 0

    async def send(request: Request, index: int) -> bytes:
        nonlocal sent
        with breaker.guard():
            sent += 1
            await anyio.lowlevel.checkpoint()
        return b"never"

    policy = HedgePolicy(5, delay=0.001, non_fatal={RetryReason.CIRCUIT_BREAKER_OPEN})
    request = Request(idempotent=True, timeout=1.0)
    with pytest.raises(RequestCanceledException, match="all 5 hedges failed"):
        await RetryOrchestrator(retry_budget=budget).hedge(request, send, policy)
    assert sent == 0
    assert len(request.attempts) == 5
    assert budget.balance == 10  # every withdrawal given back


class _Broken(Exception):
    pass


class _BrokenBudget:
    def __init__(self, *, deposit: bool = False, withdraw: bool = False) -> None:
        self.raise_on_deposit = deposit
        self.raise_on_withdraw = withdraw

    def deposit(self) -> None:
        if self.raise_on_deposit:
            raise _Broken("deposit")

    def try_withdraw(self) -> bool:
        if self.raise_on_withdraw:
            raise _Broken("try_withdraw")
        return True


@pytest.mark.anyio
async def test_a_deposit_that_raises_leaves_nothing_armed_in_the_caller() -> None:
    """Before: execute's deadline scope and dispatch mark stayed in the caller's task, so
    its next await was cancelled at the dead request's deadline."""
    import anyio

    from sdkcore import Request, RequestState, RetryOrchestrator

    orchestrator = RetryOrchestrator(retry_budget=_BrokenBudget(deposit=True))
    sends = 0

    async def send(request: Request) -> bytes:
        nonlocal sends
        sends += 1
        return b"ok"

    request = Request(timeout=0.02)
    with pytest.raises(_Broken):
        await orchestrator.execute(request, send)
    assert sends == 0
    assert request.state is RequestState.FAILED
    with anyio.fail_after(5):
        await anyio.sleep(0.06)  # past the dead request's deadline: not cancelled
    inner = Request(timeout=5)
    assert inner.time_left is not None
    assert inner.time_left.total_seconds() > 4  # no dead deadline inherited


@pytest.mark.anyio
async def test_a_try_withdraw_that_raises_leaves_no_request_counted_in_retry() -> None:
    from sdkcore import Request, RequestState, RetryableError, RetryOrchestrator, RetryReason

    orchestrator = RetryOrchestrator(retry_budget=_BrokenBudget(withdraw=True))

    async def send(request: Request) -> bytes:
        raise RetryableError(RetryReason.KV_LOCKED)

    request = Request(timeout=1.0)
    with pytest.raises(_Broken):
        await orchestrator.execute(request, send)
    assert orchestrator.requests_in_retry == 0
    assert request.state is RequestState.FAILED

    sync = Request(timeout=1.0)

    def send_sync(request: Request) -> bytes:
        raise RetryableError(RetryReason.KV_LOCKED)

    with pytest.raises(_Broken):
        orchestrator.execute_sync(sync, send_sync)
    assert orchestrator.requests_in_retry == 0
    assert sync.state is RequestState.FAILED


def test_the_old_percentage_name_is_refused_with_the_new_unit() -> None:
    """Issue 21: RetryBudget(percent_can_retry=20) silently meant 2,000% (20 retries per
    request), easy to read as the breaker's 0-100 percentage. The parameter is now a ratio
    by name; the old name says what to write instead."""
    with pytest.raises(TypeError, match=r"now RetryBudget\(retry_ratio=\.\.\.\).*not a 0-100"):
        RetryBudget(percent_can_retry=20)
    assert RetryBudget(retry_ratio=1000).retry_ratio == 1000  # Finagle's range stays reachable
    with pytest.raises(ValueError, match=r"retry_ratio\) must be a ratio in \[0, 1000\]"):
        RetryBudget(retry_ratio=1000.5)


def test_the_reserve_is_min_retries_times_ttl_exactly() -> None:
    """2.05 a second for 60 s is 123 retries; floats made it 122.99999999999999 and
    int() 122 (the only one of 1,794 combinations a review tried)."""
    assert RetryBudget(min_retries_per_sec=2.05, ttl=60, clock=lambda: 0.0).balance == 123
    assert RetryBudget(min_retries_per_sec=0.1, ttl=30, clock=lambda: 0.0).balance == 3


def test_a_refund_gives_back_what_a_tiny_ratio_budget_granted() -> None:
    """With a ratio so small that only the reserve pays, a granted withdrawal's refund
    was a no-op: the reserve shrank by one retry each time one was refused after it."""
    budget = RetryBudget(min_retries_per_sec=10, ttl=10, retry_ratio=1e-17, clock=lambda: 0.0)
    assert budget.balance == 100
    assert budget.try_withdraw()
    assert budget.balance == 99
    budget.refund()
    assert budget.balance == 100
    empty = RetryBudget(min_retries_per_sec=0, retry_ratio=0.0, clock=lambda: 0.0)
    empty.refund()  # Finagle's Empty: nothing was ever granted, nothing comes back
    assert not empty.try_withdraw()


@pytest.mark.parametrize("start", [0.0, -100.0])  # a monotonic clock may read below 0
@pytest.mark.parametrize("reading", [float("nan"), float("inf"), 10**400])
def test_a_clock_that_breaks_later_leaves_the_window_where_it_is(
    reading: float, start: float
) -> None:
    """A clock sane when the budget was made but reading NaN, an infinity or a number past
    a float's range later: ``deposit`` and ``try_withdraw`` raised ValueError or
    OverflowError inside a request (a review). The window stays, as for a clock that
    went back: deposits still count, withdrawals still take."""
    now: list[float] = [start]
    budget = RetryBudget(
        ttl=timedelta(seconds=10), min_retries_per_sec=0, retry_ratio=0.5, clock=lambda: now[0]
    )
    budget.deposit()
    now[0] = reading
    budget.deposit()
    assert budget.balance == 1
    assert budget.try_withdraw()
    assert budget.balance == 0
    budget.refund()
    assert budget.balance == 1
    now[0] = start + 20.0  # past the ttl: what was deposited has aged out (a negative
    assert budget.balance == 0  # clock's broken reading once moved the window to -1)


@pytest.mark.parametrize("base", [100.0, -20.0])
def test_the_window_does_not_depend_on_the_clocks_sign(base: float) -> None:
    """int() rounds toward zero, so below 0 the slice numbers were off by one and deposits
    outlived the ttl by a slice (a review: deposits at -20.5 still counted 9.5 s later,
    those at +100.5 did not). Slices are floor(now * per_slice)."""
    now: list[float] = [base + 0.5]
    budget = RetryBudget(
        ttl=timedelta(seconds=10), min_retries_per_sec=0, retry_ratio=1.0, clock=lambda: now[0]
    )
    now[0] = base + 0.5
    for _ in range(5):
        budget.deposit()
    assert budget.balance == 5
    now[0] = base + 10.0  # 9.5 s later: the deposits' slice has left the 10 s window
    assert budget.balance == 0
