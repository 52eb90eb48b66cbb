"""Watching a breaker, budget or limiter starts each of its counter series at 0 (rfc/0008).

A counter series appears at its first ``add``: Prometheus' ``rate()``/``increase()``
see no increase in a series first scraped at N, so a budget that refused 100
retries before the first scrape read 0 retries refused per second. ``Telemetry.watch``
(and whatever watches for the application: an orchestrator its ``retry_budget``, a
gRPC channel given a ``retry_budget``) adds 0 to each counter of the target, for its
``sdkcore.endpoint`` label, so each series is there from the first collection.
Collected through the OpenTelemetry SDK's ``InMemoryMetricReader``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from telemetry_kit import Otel

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AdaptiveThrottle,
    CircuitBreaker,
    ConcurrencyLimiter,
    LatencyQuantile,
    RetryableError,
    RetryBudget,
    Telemetry,
)
from sdkcore.testing import VirtualClock

ENDPOINT = "sdkcore.endpoint"
STATE = "sdkcore.circuit_breaker.state"
TRANSITIONS = "sdkcore.circuit_breaker.transitions"
BREAKER_REJECTIONS = "sdkcore.circuit_breaker.rejections"
BUDGET_REJECTIONS = "sdkcore.retry_budget.rejections"
LIMITER_REJECTIONS = "sdkcore.concurrency_limiter.rejections"
COUNTERS = (TRANSITIONS, BREAKER_REJECTIONS, BUDGET_REJECTIONS, LIMITER_REJECTIONS)


@pytest.fixture
def otel() -> Iterator[Otel]:
    kit = Otel()
    yield kit
    kit.shutdown()


Points = list[tuple[dict[str, Any], Any]]


def ordered(points: Points) -> Points:
    return sorted(points, key=lambda point: sorted(point[0].items()))


def counters(otel: Otel) -> dict[str, Points]:
    """The watched objects' counters collected now: name -> sorted (attributes, value)."""
    got = otel.metrics()
    out = {}
    for name in COUNTERS:
        if name in got:
            assert got[name].kind == "counter", (name, got[name].kind)
            out[name] = ordered(got[name].points)
        # absent: no series at all (what a scrape before the first event used to find)
    return out


def breaker_series(endpoint: str, **values: int) -> dict[str, Points]:
    """A breaker's counters: each transition state, then its rejections (``values`` or 0)."""
    states = ("closed", "open", "half_open")
    return {
        TRANSITIONS: ordered([({ENDPOINT: endpoint, STATE: s}, values.get(s, 0)) for s in states]),
        BREAKER_REJECTIONS: [({ENDPOINT: endpoint}, values.get("rejections", 0))],
    }


def test_a_watched_breaker_has_each_counter_series_at_0(otel: Otel) -> None:
    clock = VirtualClock()
    breaker = CircuitBreaker(name="10.0.0.1:11210", volume_threshold=1, clock=clock.clock)
    assert otel.telemetry.watch(breaker) is breaker
    assert counters(otel) == breaker_series("10.0.0.1:11210")
    # The first event counts from there: 0 -> 1 is an increase a scrape sees.
    breaker.record_failure(TimeoutError("down"))
    with pytest.raises(RetryableError), breaker.guard():
        pass  # pragma: no cover - refused
    assert counters(otel) == breaker_series("10.0.0.1:11210", open=1, rejections=1)


def test_a_watched_budget_has_its_rejections_at_0(otel: Otel) -> None:
    clock = VirtualClock()
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0, name="kv", clock=clock.clock)
    otel.telemetry.watch(budget)
    assert counters(otel) == {BUDGET_REJECTIONS: [({ENDPOINT: "kv"}, 0)]}
    for _ in range(100):
        assert not budget.try_withdraw()
    assert counters(otel) == {BUDGET_REJECTIONS: [({ENDPOINT: "kv"}, 100)]}


def test_an_orchestrators_budget_has_its_rejections_at_0(otel: Otel) -> None:
    clock = VirtualClock()
    budget = RetryBudget(name="kv", clock=clock.clock)
    otel.orchestrator(retry_budget=budget)  # it watches the budget it serves
    assert counters(otel) == {BUDGET_REJECTIONS: [({ENDPOINT: "kv"}, 0)]}


def test_an_unnamed_budget_starts_at_0_under_its_unnamed_label(otel: Otel) -> None:
    clock = VirtualClock()
    first, second = RetryBudget(clock=clock.clock), RetryBudget(clock=clock.clock)
    otel.orchestrator(retry_budget=first)
    otel.orchestrator(retry_budget=second)
    assert counters(otel) == {
        BUDGET_REJECTIONS: [({ENDPOINT: "unnamed-1"}, 0), ({ENDPOINT: "unnamed-2"}, 0)]
    }


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_a_watched_limiter_has_its_rejections_at_0(otel: Otel, kind: str) -> None:
    limiter: Any = (
        ConcurrencyLimiter(1, name="kv-limiter")
        if kind == "fixed"
        else AdaptiveConcurrencyLimiter(initial_limit=1, name="kv-limiter")
    )
    otel.telemetry.watch(limiter)
    assert counters(otel) == {LIMITER_REJECTIONS: [({ENDPOINT: "kv-limiter"}, 0)]}


def test_throttles_and_hedge_delays_add_no_counter(otel: Otel) -> None:
    """A throttle's refusals are an observable counter (a point at each collection)."""
    otel.telemetry.watch(AdaptiveThrottle(name="kv-throttle"))
    otel.telemetry.watch(LatencyQuantile(), name="kv-hedge")
    assert counters(otel) == {}
    got = otel.metrics()
    assert got["sdkcore.throttle.rejections"].points == [({ENDPOINT: "kv-throttle"}, 0)]


def test_a_name_given_on_a_second_watch_starts_its_new_label_at_0(otel: Otel) -> None:
    clock = VirtualClock()
    breaker = CircuitBreaker(volume_threshold=1, clock=clock.clock)  # unnamed
    otel.telemetry.watch(breaker)
    otel.telemetry.watch(breaker, name="10.0.0.2:11210")
    got = counters(otel)
    first, renamed = breaker_series("unnamed-1"), breaker_series("10.0.0.2:11210")
    assert got == {name: ordered(first[name] + renamed[name]) for name in first}


def test_watching_again_adds_nothing(otel: Otel) -> None:
    clock = VirtualClock()
    breaker = CircuitBreaker(name="b", volume_threshold=1, clock=clock.clock)
    otel.telemetry.watch(breaker)
    breaker.record_failure(TimeoutError("down"))
    otel.telemetry.watch(breaker)
    assert counters(otel) == breaker_series("b", open=1)


def test_a_breaker_moved_to_another_telemetry_starts_at_0_there(otel: Otel) -> None:
    other = Otel()
    try:
        clock = VirtualClock()
        breaker = CircuitBreaker(name="b", volume_threshold=1, clock=clock.clock)
        other.telemetry.watch(breaker)
        otel.telemetry.watch(breaker)
        assert counters(otel) == breaker_series("b")
        breaker.record_failure(TimeoutError("down"))
        assert counters(otel) == breaker_series("b", open=1)
        assert counters(other) == breaker_series("b")  # what it had, and no more
    finally:
        other.shutdown()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_grpc_channels_budget_has_its_rejections_at_0(otel: Otel) -> None:
    pytest.importorskip("grpc")
    from sdkcore.grpc import insecure_channel

    budget = RetryBudget(name="channel-budget")
    channel = insecure_channel("127.0.0.1:1", retry_budget=budget, telemetry=otel.telemetry)
    try:  # its orchestrator, made for the budget, watches it: nothing was called
        assert counters(otel) == {BUDGET_REJECTIONS: [({ENDPOINT: "channel-budget"}, 0)]}
    finally:
        await channel.close()


def test_a_counter_that_raises_never_fails_watch(otel: Otel) -> None:
    class Raising:
        def add(self, *args: Any) -> None:
            raise RuntimeError("exporter queue full")

    telemetry = Telemetry(meter_provider=otel.meters)
    telemetry.breaker_transitions = telemetry.breaker_rejections = Raising()
    breaker = CircuitBreaker(name="b")
    assert telemetry.watch(breaker) is breaker
    assert telemetry.label(breaker) == "b"
    assert "circuit_breaker.transitions" in telemetry._failed  # logged once, not raised
