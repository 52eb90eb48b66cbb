"""What the demo counts itself, and its Prometheus endpoint (``--metrics-port``).

:class:`Counts` is the demo's own tally of what sdkcore did: every request its
orchestrators ran to an end, their retries and hedges (from each finished request's
``retry_attempts``), each circuit breaker transition (as the breaker makes it) and
each withdrawal a retry budget refused. It goes to ``--json`` under ``counts``
whether or not telemetry runs, so a Prometheus scraping ``--metrics-port`` can be
checked against it (tests/test_prometheus.py): ``sum(sdkcore_retries_total)``
equals ``counts.retries``, and so on (rfc/0006, "Metrics").

:func:`serve` starts the endpoint: an OpenTelemetry SDK ``MeterProvider`` read by
``opentelemetry-exporter-prometheus``'s reader, served by prometheus_client's HTTP
server on 127.0.0.1, and the :class:`sdkcore.Telemetry` the demo wires into every
orchestrator, channel, breaker and budget it makes. Those packages come with the
``demo`` extra; they are imported only when ``--metrics-port`` is given.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs

from sdkcore import CircuitBreaker, HedgePolicy, Request, RetryOrchestrator
from sdkcore import _log as log_events

__all__ = [
    "SERVICE_NAME",
    "CountedBreaker",
    "CountingOrchestrator",
    "Counts",
    "MetricsEndpoint",
    "MetricsUnavailable",
    "serve",
]


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


T = TypeVar("T")

#: The OpenTelemetry resource's ``service.name`` (Prometheus: ``target_info``).
SERVICE_NAME = "sdkcore-demo"

#: A breaker's log event -> the state it entered (the telemetry's attribute values).
_ENTERED = {
    log_events.EVENT_BREAKER_OPENED: "open",
    log_events.EVENT_BREAKER_HALF_OPEN: "half_open",
    log_events.EVENT_BREAKER_CLOSED: "closed",
}


@attrs.define
class Counts:
    """The demo's tally of sdkcore's decisions (``--json``: ``counts``)."""

    #: Requests the demo's own orchestrators ran to an end (``execute`` and ``hedge``).
    requests: int = 0
    #: Retries of the requests run by ``execute`` (each one's ``retry_attempts``).
    retries: int = 0
    #: Hedged requests (``hedge``), and the copies they sent after the first.
    hedged_requests: int = 0
    hedges: int = 0
    #: Circuit breaker transitions, by the state entered (``open``, ``half_open``, ``closed``).
    breaker_transitions: Counter[str] = attrs.field(factory=Counter)
    #: Withdrawals the retry budgets refused.
    budget_rejections: int = 0
    #: The sdkcore.grpc channels (each call is an sdkcore request of the channel's own
    #: orchestrator): calls made, retries (A6 retryPolicy, pushback), hedges (A6
    #: hedgingPolicy: copies after the first) and transparent retries; warm-ups included.
    channel_calls: int = 0
    channel_retries: int = 0
    channel_hedges: int = 0
    channel_transparent_retries: int = 0
    #: The breakers and budgets the telemetry watches (it holds them weakly): kept here
    #: so that their gauges stay in the scrapes until the demo ends, --linger included.
    watched: list[Any] = attrs.field(factory=list, repr=False, eq=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "retries": self.retries,
            "hedged_requests": self.hedged_requests,
            "hedges": self.hedges,
            "breaker_transitions": {
                state: self.breaker_transitions.get(state, 0)
                for state in ("open", "half_open", "closed")
            },
            "budget_rejections": self.budget_rejections,
            "channel": {
                "calls": self.channel_calls,
                "retries": self.channel_retries,
                "hedges": self.channel_hedges,
                "transparent_retries": self.channel_transparent_retries,
            },
        }


class CountingOrchestrator(RetryOrchestrator):
    """A :class:`RetryOrchestrator` that adds each finished request to :class:`Counts`."""

    __slots__ = ("_counts",)

    def __init__(self, counts: Counts, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counts = counts

    async def execute(self, request: Request, send: Callable[[Request], Awaitable[T]]) -> T:
        try:
            return await super().execute(request, send)
        finally:
            counts = self._counts
            counts.requests += 1
            counts.retries += request.retry_attempts

    async def hedge(
        self,
        request: Request,
        send: Callable[[Request, int], Awaitable[T]],
        policy: HedgePolicy,
        **kwargs: Any,
    ) -> T:
        sent = 0

        async def counted(request: Request, index: int) -> T:
            nonlocal sent
            if index > 0:  # a copy after the first, really sent (as sdkcore.hedges counts)
                sent += 1
            return await send(request, index)

        try:
            return await super().hedge(request, counted, policy, **kwargs)
        finally:
            counts = self._counts
            counts.requests += 1
            counts.hedged_requests += 1
            # Copies booked and cut before they ran were never sent: not hedges.
            counts.hedges += sent


class CountedBreaker(CircuitBreaker):
    """A :class:`CircuitBreaker` that counts its transitions as it makes them.

    Every transition of a breaker goes through one place, the one that reports it to
    its log and its telemetry; this counts there, so no transition is missed however
    quickly the next follows.
    """

    __slots__ = ("_transitions",)

    def __init__(self, transitions: Counter[str], **settings: Any) -> None:
        super().__init__(**settings)
        self._transitions = transitions

    def _event(self, name: str, level: int, fields: dict[str, Any]) -> tuple[Any, ...]:
        self._transitions[_ENTERED[name]] += 1
        return super()._event(name, level, fields)


class MetricsUnavailable(Exception):
    """The endpoint cannot be served (a package missing, the port taken): a usage error."""


@attrs.define
class MetricsEndpoint:
    """The running endpoint: its port and the telemetry to wire in."""

    port: int
    telemetry: Any
    _server: Any = None
    _provider: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (the HTTP server and its thread) and shut the meter provider down."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        provider, self._provider = self._provider, None
        if provider is not None:
            provider.shutdown()


#: What ``--metrics-port`` needs, and how to get it.
INSTALL = (
    "pip install opentelemetry-sdk opentelemetry-exporter-prometheus (or, from a checkout: "
    "uv run --no-dev --extra demo sdkcore demo ...)"
)


def serve(port: int) -> MetricsEndpoint:
    """Serve Prometheus text at ``http://127.0.0.1:<port>/metrics`` (0: a free port).

    Raises :class:`MetricsUnavailable` naming what is missing or why the port cannot
    be bound.
    """
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.trace import NoOpTracerProvider
        from prometheus_client import REGISTRY, start_http_server
    except ImportError as exc:
        raise MetricsUnavailable(
            f"--metrics-port needs the OpenTelemetry SDK and its Prometheus exporter "
            f"(missing: {exc.name}): {INSTALL}"
        ) from exc
    from sdkcore import Telemetry

    try:
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    except OSError as exc:
        raise MetricsUnavailable(
            f"--metrics-port {port}: cannot serve on 127.0.0.1:{port}: {exc}"
        ) from exc
    reader = PrometheusMetricReader()
    provider = MeterProvider(
        metric_readers=[reader], resource=Resource.create({"service.name": SERVICE_NAME})
    )
    # Metrics only: the demo records no spans (a no-op tracer, whatever the global one is).
    telemetry = Telemetry(meter_provider=provider, tracer_provider=NoOpTracerProvider())
    return MetricsEndpoint(int(server.server_port), telemetry, server, provider)
