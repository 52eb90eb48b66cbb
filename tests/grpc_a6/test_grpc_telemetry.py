"""gRPC telemetry (issue 22): A66/A96 metrics and A72 spans of sdkcore's channels.

Against a real grpc.aio server on 127.0.0.1, with the OpenTelemetry SDK's in-memory
metric reader and span exporter. The names, units, attributes and buckets are checked
against the gRFCs: A66 (OpenTelemetry metrics), A96 (retry metrics), A72 (tracing).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk.metrics")
from grpc import aio  # noqa: E402
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    Server,
    abort,
    cancel_while_waiting_to_retry,
    config_json,
    retry_config,
    wait_until,
)
from hedge_server import HedgeScript, block, fail, hedging_config, ok  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

import sdkcore  # noqa: E402
from sdkcore import _telemetry as sdkcore_telemetry  # noqa: E402
from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    RetryController,
    RetryStats,
    insecure_channel,
    retry_controller,
)
from sdkcore.grpc._telemetry import (  # noqa: E402
    HEDGE_BUCKETS,
    LATENCY_BUCKETS,
    RETRY_BUCKETS,
    TRANSPARENT_BUCKETS,
    canonical_target,
)

pytestmark = pytest.mark.asyncio

ABORTED = grpc.StatusCode.ABORTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT

#: A66 and A96, as written there: name -> (kind, unit, attribute keys).
STANDARD = {
    "grpc.client.attempt.started": ("counter", "{attempt}", {"grpc.method", "grpc.target"}),
    "grpc.client.attempt.duration": (
        "histogram",
        "s",
        {"grpc.method", "grpc.target", "grpc.status"},
    ),
    "grpc.client.call.duration": (
        "histogram",
        "s",
        {"grpc.method", "grpc.target", "grpc.status"},
    ),
    "grpc.client.call.retries": ("histogram", "{retry}", {"grpc.method", "grpc.target"}),
    "grpc.client.call.transparent_retries": (
        "histogram",
        "{transparent_retry}",
        {"grpc.method", "grpc.target"},
    ),
    "grpc.client.call.hedges": ("histogram", "{hedge}", {"grpc.method", "grpc.target"}),
    "grpc.client.call.retry_delay": ("histogram", "s", {"grpc.method", "grpc.target"}),
}
#: A66's latency buckets and A96's recommended ones.
BUCKETS = {
    "grpc.client.attempt.duration": LATENCY_BUCKETS,
    "grpc.client.call.duration": LATENCY_BUCKETS,
    "grpc.client.call.retry_delay": LATENCY_BUCKETS,
    "grpc.client.call.retries": (1, 2, 3, 4, 5),
    "grpc.client.call.transparent_retries": (1, 2, 3, 4, 5, 10),
    "grpc.client.call.hedges": (1, 2, 3, 4, 5),
}
A66_LATENCY = (
    0, 0.00001, 0.00005, 0.0001, 0.0003, 0.0006, 0.0008, 0.001, 0.002, 0.003, 0.004, 0.005,
    0.006, 0.008, 0.01, 0.013, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.13,
    0.16, 0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1, 2, 5, 10, 20, 50, 100,
)  # fmt: skip


class Otel:
    """A Telemetry on the OpenTelemetry SDK with in-memory readers, and what they hold."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.spans = InMemorySpanExporter()
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.spans))
        self.telemetry = sdkcore.Telemetry(self.meters, self.tracers)
        self._metrics: dict[str, Any] | None = None

    def metrics(self) -> dict[str, Any]:
        """name -> metric (of the sdkcore scope), read once per test step."""
        data = self.reader.get_metrics_data()
        out: dict[str, Any] = {}
        if data is not None:
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    assert sm.scope.name == "sdkcore"
                    for metric in sm.metrics:
                        out[metric.name] = metric
        return out

    def grpc(self) -> dict[str, list[tuple[dict[str, Any], Any]]]:
        """The grpc.* metrics: name -> [(attributes, point)]."""
        return {
            name: [(dict(p.attributes or {}), p) for p in metric.data.data_points]
            for name, metric in self.metrics().items()
            if name.startswith("grpc.")
        }

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def shutdown(self) -> None:
        self.meters.shutdown()
        self.tracers.shutdown()


@pytest.fixture
def otel() -> Iterator[Otel]:
    o = Otel()
    try:
        yield o
    finally:
        o.shutdown()


def value(points: list[tuple[dict[str, Any], Any]], **attrs: str) -> Any:
    """The one point whose attributes include ``attrs`` (keys with '_' for '.')."""
    want = {k.replace("_", ".", 1): v for k, v in attrs.items()}
    found = [p for a, p in points if all(a.get(k) == v for k, v in want.items())]
    assert len(found) == 1, (want, points)
    return found[0]


def fail_then_ok(failures: int, code: Any = ABORTED) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt <= failures:
            await abort(context, code)
        return b"ok"

    return fn


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_id(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


# -- names, units, attributes, buckets ---------------------------------------------------


async def test_a_call_retried_twice_records_the_standard_instruments(
    server: Server, otel: Otel
) -> None:
    method = server.unary_unary("M", fail_then_ok(2))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    metrics = otel.metrics()
    target = f"dns:///{server.target}"
    base = {"grpc.method": "test.Svc/M", "grpc.target": target}
    for name, (kind, unit, keys) in STANDARD.items():
        if name in ("grpc.client.call.transparent_retries", "grpc.client.call.hedges"):
            assert name not in metrics  # A96: 0 is not reported
            continue
        metric = metrics[name]
        assert metric.unit == unit, name
        for point in metric.data.data_points:
            assert set(point.attributes) == keys, name
            assert {k: point.attributes[k] for k in base} == base
            if kind == "histogram":
                assert tuple(point.explicit_bounds) == BUCKETS[name], name
    points = otel.grpc()
    assert value(points["grpc.client.attempt.started"]).value == 3
    aborted = value(points["grpc.client.attempt.duration"], grpc_status="ABORTED")
    done = value(points["grpc.client.attempt.duration"], grpc_status="OK")
    assert (aborted.count, done.count) == (2, 1)
    call = value(points["grpc.client.call.duration"], grpc_status="OK")
    assert call.count == 1
    assert call.sum >= aborted.sum + done.sum  # the call holds its attempts
    retries = value(points["grpc.client.call.retries"])
    assert (retries.count, retries.sum) == (1, 2)
    delay = value(points["grpc.client.call.retry_delay"])
    assert delay.count == 1
    assert 0.0 < delay.sum < call.sum
    # The channel's orchestrator recorded the core metrics, on the same telemetry.
    core = metrics["sdkcore.request.duration"].data.data_points
    assert [dict(p.attributes) for p in core] == [
        {"sdkcore.request.name": method, "sdkcore.request.outcome": "success"}
    ]
    assert metrics["sdkcore.retries"].data.data_points[0].value == 2


async def test_buckets_are_a66s_and_a96s() -> None:
    assert tuple(LATENCY_BUCKETS) == A66_LATENCY
    assert (RETRY_BUCKETS, TRANSPARENT_BUCKETS, HEDGE_BUCKETS) == (
        (1, 2, 3, 4, 5),
        (1, 2, 3, 4, 5, 10),
        (1, 2, 3, 4, 5),
    )


async def test_an_ok_call_records_one_attempt_and_no_retry_counts(
    server: Server, otel: Otel
) -> None:
    method = server.unary_unary("M", fail_then_ok(0))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    points = otel.grpc()
    assert value(points["grpc.client.attempt.started"]).value == 1
    assert value(points["grpc.client.call.duration"], grpc_status="OK").count == 1
    assert value(points["grpc.client.call.retry_delay"]).sum == 0.0
    for absent in ("retries", "transparent_retries", "hedges"):
        assert f"grpc.client.call.{absent}" not in points
    # Every call of the channel is an sdkcore request: the OK one too, 0 retries.
    retries = otel.metrics()["sdkcore.request.retries"].data.data_points
    assert [(p.count, p.sum) for p in retries] == [(1, 0)]
    # A72: "gRPC status OK is recorded with status OK" (it was left unset)
    spans = by_name(otel.finished(), "Sent.test.Svc.M") + by_name(
        otel.finished(), "Attempt.test.Svc.M"
    )
    assert [s.status.status_code for s in spans] == [trace.StatusCode.OK] * 2


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INVALID_ARGUMENT"])
async def test_a_call_that_fails(server: Server, otel: Otel, code: str) -> None:
    status = getattr(grpc.StatusCode, code)
    method = server.unary_unary("M", fail_then_ok(99, status))
    cfg = retry_config(codes=("UNAVAILABLE",))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=cfg, telemetry=otel.telemetry
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is status
    attempts = 3 if code == "UNAVAILABLE" else 1  # retryable: maxAttempts 3
    points = otel.grpc()
    assert value(points["grpc.client.attempt.started"]).value == attempts
    assert value(points["grpc.client.attempt.duration"], grpc_status=code).count == attempts
    assert value(points["grpc.client.call.duration"], grpc_status=code).count == 1
    if attempts > 1:
        assert value(points["grpc.client.call.retries"]).sum == attempts - 1
    else:
        assert "grpc.client.call.retries" not in points
    core = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert [p.attributes["sdkcore.request.outcome"] for p in core] == ["failure"]
    # the status of the AioRpcError the application got (OpenTelemetry's RPC conventions),
    # also when the retries ran out (not sdkcore's refusal)
    assert [p.attributes["error.type"] for p in core] == [code]
    (sent,) = by_name(otel.finished(), "Sent.test.Svc.M")
    assert (sent.attributes or {})["error.type"] == code
    assert sent.status.status_code is trace.StatusCode.ERROR
    assert (sent.status.description or "").startswith(f"{code}, ")  # A72's form
    assert (sent.attributes or {})["grpc.status"] == code
    attempt_spans = by_name(otel.finished(), "Attempt.test.Svc.M")
    assert len(attempt_spans) == attempts
    assert all(s.status.status_code is trace.StatusCode.ERROR for s in attempt_spans)


async def test_deadline_during_backoff_is_deadline_exceeded_and_a_timeout(
    server: Server, otel: Otel
) -> None:
    method = server.unary_unary("M", fail_then_ok(99))
    # A 16-24 s backoff (A6's full jitter drew below the 0.3 s deadline 1.5% of the time,
    # and the call then made a second attempt)
    cfg = retry_config(initial="20s", maximum="20s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=cfg,
            telemetry=otel.telemetry,
            backoff_jitter=BackoffJitter.PROPORTIONAL,
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=0.3)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    points = otel.grpc()
    assert value(points["grpc.client.attempt.duration"], grpc_status="ABORTED").count == 1
    assert value(points["grpc.client.call.duration"], grpc_status="DEADLINE_EXCEEDED").count == 1
    core = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert [p.attributes["sdkcore.request.outcome"] for p in core] == ["timeout"]


@pytest.mark.parametrize("shape", ["retry policy", "no service config", "server streaming"])
async def test_a_deadline_reached_in_flight_is_a_timeout(
    server: Server, otel: Otel, shape: str
) -> None:
    async def slow(request: bytes, context: Any, attempt: int) -> bytes:
        await asyncio.sleep(5)
        return b"late"

    async def slow_stream(request: bytes, context: Any, attempt: int) -> Any:
        await asyncio.sleep(5)
        yield b"late"

    cfg = None if shape == "no service config" else retry_config()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=cfg, telemetry=otel.telemetry
        ) as ch:
            if shape == "server streaming":
                stream = ch.unary_stream(server.unary_stream("S", slow_stream))
                with pytest.raises(aio.AioRpcError) as info:
                    [m async for m in stream(b"x", timeout=0.2)]
            else:
                unary = ch.unary_unary(server.unary_unary("M", slow))
                with pytest.raises(aio.AioRpcError) as info:
                    await unary(b"x", timeout=0.2)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    core = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert [dict(p.attributes) for p in core] == [
        {
            "sdkcore.request.name": core[0].attributes["sdkcore.request.name"],
            "sdkcore.request.outcome": "timeout",
            "error.type": "DEADLINE_EXCEEDED",
        }
    ]


# -- grpc.method and grpc.target (A66) ---------------------------------------------------


async def test_generic_methods_are_other_registered_and_configured_ones_by_name(
    server: Server, otel: Otel
) -> None:
    """A66: a generic (unregistered) method is "other". Known: registered by a generated
    stub (_registered_method=True), or named by the service config (the catch-all {}
    names nothing)."""
    generic = server.unary_unary("Generic", fail_then_ok(0))
    stub = server.unary_unary("Stub", fail_then_ok(0))
    catch_all = config_json(
        {"name": [{}], "retryPolicy": retry_policy()}, timeout=None, throttling=None
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=catch_all, telemetry=otel.telemetry
        ) as ch:
            assert await ch.unary_unary(generic)(b"x") == b"ok"
            assert await ch.unary_unary(stub, _registered_method=True)(b"x") == b"ok"
            assert callable(ch.stream_stream(stub, _registered_method=True))  # noted too
    started = otel.grpc()["grpc.client.attempt.started"]
    assert sorted(a["grpc.method"] for a, _ in started) == ["other", "test.Svc/Stub"]
    # sdkcore's own request metrics are bounded the same way: "/" and grpc.method.
    durations = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert sorted(p.attributes["sdkcore.request.name"] for p in durations) == [
        "/other",
        "/test.Svc/Stub",
    ]
    # Spans keep the real name: A72's span names are not metric attributes.
    names = {s.name for s in otel.finished()}
    assert {"Sent.test.Svc.Generic", "Sent.test.Svc.Stub"} <= names


async def test_generic_methods_leave_the_applications_names_alone(
    server: Server, otel: Otel
) -> None:
    """More distinct generic methods than sdkcore records request names for: all of them
    are one name, and the application's own request is still recorded by its name."""
    method = server.unary_unary("M", fail_then_ok(0))
    many = sdkcore_telemetry.MAX_NAMES + 5
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, telemetry=otel.telemetry) as ch:
            for i in range(many):
                # grpc.aio sends the path as given; the server's handler is found by its
                # last segment, so each is a distinct generic method reaching "M".
                assert await ch.unary_unary(f"/tenant{i}.Svc/M")(b"x") == b"ok"
        orchestrator = sdkcore.RetryOrchestrator(telemetry=otel.telemetry)

        async def send(request: sdkcore.Request) -> str:
            return "ok"

        await orchestrator.execute(sdkcore.Request(name="kv.get"), send)
    assert server.count("M") == many
    del method
    durations = otel.metrics()["sdkcore.request.duration"].data.data_points
    recorded = {p.attributes["sdkcore.request.name"]: p.count for p in durations}
    assert recorded == {"/other": many, "kv.get": 1}


async def test_generic_methods_never_turn_a_stubs_or_the_configs_methods_into_other(
    server: Server, otel: Otel
) -> None:
    """A66: "pre-registered methods will always be recorded". A proxy's many generic paths
    on the channel once used up the bound of named methods, and a stub's method called
    after them was recorded as "other" (a review): generic calls are bounded apart."""
    server.unary_unary("M", fail_then_ok(0))
    many = sdkcore_telemetry.MAX_NAMES + 5
    configured = config_json(
        {"name": [{"service": "cfg.Svc"}], "retryPolicy": retry_policy()},
        timeout=None,
        throttling=None,
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=configured, telemetry=otel.telemetry
        ) as ch:
            stub = ch.unary_unary("/test.Svc/M", _registered_method=True)  # made at startup
            for i in range(many):
                assert await ch.unary_unary(f"/tenant{i}.Svc/M")(b"x") == b"ok"
            assert await stub(b"x") == b"ok"
            assert await ch.unary_unary("/cfg.Svc/M")(b"x") == b"ok"
    started = otel.grpc()["grpc.client.attempt.started"]
    counts = {a["grpc.method"]: point.value for a, point in started}
    assert counts == {"other": many, "test.Svc/M": 1, "cfg.Svc/M": 1}


async def test_a_method_of_a_configured_service_is_recorded_by_name(
    server: Server, otel: Otel
) -> None:
    method = server.unary_unary("M", fail_then_ok(0))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            await ch.unary_unary(method)(b"x")
    (attributes, _) = otel.grpc()["grpc.client.attempt.started"][0]
    assert attributes["grpc.method"] == "test.Svc/M"  # full name, no leading slash (A66)


def retry_policy() -> dict[str, Any]:
    return {
        "maxAttempts": 3,
        "initialBackoff": "0.01s",
        "maxBackoff": "0.05s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["ABORTED"],
    }


async def test_targets_are_canonical_as_grpc_resolves_them() -> None:
    assert canonical_target("127.0.0.1:50051") == "dns:///127.0.0.1:50051"
    assert canonical_target("localhost:50051") == "dns:///localhost:50051"
    assert canonical_target("example.com") == "dns:///example.com"
    assert canonical_target("dns:///example.com:443") == "dns:///example.com:443"
    assert canonical_target("unix:/tmp/s.sock") == "unix:/tmp/s.sock"
    assert canonical_target("ipv4:10.0.0.1:80,10.0.0.2:80") == "ipv4:10.0.0.1:80,10.0.0.2:80"
    assert canonical_target("xds:///svc:8000") == "xds:///svc:8000"
    assert canonical_target("custom://authority/x") == "custom://authority/x"


# -- transparent retries and hedges (A96) --------------------------------------------------


async def test_a_transparent_retry(server: Server, otel: Otel) -> None:
    """An attempt the channel's limiter refused never left the client: it is re-sent
    transparently (A6) until the permit frees; A96 counts the re-sends apart, and each is
    an attempt with transparent-retry true (A72)."""
    release = asyncio.Event()

    async def held(request: bytes, context: Any, attempt: int) -> bytes:
        await release.wait()
        return b"held"

    hold = server.unary_unary("Hold", held)
    method = server.unary_unary("M", fail_then_ok(0))
    limiter = sdkcore.ConcurrencyLimiter(1)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=retry_config(max_attempts=2),
            limiter=limiter,
            telemetry=otel.telemetry,
        ) as ch:
            stats = retry_controller(ch).stats
            first = asyncio.ensure_future(ch.unary_unary(hold)(b"x"))
            await wait_until(lambda: limiter.in_flight == 1)
            pending = asyncio.ensure_future(ch.unary_unary(method)(b"x", timeout=10))
            await wait_until(lambda: stats.for_method(method).transparent_retries >= 1)
            release.set()
            assert await first == b"held"
            assert await pending == b"ok"
            transparent = stats.for_method(method).transparent_retries
    points = otel.grpc()
    assert "grpc.client.call.retries" not in points  # no A6 retry
    resent = value(points["grpc.client.call.transparent_retries"], grpc_method="test.Svc/M")
    assert (resent.count, resent.sum) == (1, transparent)
    started = value(points["grpc.client.attempt.started"], grpc_method="test.Svc/M")
    assert started.value == transparent + 1
    durations = points["grpc.client.attempt.duration"]
    assert value(durations, grpc_method="test.Svc/M", grpc_status="OK").count == 1
    assert value(durations, grpc_method="test.Svc/M", grpc_status="UNAVAILABLE").count == (
        transparent
    )
    attempts = sorted(
        by_name(otel.finished(), "Attempt.test.Svc.M"), key=lambda s: s.start_time or 0
    )
    flags = [(s.attributes or {}).get("transparent-retry") for s in attempts]
    assert flags == [False] + [True] * transparent
    # A transparent retry continues the same A6 attempt: no previous attempt is added.
    assert {(s.attributes or {}).get("previous-rpc-attempts") for s in attempts} == {0}


async def test_a_hedged_call(server: Server, otel: Otel) -> None:
    """Hedge 0 hangs, hedge 1 answers: one hedge (A96), sibling attempt spans (A72)."""
    script = HedgeScript(server, "M", {0: block(), 1: ok(body=b"from 1")})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=hedging_config(max_attempts=3, delay="0.2s"),
            telemetry=otel.telemetry,
        ) as ch:
            assert await ch.unary_unary(script.method)(b"x") == b"from 1"
            await wait_until(lambda: script.cancelled() == {0})
    points = otel.grpc()
    hedges = value(points["grpc.client.call.hedges"])
    assert (hedges.count, hedges.sum) == (1, 1)
    assert "grpc.client.call.retries" not in points  # hedges are not retries (A96)
    assert value(points["grpc.client.attempt.started"]).value == 2
    assert value(points["grpc.client.attempt.duration"], grpc_status="OK").count == 1
    assert value(points["grpc.client.attempt.duration"], grpc_status="CANCELLED").count == 1
    assert value(points["grpc.client.call.duration"], grpc_status="OK").count == 1
    assert value(points["grpc.client.call.retry_delay"]).sum == 0.0  # always one in flight
    metrics = otel.metrics()
    assert metrics["sdkcore.hedges"].data.data_points[0].value == 1
    assert metrics["sdkcore.hedge.wins"].data.data_points[0].value == 1
    spans = otel.finished()
    (sent,) = by_name(spans, "Sent.test.Svc.M")
    copies = sorted(by_name(spans, "Attempt.test.Svc.M"), key=lambda s: s.start_time or 0)
    assert [parent_id(s) for s in copies] == [sent.context.span_id] * 2  # siblings
    assert [(s.attributes or {}).get("previous-rpc-attempts") for s in copies] == [0, 1]
    assert [(s.attributes or {}).get("grpc.status") for s in copies] == ["CANCELLED", "OK"]
    # the loser says it lost (as grpc-java's "thrown away because RetriableStream committed"),
    # not "Locally cancelled by application!": the application cancelled nothing
    assert copies[0].status.description == "CANCELLED, hedge lost: another attempt committed"


async def test_hedged_copies_cut_by_the_deadline_end_deadline_exceeded(
    server: Server, otel: Otel
) -> None:
    """As a retried call's attempt at its deadline: a deadline storm on a hedged method
    read as client cancellations (CANCELLED) in the attempts' metrics and spans."""
    script = HedgeScript(server, "M", {0: block(), 1: block(), 2: block()})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=hedging_config(max_attempts=3, delay="0.05s"),
            telemetry=otel.telemetry,
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(script.method)(b"x", timeout=0.3)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    points = otel.grpc()
    assert value(points["grpc.client.attempt.duration"], grpc_status="DEADLINE_EXCEEDED").count == 3
    copies = by_name(otel.finished(), "Attempt.test.Svc.M")
    assert [(s.attributes or {}).get("grpc.status") for s in copies] == ["DEADLINE_EXCEEDED"] * 3


async def test_a_hedged_call_answered_before_the_delay(server: Server, otel: Otel) -> None:
    script = HedgeScript(server, "M", {0: ok()})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=hedging_config(max_attempts=3, delay="5s"),
            telemetry=otel.telemetry,
        ) as ch:
            assert await ch.unary_unary(script.method)(b"x") == b"ok"
    points = otel.grpc()
    assert "grpc.client.call.hedges" not in points
    assert value(points["grpc.client.attempt.started"]).value == 1
    assert value(points["grpc.client.call.duration"], grpc_status="OK").count == 1
    outcomes = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert [p.attributes["sdkcore.request.outcome"] for p in outcomes] == ["success"]
    assert len(by_name(otel.finished(), "Attempt.test.Svc.M")) == 1


async def test_every_hedge_failing(server: Server, otel: Otel) -> None:
    script = HedgeScript(server, "M", {0: fail(UNAVAILABLE), 1: fail(UNAVAILABLE)})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=hedging_config(max_attempts=2, delay="0.05s"),
            telemetry=otel.telemetry,
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(script.method)(b"x")
    assert info.value.code() is UNAVAILABLE
    points = otel.grpc()
    assert value(points["grpc.client.attempt.duration"], grpc_status="UNAVAILABLE").count == 2
    assert value(points["grpc.client.call.duration"], grpc_status="UNAVAILABLE").count == 1
    assert value(points["grpc.client.call.hedges"]).sum == 1


# -- spans (A72) -----------------------------------------------------------------------


async def test_spans_names_kinds_parents_and_attributes(server: Server, otel: Otel) -> None:
    method = server.unary_unary("M", fail_then_ok(2))
    app = otel.tracers.get_tracer("app")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            with app.start_as_current_span("caller") as caller:
                assert await ch.unary_unary(method)(b"x") == b"ok"
    spans = otel.finished()
    (sent,) = by_name(spans, "Sent.test.Svc.M")
    assert sent.kind is trace.SpanKind.CLIENT
    assert parent_id(sent) == caller.get_span_context().span_id  # the caller's current span
    attributes = dict(sent.attributes or {})
    assert attributes["grpc.status"] == "OK"
    assert attributes["sdkcore.request.name"] == method
    assert attributes["sdkcore.request.outcome"] == "success"
    assert attributes["sdkcore.request.retries"] == 2
    assert sent.status.status_code is trace.StatusCode.OK  # A72
    assert [e.name for e in sent.events] == ["sdkcore.retry", "sdkcore.retry"]
    attempts = sorted(by_name(spans, "Attempt.test.Svc.M"), key=lambda s: s.start_time or 0)
    assert [s.kind for s in attempts] == [trace.SpanKind.INTERNAL] * 3
    assert [parent_id(s) for s in attempts] == [sent.context.span_id] * 3
    assert [dict(s.attributes or {}) for s in attempts] == [
        {"previous-rpc-attempts": n, "transparent-retry": False, "grpc.status": status}
        for n, status in ((0, "ABORTED"), (1, "ABORTED"), (2, "OK"))
    ]
    assert [s.status.status_code for s in attempts] == [
        trace.StatusCode.ERROR,
        trace.StatusCode.ERROR,
        trace.StatusCode.OK,
    ]
    # Each attempt within the call, one after the other.
    times = [(s.start_time or 0, s.end_time or 0) for s in attempts]
    for (_, end), (start, _) in itertools.pairwise(times):
        assert end <= start
    assert (sent.start_time or 0) <= times[0][0]
    assert times[-1][1] <= (sent.end_time or 0)


class _SeesCurrentSpan(aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """An application interceptor: it runs inside each attempt and notes the current span."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.seen.append(trace.get_current_span().get_span_context().span_id)
        return await continuation(details, request)


@pytest.mark.parametrize("path", ["direct", "interceptors"])
async def test_the_attempt_span_is_current_while_the_attempt_runs(
    server: Server, otel: Otel, path: str
) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    probe = _SeesCurrentSpan()
    with anyio.fail_after(TEST_TIMEOUT):
        if path == "direct":
            ch = insecure_channel(
                server.target,
                service_config=retry_config(),
                telemetry=otel.telemetry,
                interceptors=[probe],
            )
        else:
            controller = RetryController(server.target, retry_config(), telemetry=otel.telemetry)
            ch = aio.insecure_channel(
                server.target,
                options=controller.channel_options(),
                interceptors=[*controller.interceptors(), probe],
            )
        async with ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    attempts = sorted(
        by_name(otel.finished(), "Attempt.test.Svc.M"), key=lambda s: s.start_time or 0
    )
    assert probe.seen == [s.context.span_id for s in attempts]
    assert len(attempts) == 2
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached


async def test_a_server_streaming_call_retried_before_it_commits(
    server: Server, otel: Otel
) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> Any:
        if attempt == 1:
            await abort(context, ABORTED)
        yield b"a"
        yield b"b"

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            got = [m async for m in ch.unary_stream(method)(b"x")]
            await wait_until(lambda: bool(by_name(otel.finished(), "Sent.test.Svc.S")))
    assert got == [b"a", b"b"]
    points = otel.grpc()
    assert value(points["grpc.client.attempt.started"]).value == 2
    assert value(points["grpc.client.call.retries"]).sum == 1
    assert value(points["grpc.client.call.duration"], grpc_status="OK").count == 1
    (sent,) = by_name(otel.finished(), "Sent.test.Svc.S")
    attempts = by_name(otel.finished(), "Attempt.test.Svc.S")
    assert [parent_id(s) for s in attempts] == [sent.context.span_id] * 2


async def test_a_call_cancelled_in_flight(server: Server, otel: Otel) -> None:
    release = asyncio.Event()

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        with anyio.move_on_after(TEST_TIMEOUT):
            await release.wait()
        return b""

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            call = ch.unary_unary(method)(b"x")
            await wait_until(lambda: server.count("M") == 1)
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            release.set()
            await wait_until(lambda: bool(by_name(otel.finished(), "Sent.test.Svc.M")))
    points = otel.grpc()
    assert value(points["grpc.client.call.duration"], grpc_status="CANCELLED").count == 1
    assert value(points["grpc.client.attempt.duration"], grpc_status="CANCELLED").count == 1
    outcomes = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert [p.attributes["sdkcore.request.outcome"] for p in outcomes] == ["cancelled"]


# -- the telemetry= parameter ---------------------------------------------------------


async def test_the_channel_uses_its_orchestrators_telemetry(server: Server, otel: Otel) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    orchestrator = sdkcore.RetryOrchestrator(telemetry=otel.telemetry)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), orchestrator=orchestrator
        ) as ch:
            assert retry_controller(ch).telemetry is otel.telemetry
            assert await ch.unary_unary(method)(b"x") == b"ok"
    assert value(otel.grpc()["grpc.client.attempt.started"]).value == 2


async def test_the_channels_telemetry_goes_to_the_orchestrator_it_makes(otel: Otel) -> None:
    ch = insecure_channel("127.0.0.1:1", telemetry=otel.telemetry)
    async with ch:
        controller = retry_controller(ch)
        assert controller.telemetry is otel.telemetry
        assert controller.orchestrator.telemetry is otel.telemetry
    budget = sdkcore.RetryBudget()
    ch = insecure_channel("127.0.0.1:1", telemetry=otel.telemetry, retry_budget=budget)
    async with ch:
        assert retry_controller(ch).orchestrator.telemetry is otel.telemetry
    # The same telemetry on both is fine; an orchestrator without one keeps none.
    same = sdkcore.RetryOrchestrator(telemetry=otel.telemetry)
    async with insecure_channel("127.0.0.1:1", orchestrator=same, telemetry=otel.telemetry):
        pass
    bare = sdkcore.RetryOrchestrator()
    ch = insecure_channel("127.0.0.1:1", orchestrator=bare, telemetry=otel.telemetry)
    async with ch:
        assert retry_controller(ch).telemetry is otel.telemetry


async def test_two_different_telemetries_are_refused(otel: Otel) -> None:
    orchestrator = sdkcore.RetryOrchestrator(telemetry=sdkcore.Telemetry(otel.meters))
    with pytest.raises(ValueError, match="telemetry") as info:
        insecure_channel("127.0.0.1:1", orchestrator=orchestrator, telemetry=otel.telemetry)
    assert "RetryOrchestrator(telemetry=...)" in str(info.value)
    with pytest.raises(TypeError, match=r"telemetry=\.\.\.\) must be an sdkcore\.Telemetry"):
        insecure_channel("127.0.0.1:1", telemetry="otel")  # type: ignore[arg-type]


async def test_without_telemetry_nothing_is_recorded(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            controller = retry_controller(ch)
            assert (controller.telemetry, controller._tel) == (None, None)
            assert await ch.unary_unary(method)(b"x") == b"ok"


async def test_a_failing_instrument_never_fails_a_call(server: Server) -> None:
    class Broken:  # every recording raises
        def __getattr__(self, name: str) -> Any:
            def fails(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("exporter down")

            return fails

    class Meter:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: Broken()

    class Provider:
        def get_meter(self, *a: Any, **k: Any) -> Any:
            return Meter()

    method = server.unary_unary("M", fail_then_ok(1))
    telemetry = sdkcore.Telemetry(meter_provider=Provider(), tracer_provider=TracerProvider())
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=telemetry
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    assert "grpc.client.attempt.started" in telemetry._failed


async def test_a_failing_instrument_loses_only_its_own_records(server: Server, otel: Otel) -> None:
    """One guard per call-level instrument: a raising grpc.client.call.duration once took
    the call's retries and retry delay with it, and the warning named none of them."""

    class Broken:
        def record(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("exporter down")

    class Meter:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def create_histogram(self, name: str, *args: Any, **kwargs: Any) -> Any:
            if name == "grpc.client.call.duration":
                return Broken()
            return self._inner.create_histogram(name, *args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    class Provider:
        def get_meter(self, *args: Any, **kwargs: Any) -> Any:
            return Meter(otel.meters.get_meter(*args, **kwargs))

    method = server.unary_unary("M", fail_then_ok(1))
    telemetry = sdkcore.Telemetry(meter_provider=Provider(), tracer_provider=otel.tracers)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=telemetry
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    points = otel.grpc()
    assert "grpc.client.call.duration" not in points
    assert value(points["grpc.client.call.retries"]).sum == 1
    assert value(points["grpc.client.call.retry_delay"]).count == 1
    assert "grpc.client.call.duration" in telemetry._failed


@pytest.mark.parametrize(
    ("policy", "path", "shape"),
    [
        ("retry", "direct", "unary"),
        ("retry", "interceptor", "unary"),
        ("retry", "interceptor", "unary_stream"),
        ("hedge", "direct", "unary"),
        ("hedge", "interceptor", "unary"),
    ],
)
async def test_a_message_size_that_raises_leaves_nothing_behind(
    server: Server, otel: Otel, policy: str, path: str, shape: str
) -> None:
    """The application's message_size is read before the call's state and telemetry are
    made: one that raises fails the call at once with its error, as a serializer that
    raises does in grpc.aio, and leaves no span started and never ended, no buffered
    bytes and nothing for close(grace) to wait for (the call's Sent. span was left open:
    a review)."""
    started: list[str] = []

    class Starts(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            started.append(span.name)

        def on_end(self, span: Any) -> None:
            pass

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    otel.tracers.add_span_processor(Starts())

    def size(message: Any) -> int:
        raise RuntimeError("message_size failed")

    async def stream(request: bytes, context: Any, attempt: int) -> Any:
        yield b"never"

    method = (
        server.unary_unary("M", fail_then_ok(0))
        if shape == "unary"
        else server.unary_stream("M", stream)
    )
    config = retry_config() if policy == "retry" else hedging_config(delay="0.05s")
    budget = sdkcore.RetryBudget(min_retries_per_sec=0, retry_ratio=1.0)  # a deposit: 1 retry
    if path == "direct":
        channel: Any = insecure_channel(
            server.target,
            service_config=config,
            message_size=size,
            telemetry=otel.telemetry,
            retry_budget=budget,
        )
        controller = retry_controller(channel)
    else:
        controller = RetryController(
            server.target,
            config,
            orchestrator=sdkcore.RetryOrchestrator(retry_budget=budget, telemetry=otel.telemetry),
            message_size=size,
        )
        channel = aio.insecure_channel(
            server.target,
            options=controller.channel_options(),
            interceptors=controller.interceptors(),
        )

    async def call() -> Any:
        if shape == "unary":
            return await channel.unary_unary(method)(b"x")
        return await channel.unary_stream(method)(b"x").read()

    with anyio.fail_after(TEST_TIMEOUT):
        with pytest.raises(RuntimeError, match="message_size failed"):
            await call()
        assert controller.buffered_bytes == 0
        assert not controller._live  # nothing for close(grace) to wait for
        await channel.close()
    assert started == []
    assert server.count("M") == 0
    assert budget.balance == 0  # no first attempt went out: none paid into the budget


# -- what replaced the old counters ------------------------------------------------------


async def test_export_to_opentelemetry_says_what_replaces_it() -> None:
    with pytest.raises(AttributeError, match=r"telemetry=sdkcore\.Telemetry") as info:
        RetryStats().export_to_opentelemetry()
    assert "grpc.client.call.retries" in str(info.value)


async def test_a_hedged_call_on_the_interceptor_path(server: Server, otel: Otel) -> None:
    """RetryController(telemetry=...).interceptors() on a plain grpc.aio channel: the same."""
    script = HedgeScript(server, "M", {0: block(), 1: ok(body=b"from 1")})
    controller = RetryController(
        server.target, hedging_config(max_attempts=3, delay="0.2s"), telemetry=otel.telemetry
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(
            server.target,
            options=controller.channel_options(),
            interceptors=controller.interceptors(),
        ) as ch:
            assert await ch.unary_unary(script.method)(b"x") == b"from 1"
            await wait_until(lambda: script.cancelled() == {0})
    points = otel.grpc()
    assert value(points["grpc.client.call.hedges"]).sum == 1
    assert value(points["grpc.client.attempt.started"]).value == 2
    assert value(points["grpc.client.call.duration"], grpc_status="OK").count == 1
    spans = otel.finished()
    (sent,) = by_name(spans, "Sent.test.Svc.M")
    copies = by_name(spans, "Attempt.test.Svc.M")
    assert sorted((s.attributes or {})["previous-rpc-attempts"] for s in copies) == [0, 1]  # type: ignore[type-var]
    assert {parent_id(s) for s in copies} == {sent.context.span_id}


async def test_a_stream_that_fails_after_it_committed(server: Server, otel: Otel) -> None:
    """A response stream commits on its first message: its later status is the call's."""

    async def fn(request: bytes, context: Any, attempt: int) -> Any:
        yield b"a"
        await abort(context, UNAVAILABLE)

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), telemetry=otel.telemetry
        ) as ch:
            got: list[bytes] = []

            async def read_all() -> None:
                async for m in ch.unary_stream(method)(b"x"):
                    got.append(m)

            with pytest.raises(aio.AioRpcError) as info:
                await read_all()
            await wait_until(lambda: bool(by_name(otel.finished(), "Sent.test.Svc.S")))
    assert (got, info.value.code()) == ([b"a"], UNAVAILABLE)
    points = otel.grpc()
    assert value(points["grpc.client.attempt.started"]).value == 1
    assert value(points["grpc.client.attempt.duration"], grpc_status="UNAVAILABLE").count == 1
    assert value(points["grpc.client.call.duration"], grpc_status="UNAVAILABLE").count == 1
    assert "grpc.client.call.retries" not in points


@pytest.mark.parametrize("how", ["call.cancel()", "channel.close()"])
async def test_a_call_ended_while_waiting_to_retry_is_cancelled(
    server: Server, otel: Otel, how: str
) -> None:
    method = server.unary_unary("M", fail_then_ok(99))
    await cancel_while_waiting_to_retry(server, method, how, otel.telemetry)
    points = otel.grpc()
    assert value(points["grpc.client.attempt.duration"], grpc_status="ABORTED").count == 1
    assert value(points["grpc.client.call.duration"], grpc_status="CANCELLED").count == 1
    outcomes = otel.metrics()["sdkcore.request.duration"].data.data_points
    assert [p.attributes["sdkcore.request.outcome"] for p in outcomes] == ["cancelled"]
    (sent,) = by_name(otel.finished(), "Sent.test.Svc.M")
    assert (sent.attributes or {})["grpc.status"] == "CANCELLED"


async def test_a_channels_limiter_and_throttle_report_through_its_telemetry(
    server: Server, otel: Otel
) -> None:
    """They reported nothing unless the application watched them itself."""
    limiter = sdkcore.ConcurrencyLimiter(4, name="svc-limit")
    throttle = sdkcore.AdaptiveThrottle(name="svc-throttle")
    method = server.unary_unary("M", fail_then_ok(0))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, limiter=limiter, throttle=throttle, telemetry=otel.telemetry
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
            metrics = otel.metrics()
    endpoints = {
        name: {dict(p.attributes or {}).get("sdkcore.endpoint") for p in m.data.data_points}
        for name, m in metrics.items()
    }
    assert endpoints["sdkcore.concurrency_limiter.limit"] == {"svc-limit"}
    assert endpoints["sdkcore.concurrency_limiter.rejections"] == {"svc-limit"}
    assert endpoints["sdkcore.throttle.rejection_probability"] == {"svc-throttle"}


async def test_a_limiter_the_application_watches_elsewhere_stays_there(
    server: Server, otel: Otel
) -> None:
    """A channel with its own Telemetry does not take over a limiter the application's
    telemetry already watches (a target reports to one Telemetry)."""
    from sdkcore._telemetry import watched_by

    apps = Otel()
    try:
        limiter = apps.telemetry.watch(sdkcore.ConcurrencyLimiter(4, name="shared"))
        with anyio.fail_after(TEST_TIMEOUT):
            async with insecure_channel(
                server.target, limiter=limiter, telemetry=otel.telemetry
            ) as ch:
                assert ch is not None
        assert watched_by(limiter) is apps.telemetry
    finally:
        apps.shutdown()
