"""A Telemetry given a ThresholdReporter records every finished request there (rfc/0008)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from sdkcore import (
    Request,
    RetryOrchestrator,
    Telemetry,
    ThresholdReporter,
)
from sdkcore.testing import VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio


async def test_slow_requests_reach_the_threshold_report() -> None:
    clock = VirtualClock()
    reporter = ThresholdReporter(kv_threshold=0.5, clock=clock.clock)
    telemetry = Telemetry(MeterProvider(), TracerProvider(), threshold_reporter=reporter)
    orchestrator = RetryOrchestrator(telemetry=telemetry)

    async def slow(request: Request) -> bytes:
        clock.advance(0.7)
        return b"ok"

    async def fast(request: Request) -> bytes:
        clock.advance(0.1)
        return b"ok"

    kv = {"service": "kv"}
    await orchestrator.execute(Request(name="get", client_context=kv, clock=clock.clock), slow)
    await orchestrator.execute(Request(name="get", client_context=kv, clock=clock.clock), fast)
    await orchestrator.execute(Request(name="query", clock=clock.clock), slow)  # under 1 s
    with capture_retry_events() as events:
        reporter.flush()
    [event] = [e for e in events if e["event"] == "threshold.report"]
    report = json.loads(event["report"])
    assert list(report) == ["kv"]
    assert report["kv"]["total_count"] == 1
    [top] = report["kv"]["top_requests"]
    assert top["operation_name"] == "get"
    assert top["total_duration_us"] == pytest.approx(700_000, rel=1e-3)
    assert top["timeout_ms"] == 2500


def test_a_threshold_reporter_must_be_one() -> None:
    with pytest.raises(TypeError, match=r"threshold_reporter=.*ThresholdReporter"):
        Telemetry(threshold_reporter=object())  # type: ignore[arg-type]
