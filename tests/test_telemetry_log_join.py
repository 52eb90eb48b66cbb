"""A watched breaker's, budget's, limiter's or throttle's log events name its metric series.

An alert fires on a series (``sdkcore.endpoint="node8:11210#2"``, ``"unnamed-3"``, or the
name ``Telemetry.watch(name=...)`` gave an unnamed target), and the operator looks for the
log lines of that object: its events carried only its own name (``None`` or ``""`` when it
had none; the shared name for the second of two), so none matched (an operator's review).
Each event of a watched target now carries ``metric_endpoint``: its series' label.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from telemetry_kit import Otel

from sdkcore import (
    AdaptiveThrottle,
    CircuitBreaker,
    ConcurrencyLimiter,
    RetryableError,
    RetryBudget,
    RetryReason,
)
from sdkcore.testing import VirtualClock, capture_retry_events


@pytest.fixture
def otel() -> Iterator[Otel]:
    kit = Otel()
    yield kit
    kit.shutdown()


def _trip(breaker: CircuitBreaker) -> list[MutableMapping[str, Any]]:
    with capture_retry_events() as events:
        breaker.record_failure(TimeoutError("no answer"))
    return [e for e in events if e["event"] == "breaker.opened"]


def test_breaker_events_carry_the_label_of_their_series(otel: Otel) -> None:
    given = otel.telemetry.watch(CircuitBreaker(volume_threshold=1), name="node7:11210")
    first = otel.telemetry.watch(CircuitBreaker(name="node8:11210", volume_threshold=1))
    second = otel.telemetry.watch(CircuitBreaker(name="node8:11210", volume_threshold=1))
    unnamed = otel.telemetry.watch(CircuitBreaker(volume_threshold=1))
    labels = [otel.telemetry.label(b) for b in (given, first, second, unnamed)]
    assert labels[:3] == ["node7:11210", "node8:11210", "node8:11210#2"]
    assert labels[3].startswith("unnamed-")
    for breaker, label in zip((given, first, second, unnamed), labels, strict=True):
        [event] = _trip(breaker)
        assert event["metric_endpoint"] == label
        assert event["endpoint"] == breaker.name  # its own name, as before
    series = otel.metrics()["sdkcore.circuit_breaker.transitions"].attribute_sets()
    assert {s["sdkcore.endpoint"] for s in series} == set(labels)


def test_an_unwatched_target_s_events_have_no_metric_endpoint() -> None:
    [event] = _trip(CircuitBreaker(name="node9:11210", volume_threshold=1))
    assert "metric_endpoint" not in event


def test_budget_limiter_and_throttle_events_carry_it_too(otel: Otel) -> None:
    clock = VirtualClock()
    budget = otel.telemetry.watch(
        RetryBudget(min_retries_per_sec=0.1, retry_ratio=0.0, ttl=10, clock=clock.clock),
        name="kv",
    )
    limiter = otel.telemetry.watch(ConcurrencyLimiter(1))
    throttle = otel.telemetry.watch(
        AdaptiveThrottle(k=1.0, name="query", clock=clock.clock, random=lambda: 0.0)
    )
    with capture_retry_events() as events:
        while budget.try_withdraw():
            pass
        with limiter.guard(), pytest.raises(RetryableError), limiter.guard():
            pass
        for _ in range(3):
            throttle.record_failure(RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "busy"))
        assert not throttle.admit()  # refused: the episode starts
    by_event = {e["event"]: e for e in events}
    assert by_event["budget.exhausted"]["metric_endpoint"] == "kv"
    assert by_event["limiter.refusing"]["metric_endpoint"] == otel.telemetry.label(limiter)
    assert otel.telemetry.label(limiter).startswith("unnamed-")
    assert by_event["throttle.refusing"]["metric_endpoint"] == "query"
