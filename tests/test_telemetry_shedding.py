"""Limiters, the throttle and the learned hedge delay report through Telemetry (issue 23 item 8)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AdaptiveThrottle,
    ConcurrencyLimiter,
    LatencyQuantile,
    RetryableError,
    RetryReason,
    Telemetry,
)
from sdkcore.testing import VirtualClock

ENDPOINT = "sdkcore.endpoint"


def collect(
    reader: InMemoryMetricReader,
) -> dict[str, tuple[str | None, list[tuple[dict[str, Any], Any]]]]:
    out: dict[str, tuple[str | None, list[tuple[dict[str, Any], Any]]]] = {}
    data = reader.get_metrics_data()
    if data is None:  # nothing recorded at all
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            assert sm.scope.name == "sdkcore"
            for metric in sm.metrics:
                points: list[tuple[dict[str, Any], Any]] = []
                for p in metric.data.data_points:
                    assert isinstance(p, NumberDataPoint), metric.name  # gauges and counters
                    points.append((dict(p.attributes or {}), p.value))
                out[metric.name] = (metric.unit, points)
    return out


def test_a_limiter_reports_limit_in_flight_queued_and_rejections() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(MeterProvider(metric_readers=[reader]))
    limiter = telemetry.watch(ConcurrencyLimiter(2, name="10.0.0.1:11210"))
    adaptive = telemetry.watch(AdaptiveConcurrencyLimiter(initial_limit=20, name="adaptive"))
    with limiter.guard(), limiter.guard():
        with pytest.raises(RetryableError) as info, limiter.guard():
            pass
        assert info.value.reason is RetryReason.CONCURRENCY_LIMITED
        got = collect(reader)
    node = {ENDPOINT: "10.0.0.1:11210"}
    unit, points = got["sdkcore.concurrency_limiter.limit"]
    assert unit == "{dispatch}"
    assert sorted(points, key=lambda point: point[0][ENDPOINT]) == [
        (node, 2),
        ({ENDPOINT: "adaptive"}, adaptive.limit),
    ]
    assert (node, 2) in got["sdkcore.concurrency_limiter.in_flight"][1]
    assert (node, 0) in got["sdkcore.concurrency_limiter.queued"][1]
    rejections = got["sdkcore.concurrency_limiter.rejections"]
    assert rejections == ("{dispatch}", [(node, 1), ({ENDPOINT: "adaptive"}, 0)])


def test_a_throttle_reports_its_probability_and_refusals() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(MeterProvider(metric_readers=[reader]))
    clock = VirtualClock()
    throttle = telemetry.watch(
        AdaptiveThrottle(k=1.0, name="search", clock=clock.clock, random=lambda: 0.0)
    )
    overloaded = RetryableError(RetryReason.KV_TEMPORARY_FAILURE)
    for _ in range(10):
        try:
            with throttle.guard():
                raise overloaded
        except RetryableError:
            pass
    got = collect(reader)
    [(attributes, probability)] = got["sdkcore.throttle.rejection_probability"][1]
    assert attributes == {ENDPOINT: "search"}
    assert probability == pytest.approx(throttle.rejection_probability)
    assert probability > 0
    assert got["sdkcore.throttle.rejections"] == (
        "{request}",
        [({ENDPOINT: "search"}, throttle.refused)],
    )
    assert throttle.refused > 0  # random() == 0.0 refuses whenever the probability is > 0


def test_the_learned_hedge_delay_is_a_gauge_once_known() -> None:
    reader = InMemoryMetricReader()
    telemetry = Telemetry(MeterProvider(metric_readers=[reader]))
    clock = VirtualClock()
    quantile = telemetry.watch(
        LatencyQuantile(0.01, min_samples=10, clock=clock.clock), name="replicas"
    )
    assert "sdkcore.hedge.delay" not in collect(reader)  # nothing learned yet: no point
    for _ in range(20):
        quantile.record(0.02)
    got = collect(reader)
    delay = quantile.current_delay
    assert isinstance(delay, timedelta)
    assert got["sdkcore.hedge.delay"] == ("s", [({ENDPOINT: "replicas"}, delay.total_seconds())])


def test_watch_refuses_what_it_cannot_report() -> None:
    telemetry = Telemetry(MeterProvider())
    with pytest.raises(TypeError, match="ConcurrencyLimiter, AdaptiveConcurrencyLimiter"):
        telemetry.watch(object())
    with pytest.raises(TypeError, match=r"watch\(name=\.\.\.\) must be a str"):
        telemetry.watch(LatencyQuantile(), name=3)  # type: ignore[arg-type]
