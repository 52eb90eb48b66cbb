"""gRPC A66/A96 metrics and A72 spans of sdkcore's channels (rfc/0008, "gRPC metrics and spans").

Every sdkcore attempt is a grpc.aio call of its own, so grpcio's OpenTelemetry plugin
sees each attempt as a call and no retry at all. A channel made with telemetry records
the standard instruments itself: one :class:`CallTrace` per application call, which
counts and times every attempt (retries, transparent retries, hedges) and the call.

Nothing here runs without telemetry: the call modules hold None and check it. Every call
into OpenTelemetry while a call runs is guarded as in :class:`sdkcore.Telemetry` (a
failing instrument, exporter or span never fails a call; the first failure of a kind is
logged). The instruments are made once per Telemetry, when its first channel is built: a
meter that raises then fails that channel's construction, as it fails ``Telemetry``'s.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from typing import Any

from .._context import CancellationReason
from .._telemetry import MAX_NAMES, MAX_TEXT, NAME, Telemetry
from ._plans import _method_name
from ._policy import time_out_at_deadline
from ._service_config import MethodName, ServiceConfig, _split_method
from ._target import canonical_target

__all__ = [
    "HEDGE_BUCKETS",
    "LATENCY_BUCKETS",
    "RETRY_BUCKETS",
    "TRANSPARENT_BUCKETS",
    "CallTrace",
    "ChannelTelemetry",
    "canonical_target",
]

# Attribute keys: A66 (metrics) and A72 (attempt spans).
METHOD = "grpc.method"
TARGET = "grpc.target"
STATUS = "grpc.status"
PREVIOUS_ATTEMPTS = "previous-rpc-attempts"
TRANSPARENT_RETRY = "transparent-retry"
#: ``grpc.method`` of a method neither registered nor named by the service config (A66).
OTHER = "other"
#: The bounds a channel's cached methods count in (``_Method.bound``).
_NAMED = "named"
_GENERIC = "generic"

#: A66 latency buckets (seconds): attempt and call durations, and A96's retry delay.
LATENCY_BUCKETS = (
    0.0, 0.00001, 0.00005, 0.0001, 0.0003, 0.0006, 0.0008, 0.001, 0.002, 0.003, 0.004,
    0.005, 0.006, 0.008, 0.01, 0.013, 0.016, 0.02, 0.025, 0.03, 0.04, 0.05, 0.065, 0.08,
    0.1, 0.13, 0.16, 0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0,
    100.0,
)  # fmt: skip
#: A96's recommended buckets.
RETRY_BUCKETS = (1, 2, 3, 4, 5)
TRANSPARENT_BUCKETS = (1, 2, 3, 4, 5, 10)
HEDGE_BUCKETS = (1, 2, 3, 4, 5)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT]


class _Instruments:
    """The seven standard instruments, made once per :class:`Telemetry` (its meter)."""

    __slots__ = (
        "attempt_duration",
        "attempt_started",
        "call_duration",
        "hedges",
        "retries",
        "retry_delay",
        "transparent_retries",
    )

    def __init__(self, meter: Any) -> None:
        self.attempt_started = meter.create_counter(
            "grpc.client.attempt.started",
            unit="{attempt}",
            description="The total number of RPC attempts started, including those that "
            "have not completed.",
        )
        self.attempt_duration = meter.create_histogram(
            "grpc.client.attempt.duration",
            unit="s",
            description="End-to-end time taken to complete an RPC attempt including the time "
            "it takes to pick a subchannel.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self.call_duration = meter.create_histogram(
            "grpc.client.call.duration",
            unit="s",
            description="Time taken by gRPC to complete an RPC from application's perspective.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )
        self.retries = meter.create_histogram(
            "grpc.client.call.retries",
            unit="{retry}",
            description="Number of retries during the client call. If there were no "
            "retries, 0 is not reported.",
            explicit_bucket_boundaries_advisory=RETRY_BUCKETS,
        )
        self.transparent_retries = meter.create_histogram(
            "grpc.client.call.transparent_retries",
            unit="{transparent_retry}",
            description="Number of transparent retries during the client call. If there "
            "were no transparent retries, 0 is not reported.",
            explicit_bucket_boundaries_advisory=TRANSPARENT_BUCKETS,
        )
        self.hedges = meter.create_histogram(
            "grpc.client.call.hedges",
            unit="{hedge}",
            description="Number of hedges during the client call. If there were no hedges, "
            "0 is not reported.",
            explicit_bucket_boundaries_advisory=HEDGE_BUCKETS,
        )
        self.retry_delay = meter.create_histogram(
            "grpc.client.call.retry_delay",
            unit="s",
            description="Total time of delay while there is no active attempt during the "
            "client call.",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS,
        )


_by_telemetry: weakref.WeakKeyDictionary[Telemetry, _Instruments] = weakref.WeakKeyDictionary()
_by_telemetry_lock = threading.Lock()


def _instruments(telemetry: Telemetry) -> _Instruments:
    """The gRPC instruments of ``telemetry`` (made on its meter the first time)."""
    with _by_telemetry_lock:
        found = _by_telemetry.get(telemetry)
        if found is None:
            found = _by_telemetry[telemetry] = _Instruments(telemetry.meter)
        return found


class _Method:
    """What a method's calls record: its attributes, with each status, and its span names."""

    __slots__ = ("_statuses", "attempt_span", "attributes", "bound", "call_span", "name")

    def __init__(self, recorded: str, target: str, full_name: str, bound: str = "") -> None:
        #: The channel's bound its cache entry counts in (``_NAMED``, ``_GENERIC``), or "".
        self.bound = bound
        #: ``grpc.method`` and ``grpc.target`` (shared by every call: never mutated).
        self.attributes = {METHOD: recorded, TARGET: target}
        #: Its calls' ``sdkcore.request.name``: ``/`` and ``grpc.method`` (``/other`` for
        #: a generic method: bounded as A66 bounds ``grpc.method``, so generic methods do
        #: not use up the names an application's own requests are recorded by).
        self.name = "/" + recorded
        self._statuses: dict[str, dict[str, str]] = {}
        # A72: "Sent.<service>.<method>" and "Attempt.<service>.<method>".
        dotted = full_name.lstrip("/").replace("/", ".")
        self.call_span = "Sent." + dotted
        self.attempt_span = "Attempt." + dotted

    def with_status(self, status: str) -> dict[str, str]:
        """The attributes plus ``grpc.status`` (one dict per status, made once)."""
        found = self._statuses.get(status)
        if found is None:
            found = self._statuses[status] = {**self.attributes, STATUS: status}
        return found


class ChannelTelemetry:
    """One channel's telemetry: the instruments, its ``grpc.target``, its methods.

    ``grpc.method`` (A66): a method's full name (``pkg.Service/Method``) when the
    channel knows it: registered by a generated stub (``_registered_method=True``, what
    grpcio-tools' stubs pass) or named by the service config (a ``methodConfig`` name
    with that service, with or without the method; the catch-all ``{}`` does not name
    it). Any other method, a generic call, is recorded as ``other``, as A66 asks of
    generic methods. A registered method is always recorded by its name (A66: "pre-registered
    methods will always be recorded"); at most :data:`MAX_NAMES` methods the service config
    names are, and generic calls never use up that bound (they are counted apart).
    """

    __slots__ = (
        "_generic",
        "_lock",
        "_methods",
        "_named",
        "config",
        "instruments",
        "registered",
        "target",
        "telemetry",
    )

    def __init__(
        self, telemetry: Telemetry, target: str, service_config: ServiceConfig | None
    ) -> None:
        self.telemetry = telemetry
        self.instruments = _instruments(telemetry)
        self.target = canonical_target(target)  # whole, as A66 has it (no length limit)
        self.config = service_config
        #: Full names (``/pkg.Service/Method``) registered by generated stubs.
        self.registered: set[str] = set()
        self._methods: dict[Any, _Method] = {}
        #: Methods cached as named by the service config, and as ``other``: each bounded
        #: by MAX_NAMES on its own (a proxy's thousand generic paths must not turn a
        #: stub's or the config's methods into ``other``).
        self._named = 0
        self._generic = 0
        self._lock = threading.Lock()

    def register(self, method: Any) -> None:
        """A generated stub's method (``_registered_method=True``): recorded by its name."""
        name = _method_name(method)
        with self._lock:
            self.registered.add(name)
            # A call before may have cached it as "other" or as named by the config, under
            # either form grpc.aio hands a method in (str from a stub, bytes through the
            # interceptors): it is a registered method's now, outside both bounds.
            for key in (name, name.encode()):
                cached = self._methods.pop(key, None)
                if cached is not None:
                    if cached.bound == _GENERIC:
                        self._generic -= 1
                    elif cached.bound == _NAMED:
                        self._named -= 1

    def method(self, method: Any) -> _Method:
        found = self._methods.get(method)
        if found is not None:
            return found
        name = _method_name(method)
        with self._lock:
            found = self._methods.get(method)  # another thread's, made meanwhile
            if found is not None:
                return found
            if name in self.registered:  # always by name, and always cached
                found = self._methods[method] = _Method(name.lstrip("/"), self.target, name)
            elif self._named < MAX_NAMES and self._named_by_config(name):
                found = _Method(name.lstrip("/"), self.target, name, _NAMED)
                self._methods[method] = found
                self._named += 1
            elif self._generic < MAX_NAMES:
                found = self._methods[method] = _Method(OTHER, self.target, name, _GENERIC)
                self._generic += 1
            else:
                found = _Method(OTHER, self.target, name)  # not cached: made per call
        return found

    def _named_by_config(self, name: str) -> bool:
        config = self.config
        if config is None:
            return False
        service, method = _split_method(name)
        if not service:
            return False
        index = config._index
        return MethodName(service, method) in index or MethodName(service, "") in index

    def call(self, method: Any, request: Any, started: float) -> CallTrace:
        """The telemetry of a call starting now (``request``: its sdkcore Request)."""
        return CallTrace(self, self.method(method), request, started)


class _Attempt:
    """One attempt: its span (or None) and when it started."""

    __slots__ = ("ended", "span", "started")

    def __init__(self, span: Any, started: float) -> None:
        self.span = span
        self.started = started
        self.ended = False


def status_of(error: BaseException | None) -> tuple[str, str]:
    """(``grpc.status``, details) of a call or attempt that ended with ``error``."""
    if error is None:
        return "OK", ""
    code = getattr(error, "code", None)
    if callable(code):
        try:
            status = code()
            return status.name, str(error.details() or "")  # type: ignore[attr-defined]
        except Exception:  # not an AioRpcError after all
            pass
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED", "Locally cancelled by application!"
    return "UNKNOWN", f"{type(error).__name__}: {error}"


class CallTrace:
    """One application call's telemetry (made by :meth:`ChannelTelemetry.call`).

    The call is an sdkcore request from its start (``request``): its ``Sent.`` span is
    that request's span (adopted by :meth:`Telemetry.begin`), so the orchestrator's retry
    events, outcome and core metrics land there as for any request. Each attempt is a
    child ``Attempt.`` span with A72's ``previous-rpc-attempts`` and ``transparent-retry``,
    current while its grpc.aio call is created (:meth:`enter`/:meth:`leave`): the
    call's task, and the application's interceptors, run under it.

    Recorded per attempt: ``grpc.client.attempt.started`` when it starts,
    ``grpc.client.attempt.duration`` when it ends (with its ``grpc.status``). Once per
    call, at its end (:meth:`end`): ``grpc.client.call.duration`` (the call's status),
    ``grpc.client.call.retries``/``transparent_retries``/``hedges`` when not 0 and
    ``grpc.client.call.retry_delay`` (the time with no attempt in flight).
    """

    __slots__ = (
        "_idle_since",
        "active",
        "attempts",
        "channel",
        "current",
        "delay",
        "ended",
        "hedges",
        "method",
        "open",
        "request",
        "span",
        "started",
        "trace",
        "transparent",
    )

    def __init__(
        self, channel: ChannelTelemetry, method: _Method, request: Any, started: float
    ) -> None:
        self.channel = channel
        self.method = method
        self.request = request
        self.started = started
        self.ended = False
        #: Attempts started: A6 attempts (the first included), transparent, hedges after the first.
        self.attempts = 0
        self.transparent = 0
        self.hedges = 0
        self.active = 0
        self.delay = 0.0
        self._idle_since = -1.0
        self.current: _Attempt | None = None
        self.open: list[_Attempt] = []
        telemetry = channel.telemetry
        span = None
        try:
            trace = telemetry._trace
            span = telemetry.tracer.start_span(
                method.call_span,
                kind=trace.SpanKind.CLIENT,
                attributes={NAME: telemetry.name(method.name), "sdkcore.request.id": request.id},
            )
        except Exception as exc:
            telemetry._failure("span", exc)
        self.span = span
        self.trace = telemetry.begin(request, span=span, name=method.name)
        self.trace.rpc = True  # error.type: the status code's name (RequestTrace.end)

    # -- attempts ------------------------------------------------------------------
    def attempt(self, previous: int, transparent: bool = False, hedge: bool = False) -> _Attempt:
        """An attempt starts (``previous``: its ``grpc-previous-rpc-attempts``); its handle.

        ``transparent``: an A6 transparent retry; ``hedge``: a hedge after the first.
        """
        now = time.monotonic()
        if self.active == 0 and self._idle_since >= 0.0:
            self.delay += now - self._idle_since
        self.active += 1
        if transparent:
            self.transparent += 1
        elif hedge:
            self.hedges += 1
            self.trace.hedge_sent()  # sdkcore.hedges: a copy made (the chain counts none here)
        else:
            self.attempts += 1
        channel = self.channel
        telemetry = channel.telemetry
        try:
            channel.instruments.attempt_started.add(1, self.method.attributes)
        except Exception as exc:
            telemetry._failure("grpc.client.attempt.started", exc)
        span = None
        parent = self.span
        if parent is not None:
            try:
                trace = telemetry._trace
                span = telemetry.tracer.start_span(
                    self.method.attempt_span,
                    context=trace.set_span_in_context(parent),
                    attributes={PREVIOUS_ATTEMPTS: previous, TRANSPARENT_RETRY: transparent},
                )
            except Exception as exc:
                telemetry._failure("span", exc)
        attempt = self.current = _Attempt(span, now)
        self.open.append(attempt)
        return attempt

    def enter(self, attempt: _Attempt | None) -> Any:
        """Make ``attempt``'s span current (while its grpc.aio call is created); a token."""
        if attempt is None or attempt.span is None:
            return None
        telemetry = self.channel.telemetry
        try:
            return telemetry._context.attach(telemetry._trace.set_span_in_context(attempt.span))
        except Exception as exc:
            telemetry._failure("context", exc)
            return None

    def leave(self, token: Any) -> None:
        """Undo :meth:`enter` (same task, at once)."""
        if token is not None:
            telemetry = self.channel.telemetry
            try:
                telemetry._context.detach(token)
            except Exception as exc:
                telemetry._failure("context", exc)

    def attempt_end(self, attempt: _Attempt | None, error: BaseException | None) -> None:
        """``attempt`` ended (``error``: its AioRpcError, CancelledError, or None for OK)."""
        if attempt is None or attempt.ended:
            return
        status, details = status_of(error)
        self._attempt_end(attempt, status, details)

    def attempt_lost(self, attempt: _Attempt | None, why: str) -> None:
        """A hedge's ``attempt`` cut because another attempt decided the call (it committed,
        or its fatal status ended the call): CANCELLED with ``why``, as grpc-java ends a
        losing hedge, not as an application's cancel (rfc/0008)."""
        if attempt is None or attempt.ended:
            return
        self._attempt_end(attempt, "CANCELLED", why)

    def _attempt_end(self, attempt: _Attempt, status: str, details: str) -> None:
        attempt.ended = True
        now = time.monotonic()
        self.open.remove(attempt)  # every attempt is in open once, until it ends
        self.active -= 1
        if self.active == 0:
            self._idle_since = now
        channel = self.channel
        telemetry = channel.telemetry
        try:
            channel.instruments.attempt_duration.record(
                now - attempt.started, self.method.with_status(status)
            )
        except Exception as exc:
            telemetry._failure("grpc.client.attempt.duration", exc)
        _end_span(telemetry, attempt.span, status, details)

    # -- the call --------------------------------------------------------------------
    def end(self, error: BaseException | None) -> None:
        """The call ended (``error``: what the application gets, None for OK). Once.

        Attempts still open end with the call's status. The call's sdkcore request, if
        no door completed it, completes here (succeeded, failed, or cancelled).
        """
        if self.ended:
            return
        self.ended = True
        request = self.request
        status, details = status_of(error)
        if (
            error is not None
            and request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
        ):
            # call.cancel() while waiting to retry, or the channel's close(): as grpc.aio.
            status, details = "CANCELLED", "Locally cancelled by application!"
            # What the application gets for a cancelled call (the call object raises it in
            # place of the last attempt's error it ended with here).
            error = asyncio.CancelledError()
        for attempt in list(self.open):
            self._attempt_end(attempt, status, details)
        now = time.monotonic()
        channel = self.channel
        telemetry = channel.telemetry
        inst = channel.instruments
        attributes = self.method.attributes
        # One guard per instrument: one that raises loses only its own records, and the
        # warning names it (a review: one guard lost all five to a raising call.duration).
        try:
            inst.call_duration.record(now - self.started, self.method.with_status(status))
        except Exception as exc:
            telemetry._failure("grpc.client.call.duration", exc)
        retries = self.attempts - 1
        if retries > 0:
            try:
                inst.retries.record(retries, attributes)
            except Exception as exc:
                telemetry._failure("grpc.client.call.retries", exc)
        if self.transparent > 0:
            try:
                inst.transparent_retries.record(self.transparent, attributes)
            except Exception as exc:
                telemetry._failure("grpc.client.call.transparent_retries", exc)
        if self.hedges > 0:
            try:
                inst.hedges.record(self.hedges, attributes)
            except Exception as exc:
                telemetry._failure("grpc.client.call.hedges", exc)
        try:
            inst.retry_delay.record(self.delay, attributes)
        except Exception as exc:
            telemetry._failure("grpc.client.call.retry_delay", exc)
        trace = self.trace
        if not trace.ended:
            if not request.completed:
                if error is None:
                    request._succeeded()
                else:
                    time_out_at_deadline(request, error, book=False)  # its own deadline
                    request._finish_by(error)  # (does nothing once timed out)
            trace.end(request, error)
        _end_span(telemetry, self.span, status, details)


def _end_span(telemetry: Telemetry, span: Any, status: str, details: str) -> None:
    """End ``span`` with the gRPC status (A72): ``grpc.status``; the span's status OK for
    OK, else ERROR described as ``<STATUS>, <details>`` (A72's "UNAVAILABLE, unable to
    resolve host")."""
    if span is None:
        return
    try:
        span.set_attribute(STATUS, status)
        trace = telemetry._trace
        if status == "OK":
            span.set_status(trace.Status(trace.StatusCode.OK))
        else:
            text = f"{status}, {details}" if details else status
            span.set_status(trace.Status(trace.StatusCode.ERROR, _cut(text)))
        span.end()
    except Exception as exc:
        telemetry._failure("span", exc)
