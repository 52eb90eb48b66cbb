"""Telemetry is bounded and safe (issue 22 item 7), off by default, global by default.

* request names past 1,000 distinct values are recorded as ``other``; texts are cut
  at 100 characters;
* an instrument, span or exporter that raises never fails or delays a request, and is
  logged once per kind (``telemetry.failed``);
* ``telemetry=None`` records nothing; ``Telemetry()`` uses the global providers (in a
  subprocess: a process sets them once).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from telemetry_kit import Otel, hand_wired

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    Telemetry,
)
from sdkcore._telemetry import MAX_NAMES, MAX_TEXT
from sdkcore.testing import VirtualClock, capture_retry_events

LOCKED = RetryReason.KV_LOCKED
NAME = "sdkcore.request.name"
SAFETY = 10.0


@pytest.fixture
def otel() -> Iterator[Otel]:
    kit = Otel()
    yield kit
    kit.shutdown()


def ok(request: Request) -> str:
    return "v"


# -- bounded attributes ----------------------------------------------------------------------


def test_names_past_the_cap_are_other(otel: Otel) -> None:
    assert MAX_NAMES == 1000
    orchestrator = otel.orchestrator()
    long_name = "L" * 150  # registered before the cap, kept (cut) after it
    orchestrator.execute_sync(Request(name=long_name), ok)
    for n in range(MAX_NAMES - 1):
        orchestrator.execute_sync(Request(name=f"op{n}"), ok)
    for n in range(5):  # new names past the cap
        orchestrator.execute_sync(Request(name=f"late{n}"), ok)
    orchestrator.execute_sync(Request(name="op7"), ok)  # known names stay themselves
    orchestrator.execute_sync(Request(name=long_name), ok)
    duration = otel.metrics()["sdkcore.request.duration"]
    counts = {a[NAME]: count for a, (count, _) in duration.points}
    assert len(counts) == MAX_NAMES + 1
    assert counts["other"] == 5
    assert counts["op7"] == 2
    assert counts["L" * MAX_TEXT] == 2
    assert not any(name.startswith("late") for name in counts)


def test_the_name_bound_holds_across_telemetry_objects_on_one_provider(otel: Otel) -> None:
    """Three clients in one process, each with its own Telemetry on the same provider:
    each had a bound of its own, and together they recorded 2,001 name series. One
    bound per provider, as the labels of breakers and budgets."""
    others = [Telemetry(meter_provider=otel.meters, tracer_provider=otel.tracers) for _ in range(2)]
    doors = [otel.orchestrator()] + [RetryOrchestrator(telemetry=t) for t in others]
    for n in range(MAX_NAMES + 200):
        doors[n % 3].execute_sync(Request(name=f"op{n}"), ok)
    doors[1].execute_sync(Request(name="op0"), ok)  # a name another one recorded: itself
    duration = otel.metrics()["sdkcore.request.duration"]
    counts = {a[NAME]: count for a, (count, _) in duration.points}
    assert len(counts) == MAX_NAMES + 1
    assert counts["other"] == 200
    assert counts["op0"] == 2
    assert others[0].name("op5") == "op5"
    assert others[1].name("never-seen") == "other"


def test_texts_are_cut_at_100_characters(otel: Otel) -> None:
    assert MAX_TEXT == 100
    clock = VirtualClock()
    error = type("E" * 150, (Exception,), {})
    breaker = otel.telemetry.watch(
        CircuitBreaker(name="b" * 150, volume_threshold=1, clock=clock.clock)
    )
    budget = RetryBudget(name="g" * 150, clock=clock.clock)
    orchestrator = otel.orchestrator(retry_budget=budget)

    def send(request: Request) -> str:
        raise error("x" * 500)

    with pytest.raises(error):
        orchestrator.execute_sync(Request(name="n" * 150), send)
    breaker.record_failure(TimeoutError("down"))
    got = otel.metrics()
    [(attributes, _)] = got["sdkcore.request.duration"].points
    assert attributes == {
        NAME: "n" * 100,
        "sdkcore.request.outcome": "failure",
        "error.type": "E" * 100,
    }
    assert got["sdkcore.circuit_breaker.state"].points == [({"sdkcore.endpoint": "b" * 100}, 1)]
    transitions = got["sdkcore.circuit_breaker.transitions"].points
    assert [(t["sdkcore.circuit_breaker.state"], n) for t, n in transitions if n] == [("open", 1)]
    assert {t["sdkcore.endpoint"] for t, _ in transitions} == {"b" * 100}
    [(balance, _)] = got["sdkcore.retry_budget.balance"].points
    assert balance == {"sdkcore.endpoint": "g" * 100}
    [span] = [s for s in otel.spans() if s.name != "sdkcore.attempt"]
    assert span.name == "n" * 100
    assert span.attributes is not None
    assert span.attributes["error.type"] == "E" * 100
    assert span.status.description is not None
    assert len(span.status.description) <= 100


# -- OpenTelemetry that raises ------------------------------------------------------------------


class Broken:
    """A MeterProvider whose every instrument raises when it records."""

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def _instrument(self, *args: Any, **kwargs: Any) -> Any:
        return self

    create_counter = create_histogram = create_up_down_counter = _instrument

    def create_observable_gauge(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def create_observable_counter(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def add(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("exporter queue full")

    record = add


class RaisingProcessor(SpanProcessor):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("processor down")


class RaisingOnEnd(SpanProcessor):
    def on_end(self, span: Any) -> None:
        raise RuntimeError("processor down")


class RaisingExporter(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        raise RuntimeError("collector unreachable")


def failures(events: list[Any]) -> list[str]:
    out = []
    for event in events:
        if event["event"] == "telemetry.failed":
            assert event["log_level"] == "warning"
            assert "RuntimeError" in event["error"]
            out.append(event["kind"])
    return out


async def every_door(orchestrator: RetryOrchestrator, clock: VirtualClock) -> list[Any]:
    """One retried request through each async door, one hedge won by a later copy."""
    results = []

    async def flaky(request: Request) -> str:
        if request.retry_attempts == 0:
            raise RetryableError(LOCKED)
        return "v"

    async def copies(request: Request, index: int) -> str:
        if index == 0:
            await anyio.sleep_forever()
        return f"r{index}"

    def new() -> Request:
        return Request(name="kv.get", idempotent=True, clock=clock.clock)

    results.append(await orchestrator.execute(new(), flaky))
    results.append(await hand_wired(orchestrator, new(), flaky))
    results.append(await orchestrator.hedge(new(), copies, HedgePolicy(2, delay=0.0)))
    request = new()
    await orchestrator.maybe_retry(request, LOCKED)
    orchestrator.succeed(request)
    results.append(request.state.value)
    return results


EXPECTED = ["v", "v", "r1", "succeeded"]


@pytest.mark.anyio
async def test_raising_instruments_never_fail_a_request(otel: Otel) -> None:
    telemetry = Telemetry(meter_provider=Broken(), tracer_provider=otel.tracers)
    clock = VirtualClock()
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0, clock=clock.clock)
    orchestrator = RetryOrchestrator(
        BestEffortRetryStrategy(), sleep=clock.sleep, telemetry=telemetry
    )
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        # Watching starts each counter series at 0: the first add that raises is there.
        refusing = RetryOrchestrator(
            BestEffortRetryStrategy(), sleep=clock.sleep, telemetry=telemetry, retry_budget=budget
        )
        breaker = telemetry.watch(CircuitBreaker(volume_threshold=1, clock=clock.clock))
        for _ in range(2):  # the second round logs nothing new
            assert await every_door(orchestrator, clock) == EXPECTED
            assert orchestrator.execute_sync(Request(name="s"), ok) == "v"
            with pytest.raises(RequestCanceledException):  # the budget refused
                await refusing.execute(Request(name="b", idempotent=True, clock=clock.clock), _lock)
            breaker.record_failure(TimeoutError("down"))
            with pytest.raises(RetryableError), breaker.guard():
                pass  # pragma: no cover - refused
            breaker.reset()
    kinds = failures(events)
    assert sorted(kinds) == sorted(set(kinds)), "each kind is logged once"
    assert set(kinds) == {
        "request.duration",
        "request.retries",
        "retries",
        "retry.delay",
        "hedges",
        "hedge.wins",
        "circuit_breaker.transitions",
        "circuit_breaker.rejections",
        "retry_budget.rejections",
    }
    assert clock.sleeps == [s for s in clock.sleeps if s < 1.0]  # no wait of telemetry's own
    assert len([s for s in otel.spans() if s.name == "kv.get"]) == 8  # traces unaffected


async def _lock(request: Request) -> str:
    raise RetryableError(LOCKED)


@pytest.mark.anyio
@pytest.mark.parametrize("processor", [RaisingProcessor, RaisingOnEnd])
async def test_raising_span_processor_never_fails_a_request(otel: Otel, processor: Any) -> None:
    tracers = TracerProvider()
    tracers.add_span_processor(processor())
    telemetry = Telemetry(meter_provider=otel.meters, tracer_provider=tracers)
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(
        BestEffortRetryStrategy(), sleep=clock.sleep, telemetry=telemetry
    )
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        for _ in range(2):
            assert await every_door(orchestrator, clock) == EXPECTED
            assert orchestrator.execute_sync(Request(name="s"), ok) == "v"
    assert failures(events) == ["span"]
    # metrics are unaffected by the broken tracing
    duration = otel.metrics()["sdkcore.request.duration"]
    assert duration.total(sdkcore__request__name="kv.get") == 8
    assert duration.total(sdkcore__request__name="s") == 2
    tracers.shutdown()


@pytest.mark.anyio
async def test_raising_exporter_never_fails_a_request(otel: Otel) -> None:
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(RaisingExporter()))
    telemetry = Telemetry(meter_provider=otel.meters, tracer_provider=tracers)
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(
        BestEffortRetryStrategy(), sleep=clock.sleep, telemetry=telemetry
    )
    with anyio.fail_after(SAFETY):
        assert await every_door(orchestrator, clock) == EXPECTED
    assert otel.metrics()["sdkcore.request.duration"].total() == 4
    tracers.shutdown()


# -- off by default; global providers ---------------------------------------------------------


@pytest.mark.anyio
async def test_telemetry_none_records_nothing(otel: Otel) -> None:
    clock = VirtualClock()
    for orchestrator in (
        RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep),
        RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep, telemetry=None),
    ):
        assert orchestrator.telemetry is None
        assert await every_door(orchestrator, clock) == EXPECTED
        request = Request(name="s")
        assert orchestrator.execute_sync(request, ok) == "v"
        assert request._trace is None
    assert otel.metrics() == {}
    assert otel.spans() == []


GLOBAL = textwrap.dedent(
    """
    import json
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sdkcore import Request, RetryOrchestrator, Telemetry

    early = Telemetry()  # before the application set its providers: the API's proxies
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracers)
    late = Telemetry()

    def ok(request):
        return "v"

    RetryOrchestrator().execute_sync(Request(name="off"), ok)
    RetryOrchestrator(telemetry=None).execute_sync(Request(name="none"), ok)
    RetryOrchestrator(telemetry=early).execute_sync(Request(name="early"), ok)
    RetryOrchestrator(telemetry=late).execute_sync(Request(name="late"), ok)
    names = []
    scopes = set()
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            scopes.add(sm.scope.name)
            for m in sm.metrics:
                if m.name == "sdkcore.request.duration":
                    names += [p.attributes["sdkcore.request.name"] for p in m.data.data_points]
    spans = [s.name for s in exporter.get_finished_spans()]
    print(json.dumps({"names": sorted(names), "spans": sorted(spans), "scopes": sorted(scopes)}))
    """
)


def test_telemetry_uses_the_global_providers_by_default() -> None:
    done = subprocess.run(
        [sys.executable, "-c", GLOBAL], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "names": ["early", "late"],
        "spans": ["early", "late", "sdkcore.attempt", "sdkcore.attempt"],
        "scopes": ["sdkcore"],
    }
