"""Shared by tests/test_telemetry*.py: an OpenTelemetry SDK with in-memory reader and exporter.

``Otel()`` builds a MeterProvider with an ``InMemoryMetricReader``, a TracerProvider
with an ``InMemorySpanExporter`` behind a ``SimpleSpanProcessor``, and the
:class:`sdkcore.Telemetry` over both. ``metrics()`` collects (cumulative) and checks
that everything sdkcore reports comes from the instrumentation scope ``sdkcore``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    InMemoryMetricReader,
    Sum,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from sdkcore import Request, RetryableError, RetryOrchestrator, Telemetry

__all__ = [
    "Fatal",
    "Metric",
    "Otel",
    "SpanCounter",
    "attr",
    "current_span_id",
    "hand_wired",
    "parent_id",
    "span_id",
    "span_named",
]


@dataclass
class Metric:
    name: str
    unit: str
    kind: str  # "counter", "histogram", "gauge", "updown"
    points: list[tuple[dict[str, Any], Any]]  # (attributes, value); histogram: (count, sum)

    def total(self, **attributes: Any) -> Any:
        """Sum of the values (histogram: of the counts) of points having ``attributes``."""
        keyed = {k.replace("__", "."): v for k, v in attributes.items()}
        found = [v for a, v in self.points if all(a.get(k) == v for k, v in keyed.items())]
        if self.kind == "histogram":
            return sum(count for count, _ in found)
        return sum(found)

    def attribute_sets(self) -> list[dict[str, Any]]:
        return [a for a, _ in self.points]


class Otel:
    """An OpenTelemetry SDK recording in memory, and sdkcore's Telemetry over it."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.exporter = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(meter_provider=self.meters, tracer_provider=self.tracers)
        self.app = self.tracers.get_tracer("app")  # the application's own tracer

    def orchestrator(self, *args: Any, **kwargs: Any) -> RetryOrchestrator:
        return RetryOrchestrator(*args, telemetry=self.telemetry, **kwargs)

    def metrics(self) -> dict[str, Metric]:
        data = self.reader.get_metrics_data()
        out: dict[str, Metric] = {}
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                assert sm.scope.name == "sdkcore", sm.scope
                for m in sm.metrics:
                    d = m.data
                    points: list[tuple[dict[str, Any], Any]]
                    if isinstance(d, Histogram):
                        kind = "histogram"
                        points = [
                            (dict(p.attributes or {}), (p.count, p.sum)) for p in d.data_points
                        ]
                    elif isinstance(d, Sum):
                        kind = "counter" if d.is_monotonic else "updown"
                        points = [(dict(p.attributes or {}), p.value) for p in d.data_points]
                    elif isinstance(d, Gauge):
                        kind = "gauge"
                        points = [(dict(p.attributes or {}), p.value) for p in d.data_points]
                    else:  # pragma: no cover - sdkcore makes no other kind
                        raise AssertionError(f"unexpected metric data {d!r}")
                    assert m.name not in out, f"{m.name} reported twice"
                    out[m.name] = Metric(m.name, m.unit or "", kind, points)
        return out

    def spans(self) -> list[ReadableSpan]:
        spans = list(self.exporter.get_finished_spans())
        for span in spans:
            if span.name != "caller" and not span.name.startswith("app."):
                scope = span.instrumentation_scope
                assert scope is not None
                assert scope.name == "sdkcore", (span.name, scope)
        return spans

    def shutdown(self) -> None:
        self.meters.shutdown()
        self.tracers.shutdown()


class SpanCounter(SpanProcessor):
    """Counts ``on_start`` and ``on_end`` per span id, from any thread:
    ``otel.tracers.add_span_processor(counter)``, then ``counter.problems()`` lists every
    span not ended exactly once (the SDK calls ``on_end`` once; a second ``end()`` only
    logs a warning, ``Calling end() on an ended span``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: dict[int, str] = {}
        self.ended: collections.Counter[int] = collections.Counter()

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        with self.lock:
            self.started[span.context.span_id] = span.name

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        with self.lock:
            self.ended[span.context.span_id] += 1

    def problems(self) -> list[str]:
        with self.lock:
            out = [
                f"span {name!r} ({span_id:x}) ended {self.ended[span_id]} times"
                for span_id, name in self.started.items()
                if self.ended[span_id] != 1
            ]
            out += [
                f"span {i:x} ended but never started" for i in self.ended if i not in self.started
            ]
        return out


def span_named(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    [span] = [s for s in spans if s.name == name]
    return span


def attr(span: Any, key: str) -> Any:
    """A span's (or an event's) attribute ``key`` (KeyError when absent)."""
    attributes = span.attributes
    assert attributes is not None
    return attributes[key]


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def span_id(span: Any) -> int:
    return int(span.get_span_context().span_id)


def current_span_id() -> int:
    return span_id(trace.get_current_span())


class Fatal(Exception):
    """A non-retryable answer of the hand-wired loop's protocol."""


async def hand_wired(
    orchestrator: RetryOrchestrator,
    request: Request,
    send: Callable[[Request], Awaitable[Any]],
) -> Any:
    """The README's hand-wired loop: ``attempt()``, ``maybe_retry``, ``succeed``/``fail``."""
    while True:
        try:
            with orchestrator.attempt(request):
                result = await send(request)
        except RetryableError as failure:
            await orchestrator.maybe_retry(request, failure.reason, cause=failure)
            continue
        except Exception as exc:  # every other error is this protocol's final answer
            raise orchestrator.fail(request, exc) from None
        orchestrator.succeed(request)
        return result
