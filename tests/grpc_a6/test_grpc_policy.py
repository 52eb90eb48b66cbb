"""A6RetryStrategy decisions through the RetryOrchestrator (no network), and pushback parsing."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from sdkcore import Request, RequestCanceledException, RetryOrchestrator
from sdkcore.grpc import (
    PUSHBACK_DONT_RETRY,
    A6RetryStrategy,
    BackoffJitter,
    CallState,
    RetryPolicy,
    RetryStats,
    RetryThrottler,
    TransparentKind,
    parse_pushback,
)
from sdkcore.grpc._policy import CALL_STATE_KEY, REASON_STATUS, REASON_TRANSPARENT
from sdkcore.grpc._stats import bucket_of
from sdkcore.testing import VirtualClock

UNAVAILABLE, INVALID_ARGUMENT = 14, 3
POLICY = RetryPolicy(4, timedelta(seconds=1), timedelta(seconds=5), 2.0, frozenset({UNAVAILABLE}))


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        (["0"], 0),
        (["250"], 250),
        ([b"7"], 7),
        (["-1"], PUSHBACK_DONT_RETRY),
        (["-250"], PUSHBACK_DONT_RETRY),
        (["abc"], PUSHBACK_DONT_RETRY),
        (["1.5"], PUSHBACK_DONT_RETRY),
        ([""], PUSHBACK_DONT_RETRY),
        (["2147483648"], PUSHBACK_DONT_RETRY),
        (["2147483647"], 2147483647),
        (["10", "10"], PUSHBACK_DONT_RETRY),
    ],
)
def test_parse_pushback(values: list[str | bytes], expected: int | None) -> None:
    assert parse_pushback(values) == expected


class FixedRandom(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def make(
    strategy: A6RetryStrategy, clock: VirtualClock, timeout: float | None = None
) -> tuple[Request, CallState]:
    state = CallState()
    state.attempts = 1
    request = Request(
        name="/s/m",
        timeout=timeout,
        retry_strategy=strategy,
        client_context={CALL_STATE_KEY: state},
        clock=clock.clock,
    )
    return request, state


async def fail(
    orch: RetryOrchestrator,
    request: Request,
    state: CallState,
    code: int,
    pushback: int | None = None,
) -> None:
    state.code = code
    state.pushback = pushback
    await orch.maybe_retry(request, REASON_STATUS)
    state.attempts += 1


@pytest.mark.anyio
async def test_full_jitter_backoff_sequence_and_pushback_reset() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    strategy = A6RetryStrategy(POLICY, max_attempts_cap=10, rng=FixedRandom(0.5))
    request, state = make(strategy, clock)
    await fail(orch, request, state, UNAVAILABLE)  # 0.5 * 1
    await fail(orch, request, state, UNAVAILABLE, pushback=300)  # exactly 0.3, then reset
    await fail(orch, request, state, UNAVAILABLE)  # 0.5 * 1 again
    assert clock.sleeps == pytest.approx([0.5, 0.3, 0.5])


@pytest.mark.anyio
async def test_backoff_grows_and_is_capped() -> None:
    strategy = A6RetryStrategy(POLICY, max_attempts_cap=10)
    assert [strategy.backoff_bound(n) for n in range(5)] == [1, 2, 4, 5, 5]
    jittered = A6RetryStrategy(POLICY, jitter=BackoffJitter.PROPORTIONAL, rng=FixedRandom(1.0))
    assert jittered.draw_backoff(3) == pytest.approx(6.0)  # 5 * 1.2
    low = A6RetryStrategy(POLICY, jitter=BackoffJitter.PROPORTIONAL, rng=FixedRandom(0.0))
    assert low.draw_backoff(0) == pytest.approx(0.8)
    full = A6RetryStrategy(POLICY, rng=FixedRandom(0.0))
    assert full.draw_backoff(0) == 0.0


@pytest.mark.anyio
async def test_pushback_zero_retries_without_delay() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request, state = make(A6RetryStrategy(POLICY), clock)
    state.code, state.pushback = UNAVAILABLE, 0
    assert await orch.maybe_retry(request, REASON_STATUS) == timedelta(0)


@pytest.mark.anyio
async def test_max_attempts_respected() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request, state = make(A6RetryStrategy(POLICY), clock)
    for _ in range(3):
        await fail(orch, request, state, UNAVAILABLE)
    assert state.attempts == 4
    with pytest.raises(RequestCanceledException, match="all 4 attempts"):
        await fail(orch, request, state, UNAVAILABLE)


@pytest.mark.anyio
async def test_throttle_costs() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    throttler = RetryThrottler(10, 0.1)
    strategy = A6RetryStrategy(POLICY, throttler=throttler)
    # Non-retryable status without pushback: no token.
    request, state = make(strategy, clock)
    with pytest.raises(RequestCanceledException, match="not in retryableStatusCodes"):
        await fail(orch, request, state, INVALID_ARGUMENT)
    assert throttler.tokens == 10
    # Non-retryable status with a "don't retry" pushback: one token (A6 text).
    request, state = make(strategy, clock)
    with pytest.raises(RequestCanceledException):
        await fail(orch, request, state, INVALID_ARGUMENT, pushback=PUSHBACK_DONT_RETRY)
    assert throttler.tokens == 9
    # Retryable status: one token per failure; at 5 (= max/2) retries stop.
    request, state = make(strategy, clock)
    await fail(orch, request, state, UNAVAILABLE)  # 8
    await fail(orch, request, state, UNAVAILABLE)  # 7
    request, state = make(strategy, clock)
    await fail(orch, request, state, UNAVAILABLE)  # 6
    with pytest.raises(RequestCanceledException, match="throttled"):
        await fail(orch, request, state, UNAVAILABLE)  # 5
    assert throttler.tokens == 5


@pytest.mark.anyio
async def test_committed_call_is_not_retried() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request, state = make(A6RetryStrategy(POLICY), clock)
    state.committed = True
    with pytest.raises(RequestCanceledException, match="committed"):
        await fail(orch, request, state, UNAVAILABLE)


def test_histogram_bucket_of_each_retry() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 9, 10, 99, 100, 999, 1000, 5000)] == [
        1,
        2,
        3,
        4,
        5,
        5,
        10,
        10,
        100,
        100,
        1000,
        1000,
    ]
    stats = RetryStats()
    for n in range(1, 1101):
        stats.record_retry("/s/m", n)
    snap = stats.for_method("/s/m")
    assert snap.retry_attempts == 1100
    assert dict(snap.histogram) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 5, 10: 90, 100: 900, 1000: 101}
    assert sum(snap.histogram.values()) == snap.retry_attempts
    assert stats.for_method("/none").retry_attempts == 0


def test_strategy_argument_errors() -> None:
    with pytest.raises(ValueError, match="max_attempts_cap"):
        A6RetryStrategy(POLICY, max_attempts_cap=0)
    with pytest.raises(TypeError, match="BackoffJitter"):
        A6RetryStrategy(POLICY, jitter="full")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_second_refused_stream_goes_to_the_retry_policy() -> None:
    """A6: a refused stream is retried transparently once; if that fails too, the
    configured retry policy handles it (it counts as an attempt, with backoff)."""
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request, state = make(A6RetryStrategy(POLICY, rng=FixedRandom(0.5)), clock)
    state.code = UNAVAILABLE
    state.transparent = TransparentKind.REFUSED
    await orch.maybe_retry(request, REASON_TRANSPARENT)  # the one immediate re-send
    assert state.transparent is TransparentKind.REFUSED
    assert clock.sleeps in ([], [0.0])
    await orch.maybe_retry(request, REASON_TRANSPARENT)  # refused again: the policy decides
    assert state.transparent is None  # so the next attempt is a new A6 attempt
    assert clock.sleeps[-1] == pytest.approx(0.5)  # initialBackoff * 0.5


@pytest.mark.anyio
async def test_second_refused_stream_with_a_non_retryable_status_is_final() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request, state = make(A6RetryStrategy(POLICY), clock)
    state.code = INVALID_ARGUMENT
    state.transparent = TransparentKind.REFUSED
    await orch.maybe_retry(request, REASON_TRANSPARENT)
    with pytest.raises(RequestCanceledException, match="not in retryableStatusCodes"):
        await orch.maybe_retry(request, REASON_TRANSPARENT)
