"""OpenTelemetry metrics and traces for every door (rfc/0008).

:class:`Telemetry` holds sdkcore's instruments (instrumentation scope ``sdkcore``)
and its tracer, made once from the OpenTelemetry API (the ``otel`` extra, API
only: the application picks the SDK and exporters). ``None`` providers mean the
global ones, so an application's own setup, or ``opentelemetry-instrument``, is
used as it is.

The doors reach it through one object per request, :class:`RequestTrace`, made at
the request's first attempt and kept on the request (``Request._trace``); a door
without telemetry holds None there and pays one comparison per call. Every call
into OpenTelemetry goes through :meth:`Telemetry._guard`: an instrument, exporter or
span that raises never fails or delays a request (logged once per kind, event
``telemetry.failed``).

Names, units and attributes are fixed (dashboards rely on them): see rfc/0008.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar, TypeVar

from . import _log
from ._breaker import CircuitBreaker
from ._budget import RetryBudget
from ._context import CancellationReason
from ._errors import CouchbaseException, RequestCanceledException, RetryableError
from ._latency import LatencyQuantile
from ._log import EVENT_TELEMETRY_FAILED
from ._permits import Permits
from ._reason import RetryReason
from ._retry_state import RequestState
from ._threshold import ThresholdReporter
from ._throttle import AdaptiveThrottle

__all__ = ["MAX_NAMES", "MAX_TEXT", "RequestTrace", "Telemetry", "outcome_of"]

T = TypeVar("T")

#: Which telemetry each watched target reports to (the last to watch it).
_WATCHED_BY: weakref.WeakKeyDictionary[Any, Telemetry] = weakref.WeakKeyDictionary()


def watched_by(target: Any) -> Telemetry | None:
    """The Telemetry that watches ``target`` now, if any (:meth:`Telemetry.watch`)."""
    return _WATCHED_BY.get(target)


#: ``Telemetry.begin(span=...)`` not given: the trace starts the request's span itself.
_OWN_SPAN: Any = object()

#: Distinct request names recorded as themselves; later new names are ``other``.
MAX_NAMES = 1000
#: Attribute texts (names, error types) are cut at this many characters.
MAX_TEXT = 100

SCOPE = "sdkcore"

# Attribute keys (rfc/0008).
NAME = "sdkcore.request.name"
OUTCOME = "sdkcore.request.outcome"
ERROR_TYPE = "error.type"
REASON = "sdkcore.retry.reason"
ENDPOINT = "sdkcore.endpoint"
BREAKER_STATE = "sdkcore.circuit_breaker.state"
ATTEMPT_NUMBER = "sdkcore.attempt.number"
HEDGE_INDEX = "sdkcore.hedge.index"

_PENDING = RequestState.PENDING
_SUCCEEDED = RequestState.SUCCEEDED

_STATE_VALUE = {"closed": 0, "open": 1, "half_open": 2}

# Seconds buckets for durations and delays: 0.1 ms to 60 s (OpenTelemetry's default
# buckets start at 0 and 5, in the unit: useless for seconds).
_SECONDS_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
_RETRY_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20, 50)


def outcome_of(request: Any) -> str:
    """``success``, ``timeout``, ``cancelled`` or ``failure``, from the request's ending."""
    state = request.state
    if state is RequestState.SUCCEEDED:
        return "success"
    why = request.cancellation_reason
    if state is RequestState.CANCELLED:
        if why is CancellationReason.TIMEOUT:
            return "timeout"
        if (
            why is CancellationReason.CANCELLED_VIA_CONTEXT
            or why is CancellationReason.TASK_CANCELLED
        ):
            return "cancelled"
    return "failure"


def _seconds(delay: Any) -> float | None:
    """A timedelta in seconds; None stays None (no point)."""
    return None if delay is None else float(delay.total_seconds())


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT]


class _Watched:
    """The watched targets of every :class:`Telemetry` on one meter provider, and their labels.

    OpenTelemetry makes one instrument per name in a meter: a second Telemetry on the
    same provider that registered its own observable gauges got the first's instruments
    back, its callbacks dropped, and its breakers' states were never reported. So the
    observable instruments are made once per provider, by its first Telemetry, and read
    this one set; labels are told apart across all of them (see :meth:`Telemetry.watch`).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.observing = False  # the observable instruments are made (by the first Telemetry)
        self.breakers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.budgets: weakref.WeakSet[Any] = weakref.WeakSet()
        self.limiters: weakref.WeakSet[Any] = weakref.WeakSet()
        self.throttles: weakref.WeakSet[Any] = weakref.WeakSet()
        self.quantiles: weakref.WeakSet[Any] = weakref.WeakSet()
        # Each watched target's sdkcore.endpoint value, distinct within its kind (see watch).
        self.labels: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        # The name each was labelled from ("" for none): watching it again with it keeps it.
        self.named_as: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        # Per kind (its group's id): how many "unnamed-N" labels were handed out.
        self.unnamed: dict[int, int] = {}
        # Per kind: the distinct labels handed out (at most MAX_NAMES; past it, "other").
        self.handed: dict[int, set[str]] = {}
        # Request names as given -> their metric attributes and request.duration's on
        # success, made once and shared by every Telemetry on the provider, and the
        # distinct names recorded as themselves (at most MAX_NAMES: Telemetry.name).
        self.named: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
        self.distinct = 0

    def groups(self) -> tuple[weakref.WeakSet[Any], ...]:
        return self.breakers, self.budgets, self.limiters, self.throttles, self.quantiles


#: The global providers' (``meter_provider=None``), and each provider's by the provider.
_GLOBAL_WATCHED = _Watched()
_WATCHED: weakref.WeakKeyDictionary[Any, _Watched] = weakref.WeakKeyDictionary()
#: Providers that cannot be weakly referenced, by identity (id -> (provider, set)): kept
#: for the life of the process, as an application keeps its provider.
_HELD: dict[int, tuple[Any, _Watched]] = {}
_WATCHED_LOCK = threading.Lock()


def _found(provider: Any) -> _Watched | None:
    try:
        return _WATCHED.get(provider)
    except TypeError:  # not weakly referenceable (nor, perhaps, hashable)
        held = _HELD.get(id(provider))
        return None if held is None else held[1]


def _kept(provider: Any, watched: _Watched) -> _Watched:
    try:
        _WATCHED[provider] = watched
    except TypeError:
        _HELD[id(provider)] = (provider, watched)
    return watched


def _watched_for(meter_provider: Any, global_provider: Any) -> _Watched:
    """The :class:`_Watched` of ``meter_provider`` (None: the global one, ``global_provider``).

    One per provider, whichever way a Telemetry names it: a provider given by name that
    is the global one now shares the global providers' set once a Telemetry made on them
    observes (its instruments, made on the API's proxy, now feed this provider); the
    global providers' (None) is a provider's own set when one was made for it by name
    before it became the global one. A provider that cannot be weakly referenced is
    kept by identity for the life of the process.
    """
    with _WATCHED_LOCK:
        if meter_provider is None:
            found = _found(global_provider)
            return _GLOBAL_WATCHED if found is None else found
        if meter_provider is global_provider and _GLOBAL_WATCHED.observing:
            return _GLOBAL_WATCHED
        found = _found(meter_provider)
        return _kept(meter_provider, _Watched()) if found is None else found


class Telemetry:
    """sdkcore's OpenTelemetry instruments and tracer (rfc/0008).

    ``RetryOrchestrator(telemetry=Telemetry())`` records every request of that
    orchestrator, on every door; an sdkcore gRPC channel uses its orchestrator's.
    ``meter_provider``/``tracer_provider``: None for the global providers.
    ``threshold_reporter``: a :class:`ThresholdReporter` fed every finished request's
    duration (RFC 67 threshold logging), None for none. Breakers, budgets, limiters,
    throttles and learned hedge delays report once watched (:meth:`watch`); an
    orchestrator watches its own retry budget, and an sdkcore gRPC channel its limiter
    and throttle.
    """

    #: :class:`RequestTrace`, for the doors of the core: they make a request's trace as
    #: ``telemetry._request_trace(telemetry, request)``, one call less per request than
    #: :meth:`begin`, without importing this module (``import sdkcore`` does not load it).
    _request_trace: ClassVar[type[RequestTrace]]

    def __init__(
        self,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        *,
        threshold_reporter: ThresholdReporter | None = None,
    ) -> None:
        try:
            from opentelemetry import context as otel_context
            from opentelemetry import metrics, trace
        except ImportError as exc:  # pragma: no cover - depends on the environment
            from ._install import install_hint

            raise ImportError(
                f"sdkcore.Telemetry needs the opentelemetry-api package: "
                f"{install_hint('opentelemetry')}"
            ) from exc
        from ._version import __version__

        if meter_provider is not None and not callable(getattr(meter_provider, "get_meter", None)):
            raise TypeError(
                "Telemetry(meter_provider=...) must be an OpenTelemetry MeterProvider (with "
                f"get_meter) or None for the global one, got {meter_provider!r}"
            )
        if tracer_provider is not None and not callable(
            getattr(tracer_provider, "get_tracer", None)
        ):
            raise TypeError(
                "Telemetry(tracer_provider=...) must be an OpenTelemetry TracerProvider (with "
                f"get_tracer) or None for the global one, got {tracer_provider!r}"
            )
        if threshold_reporter is not None and not isinstance(threshold_reporter, ThresholdReporter):
            raise TypeError(
                "Telemetry(threshold_reporter=...) must be an sdkcore.ThresholdReporter or None, "
                f"got {threshold_reporter!r}"
            )
        #: Every finished request is also recorded there (Couchbase threshold logging).
        self.threshold_reporter = threshold_reporter
        self._trace = trace
        self._client = trace.SpanKind.CLIENT
        self._other = ({NAME: "other"}, {NAME: "other", OUTCOME: "success"})
        self._context = otel_context
        self.meter: Any = (
            metrics.get_meter(SCOPE, __version__)
            if meter_provider is None
            else meter_provider.get_meter(SCOPE, __version__)
        )
        self.tracer: Any = (
            trace.get_tracer(SCOPE, __version__)
            if tracer_provider is None
            else tracer_provider.get_tracer(SCOPE, __version__)
        )
        self._lock = threading.Lock()
        self._failed: set[str] = set()
        # Shared with every Telemetry on the same meter provider (see _Watched).
        w = self._watched = _watched_for(meter_provider, metrics.get_meter_provider())
        # The provider's request names (bounded across its Telemetry objects, as labels
        # are), read once per request: the dict itself, not a copy.
        self._named = w.named
        m = self.meter
        self.request_duration = m.create_histogram(
            "sdkcore.request.duration",
            unit="s",
            description="Duration of each finished request, from its creation to its end",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.request_retries = m.create_histogram(
            "sdkcore.request.retries",
            unit="{retry}",
            description="Retries of each finished request (0 included)",
            explicit_bucket_boundaries_advisory=_RETRY_BUCKETS,
        )
        self.retries = m.create_counter(
            "sdkcore.retries", unit="{retry}", description="Retries scheduled, by reason"
        )
        self.retry_delay = m.create_histogram(
            "sdkcore.retry.delay",
            unit="s",
            description="The wait before each scheduled retry",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.hedges = m.create_counter(
            "sdkcore.hedges", unit="{hedge}", description="Hedged copies sent after the first"
        )
        self.hedge_wins = m.create_counter(
            "sdkcore.hedge.wins",
            unit="{request}",
            description="Hedged requests whose answer came from a copy other than the first",
        )
        self.breaker_transitions = m.create_counter(
            "sdkcore.circuit_breaker.transitions",
            unit="{transition}",
            description="Circuit breaker state changes, by new state",
        )
        self.breaker_rejections = m.create_counter(
            "sdkcore.circuit_breaker.rejections",
            unit="{dispatch}",
            description="Dispatches a circuit breaker refused (nothing was sent)",
        )
        self.budget_rejections = m.create_counter(
            "sdkcore.retry_budget.rejections",
            unit="{retry}",
            description="Retries a retry budget refused",
        )
        self.limiter_rejections = m.create_counter(
            "sdkcore.concurrency_limiter.rejections",
            unit="{dispatch}",
            description="Dispatches a concurrency limiter refused (nothing was sent)",
        )
        with w.lock:
            if not w.observing:
                self._observe(m)
                w.observing = True

    def _observe(self, m: Any) -> None:
        """Make the observable instruments on meter ``m`` (once per provider: see _Watched)."""
        w = self._watched
        m.create_observable_gauge(
            "sdkcore.concurrency_limiter.limit",
            callbacks=[self._observer(w.limiters, lambda limiter: limiter.limit)],
            unit="{dispatch}",
            description="A concurrency limiter's current limit (an adaptive one's moves)",
        )
        m.create_observable_gauge(
            "sdkcore.concurrency_limiter.in_flight",
            callbacks=[self._observer(w.limiters, lambda limiter: limiter.in_flight)],
            unit="{dispatch}",
            description="Dispatches a concurrency limiter holds a permit for now",
        )
        m.create_observable_gauge(
            "sdkcore.concurrency_limiter.queued",
            callbacks=[self._observer(w.limiters, lambda limiter: limiter.queued)],
            unit="{dispatch}",
            description="Callers waiting in a concurrency limiter's queue now",
        )
        m.create_observable_gauge(
            "sdkcore.throttle.rejection_probability",
            callbacks=[
                self._observer(w.throttles, lambda throttle: throttle.rejection_probability)
            ],
            unit="1",
            description="The probability a client-side throttle refuses a new request now",
        )
        m.create_observable_counter(
            "sdkcore.throttle.rejections",
            callbacks=[self._observer(w.throttles, lambda throttle: throttle.refused)],
            unit="{request}",
            description="Requests a client-side throttle refused locally",
        )
        m.create_observable_gauge(
            "sdkcore.hedge.delay",
            callbacks=[
                self._observer(
                    w.quantiles,
                    lambda quantile: _seconds(quantile.current_delay),
                )
            ],
            unit="s",
            description="The learned hedging delay (LatencyQuantile), once it has one",
        )
        m.create_observable_gauge(
            "sdkcore.circuit_breaker.state",
            callbacks=[
                self._observer(w.breakers, lambda breaker: _STATE_VALUE[breaker.state.value])
            ],
            unit="1",
            description="Circuit breaker state: 0 closed, 1 open, 2 half-open",
        )
        m.create_observable_gauge(
            "sdkcore.retry_budget.balance",
            callbacks=[
                self._observer(
                    w.budgets,
                    lambda budget: budget.balance,
                )
            ],
            unit="{retry}",
            description="Retries a retry budget would allow now",
        )

    def __repr__(self) -> str:
        return f"<Telemetry meter={self.meter!r} tracer={self.tracer!r}>"

    # -- breakers and budgets ---------------------------------------------------------
    def watch(self, target: Any, *, name: str | None = None) -> Any:
        """Report a breaker, budget, limiter, throttle or hedge delay through this telemetry.

        ``target``: a :class:`CircuitBreaker`, :class:`RetryBudget`,
        :class:`ConcurrencyLimiter` / :class:`AdaptiveConcurrencyLimiter`,
        :class:`AdaptiveThrottle` or :class:`LatencyQuantile`. Returns ``target``. It
        reports to one telemetry at a time (the last that watched it), which holds it
        weakly; its gauges are read at each collection.

        Its series carry ``sdkcore.endpoint``: the target's own name (cut at
        :data:`MAX_TEXT` characters), else ``name``. Two watched targets of one kind
        never share a series, so an open breaker cannot hide behind a closed one:

        * a target with neither (an unnamed breaker, a LatencyQuantile watched without
          ``name``) is labelled ``unnamed-1``, ``unnamed-2``, ... in the order this
          telemetry first watched it, counted per kind (breakers, budgets, limiters,
          throttles, hedge delays); a number is never handed out twice;
        * a label another live target of the same kind already has here gets ``#2``,
          ``#3``, ... appended (two breakers both named ``10.0.0.7:11210``);
        * "here" is the meter provider: every Telemetry on it shares the labels (and
          one set of gauges); past :data:`MAX_NAMES` labels of one kind, a new target
          is ``other``.

        The label is kept while the target stays watched here (watching it again
        changes nothing, unless ``name`` gives an unnamed target a new one). ``name``
        for a target that has a name of its own must be that name (else ValueError).

        Each counter of the target (a breaker's transitions, one series per state, and
        rejections; a budget's or a limiter's rejections) is started at 0 for its label
        here, so its series exists from the first collection and ``rate()`` sees the
        first burst.
        """
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Telemetry.watch(name=...) must be a str or None, got {name!r}")
        own: str | None
        if isinstance(target, CircuitBreaker):
            watched: weakref.WeakSet[Any] = self._watched.breakers
            own = target.name
        elif isinstance(target, RetryBudget):
            watched = self._watched.budgets
            own = target._name
        elif isinstance(target, Permits):
            watched = self._watched.limiters
            own = target.name
        elif isinstance(target, AdaptiveThrottle):
            watched = self._watched.throttles
            own = target.name
        elif isinstance(target, LatencyQuantile):
            watched = self._watched.quantiles
            own = None
        else:
            raise TypeError(
                "Telemetry.watch(target): target must be an sdkcore.CircuitBreaker, "
                "RetryBudget, ConcurrencyLimiter, AdaptiveConcurrencyLimiter, AdaptiveThrottle "
                f"or LatencyQuantile, got {target!r}"
            )
        if own and name is not None and name != own:
            raise ValueError(
                f"Telemetry.watch(name={name!r}): the {type(target).__name__} is named "
                f"{own!r}, and its own name labels its series; omit name= or pass that name"
            )
        previous = _WATCHED_BY.get(target)
        if previous is not None and previous._watched is not self._watched:
            for group in previous._watched.groups():
                group.discard(target)
        _WATCHED_BY[target] = self
        with self._watched.lock:
            self._label(watched, target, own or name)
            watched.add(target)
        self._zero_counters(target)
        if not isinstance(target, (AdaptiveThrottle, LatencyQuantile)):
            target._telemetry = self  # it calls back on its transitions and refusals
        return target

    def _zero_counters(self, target: Any) -> None:
        """Start each of ``target``'s counter series at 0 (``add(0)``), as it is watched.

        A counter series appears at its first add: one first scraped at N shows no
        increase, so Prometheus' ``rate()``/``increase()`` would miss the first burst of
        transitions or refusals. Started at 0, each series is there from the first
        collection. (The throttle's refusals are observed, a point at every collection.)
        """
        endpoint = self._watched.labels.get(target, "")
        counters: list[tuple[str, Any, dict[str, str]]]
        if isinstance(target, CircuitBreaker):
            counters = [
                (
                    "circuit_breaker.transitions",
                    self.breaker_transitions,
                    {ENDPOINT: endpoint, BREAKER_STATE: state},
                )
                for state in _STATE_VALUE
            ]
            counters.append(
                ("circuit_breaker.rejections", self.breaker_rejections, {ENDPOINT: endpoint})
            )
        elif isinstance(target, RetryBudget):
            counters = [("retry_budget.rejections", self.budget_rejections, {ENDPOINT: endpoint})]
        elif isinstance(target, Permits):
            counters = [
                ("concurrency_limiter.rejections", self.limiter_rejections, {ENDPOINT: endpoint})
            ]
        else:  # a throttle (observed) or a hedge delay (no counter)
            return
        for kind, counter, attributes in counters:
            self._guard(kind, counter.add, 0, attributes)

    def _label(self, group: weakref.WeakSet[Any], target: Any, name: str | None) -> None:
        """Give ``target`` its ``sdkcore.endpoint`` value in ``group`` (under the lock)."""
        w = self._watched
        labels = w.labels
        if (
            target in group
            and labels.get(target) is not None
            and (name is None or name == w.named_as.get(target))
        ):
            return  # watched here already: its label stays
        w.named_as[target] = name or ""
        kind = id(group)
        taken = {labels.get(other) for other in group if other is not target}
        if not name:
            while True:
                n = w.unnamed.get(kind, 0) + 1
                w.unnamed[kind] = n
                label = f"unnamed-{n}"
                if label not in taken:  # an explicit name could be "unnamed-1"
                    break
        else:
            base = label = _cut(name)
            n = 1
            while label in taken:
                n += 1
                suffix = f"#{n}"
                label = base[: MAX_TEXT - len(suffix)] + suffix
        # Bounded: at most MAX_NAMES distinct labels per kind (each is a series the SDK
        # keeps for good); a label handed out before costs nothing (a client made again
        # under its name), a new one past the bound is "other".
        seen = w.handed.setdefault(kind, set())
        if label not in seen:
            if len(seen) >= MAX_NAMES:
                label = "other"
            else:
                seen.add(label)
        labels[target] = label

    def label(self, target: Any) -> str:
        """The ``sdkcore.endpoint`` value ``target``'s series carry on this telemetry's
        meter provider (see :meth:`watch`); ``""`` for a target no telemetry on it watched."""
        return self._watched.labels.get(target, "")

    def _observer(
        self, group: weakref.WeakSet[Any], read: Callable[[Any], float | None]
    ) -> Callable[[Any], Iterable[Any]]:
        """An observable instrument's callback: ``read`` of each watched target in ``group``
        (None: no point), with ``sdkcore.endpoint`` its label (see :meth:`watch`)."""
        labels = self._watched.labels

        def observe(options: Any) -> Iterable[Any]:
            from opentelemetry.metrics import Observation

            out = []
            for target in list(group):
                value = read(target)
                if value is not None:
                    out.append(Observation(value, {ENDPOINT: labels.get(target, "")}))
            return out

        return observe

    def limiter_rejected(self, limiter: Any) -> None:
        attributes = {ENDPOINT: self._watched.labels.get(limiter, "")}
        self._guard("concurrency_limiter.rejections", self.limiter_rejections.add, 1, attributes)

    def breaker_transition(self, breaker: Any, state: str) -> None:
        """A watched breaker changed state (``closed``, ``open``, ``half_open``)."""
        attributes = {ENDPOINT: self._watched.labels.get(breaker, ""), BREAKER_STATE: state}
        self._guard("circuit_breaker.transitions", self.breaker_transitions.add, 1, attributes)

    def breaker_rejected(self, breaker: Any) -> None:
        attributes = {ENDPOINT: self._watched.labels.get(breaker, "")}
        self._guard("circuit_breaker.rejections", self.breaker_rejections.add, 1, attributes)

    def budget_rejected(self, budget: Any) -> None:
        attributes = {ENDPOINT: self._watched.labels.get(budget, "")}
        self._guard("retry_budget.rejections", self.budget_rejections.add, 1, attributes)

    # -- requests -----------------------------------------------------------------------
    def name(self, name: str) -> str:
        """``name`` as an attribute value: cut, and ``other`` past :data:`MAX_NAMES`."""
        return self._named_attributes(name)[0][NAME]

    def _named_attributes(self, name: str) -> tuple[dict[str, str], dict[str, str]]:
        """A request name's metric attributes and its success attributes, shared.

        Made once per name: every request of that name records with the same two
        dicts (OpenTelemetry copies what it keeps). Names are cut at :data:`MAX_TEXT`;
        past :data:`MAX_NAMES` distinct ones on the meter provider (every Telemetry on it
        together, as labels), a new name is ``other``. The map holds at
        most ``4 * MAX_NAMES`` names as given (long names and late ones map to a
        shared entry), so it stays bounded whatever names requests carry.
        """
        named = self._named.get(name)
        if named is not None:
            return named
        cut = _cut(name)
        w = self._watched  # one bound per meter provider, whichever Telemetry records
        with w.lock:
            named = w.named.get(cut)
            if named is None:
                if w.distinct >= MAX_NAMES:
                    named = self._other
                else:
                    w.distinct += 1
                    named = w.named[cut] = ({NAME: cut}, {NAME: cut, OUTCOME: "success"})
            if len(w.named) < 4 * MAX_NAMES:
                w.named[name] = named
        return named

    def begin(
        self,
        request: Any,
        kind: Any = None,
        span_name: str | None = None,
        span: Any = _OWN_SPAN,
        name: str | None = None,
    ) -> RequestTrace:
        """The request's trace: its span starts (back-dated to the request's creation).

        ``span``: a span the door started itself (a gRPC call's ``Sent.`` span, started
        with the call; None if it could not start). The trace adopts it as the request's
        span, records on it as on its own, and leaves ending it to that door.
        ``name``: the ``sdkcore.request.name`` to record instead of the request's own (a
        gRPC call's, bounded as ``grpc.method`` is).
        """
        return RequestTrace(self, request, kind, span_name, span, name)

    def _guard(self, kind: str, call: Any, *args: Any) -> Any:
        """Call into OpenTelemetry; an exception is logged once per ``kind``, never raised."""
        try:
            return call(*args)
        except Exception as exc:
            self._failure(kind, exc)
            return None

    def _failure(self, kind: str, error: Exception) -> None:
        if kind in self._failed:
            return
        with self._lock:
            first = kind not in self._failed
            self._failed.add(kind)
        if first:
            log = _log.enabled(_log.WARNING)
            if log is not None:
                log.warning(
                    EVENT_TELEMETRY_FAILED, kind=kind, error=f"{type(error).__name__}: {error}"
                )


class RequestTrace:
    """One request's span and the attributes of its metrics, kept as ``request._trace``.

    Made by :meth:`Telemetry.begin`, or directly by the doors of the core through
    ``Telemetry._request_trace`` (one call less per request).

    The doors call it at fixed points: :meth:`attempt` before each attempt is sent and
    :meth:`attempt_end` when it ends (``execute`` inline in its loop, ``execute_sync``
    through :meth:`call_sync`, hedges through :meth:`traced_hedge`), :meth:`retry` per
    scheduled retry, :meth:`end` once when the request ends. Each hook is one ``try``
    around the OpenTelemetry calls it makes (bench/README, "bench_telemetry.py").
    """

    __slots__ = (
        "attributes",
        "ended",
        "hedges",
        "owns_span",
        "rpc",
        "span",
        "success",
        "telemetry",
    )

    def __init__(
        self,
        telemetry: Telemetry,
        request: Any,
        kind: Any = None,
        span_name: str | None = None,
        span: Any = _OWN_SPAN,
        name: str | None = None,
    ) -> None:
        request._trace = self
        self.telemetry = telemetry
        self.ended = False
        self.hedges = 0  # copies after the first: sdkcore.hedges, not retries
        #: A gRPC call's (set by its door): error.type is the status code's name.
        self.rpc = False
        if name is None:
            name = request._name
        named = telemetry._named.get(name)  # the lookup inlined: once per request
        if named is None:
            named = telemetry._named_attributes(name)
        self.attributes, self.success = named
        #: False for a span the door started and ends itself (see Telemetry.begin).
        self.owns_span = span is _OWN_SPAN
        if not self.owns_span:
            self.span: Any = span
            return
        name = self.attributes[NAME]
        # Back-dated to the request's creation: its duration metric starts there too.
        started = time.time_ns() - int((request._clock() - request._start) * 1e9)
        try:
            self.span = telemetry.tracer.start_span(
                span_name or name,
                kind=telemetry._client if kind is None else kind,
                attributes={NAME: name, "sdkcore.request.id": request._id},
                start_time=started,
            )
        except Exception as exc:
            telemetry._failure("span", exc)
            self.span = None

    def ids(self) -> tuple[str, str] | None:
        """The request span's trace and span ids (32 and 16 lowercase hex digits, as W3C
        ``traceparent`` writes them), for the log events of the request (rfc/0008, "Logs
        and traces"); None without a recording span (a no-op tracer). Read only when an
        event is logged."""
        span = self.span
        if span is None:
            return None
        try:
            context = span.get_span_context()
            if not context.is_valid:
                return None
            return format(context.trace_id, "032x"), format(context.span_id, "016x")
        except Exception as exc:
            self.telemetry._failure("span", exc)
            return None

    # -- attempts --------------------------------------------------------------------
    def call_sync(self, send: Callable[[Any], T], request: Any) -> T:
        """``send(request)`` as one attempt in its own span (``execute_sync``).

        :meth:`attempt` and :meth:`attempt_end` written out: the two calls were a
        quarter of sdkcore's share of a traced call (bench/README, "bench_telemetry.py").
        """
        telemetry = self.telemetry
        parent = self.span
        span = token = None
        if parent is not None:
            in_context = telemetry._trace.set_span_in_context
            try:
                span = telemetry.tracer.start_span(
                    "sdkcore.attempt",
                    context=in_context(parent),
                    attributes={ATTEMPT_NUMBER: request._retries + 1},
                )
                token = telemetry._context.attach(in_context(span))
            except Exception as exc:
                telemetry._failure("span", exc)
                if span is not None:
                    telemetry._guard("span", span.end)
                span = None
        try:
            result = send(request)
        except BaseException as exc:
            if span is not None:
                self.attempt_end((span, token), exc)
            raise
        if span is not None:
            try:
                telemetry._context.detach(token)
                span.end()
            except Exception as exc:
                telemetry._failure("span", exc)
        return result

    def traced_hedge(
        self, send: Callable[[Any, int], Awaitable[T]]
    ) -> Callable[[Any, int], Awaitable[T]]:
        """A hedge's ``send(request, index)``: each copy a sibling attempt span."""

        async def copy(request: Any, index: int) -> T:
            handle = self.attempt(index + 1, hedge=index)
            try:
                result = await send(request, index)
            except BaseException as exc:
                # (no local holds the ending: the cut's traceback holds this frame, a cycle)
                self.attempt_end(handle, _copy_ending(request, index, exc))
                raise
            self.attempt_end(handle, None)
            return result

        return copy

    def attempt(self, number: int, hedge: int | None = None, name: str = "sdkcore.attempt") -> Any:
        """Start attempt ``number`` (1-based) as a child span, current until :meth:`attempt_end`.

        Returns a handle for :meth:`attempt_end`, or None when the span could not start.
        """
        parent = self.span
        if parent is None:
            return None
        telemetry = self.telemetry
        in_context = telemetry._trace.set_span_in_context
        attributes: dict[str, Any] = {ATTEMPT_NUMBER: number}
        if hedge is not None:
            attributes[HEDGE_INDEX] = hedge
        span = None
        try:
            span = telemetry.tracer.start_span(
                name, context=in_context(parent), attributes=attributes
            )
            return span, telemetry._context.attach(in_context(span))
        except Exception as exc:
            telemetry._failure("span", exc)
            if span is not None:
                telemetry._guard("span", span.end)
            return None

    def attempt_left(self, handle: Any) -> Any:
        """The attempt's span is no longer current (its context detached), though it has
        not ended yet: returns the handle for :meth:`attempt_end`, which then only ends it."""
        if handle is None:
            return None
        span, token = handle
        if token is not None:
            self.telemetry._guard("span", self.telemetry._context.detach, token)
        return span, None

    def attempt_end(self, handle: Any, error: BaseException | None) -> None:
        if handle is None:
            return
        telemetry = self.telemetry
        span, token = handle
        try:
            try:
                if token is not None:  # (None: detached by attempt_left)
                    telemetry._context.detach(token)
            finally:
                if error is not None:
                    _record_error(telemetry, span, error)
                span.end()
        except Exception as exc:
            telemetry._failure("span", exc)

    # -- the request's events ---------------------------------------------------------
    def retry(self, reason: RetryReason, delay: float) -> None:
        """A retry was scheduled for ``reason`` after ``delay`` seconds."""
        telemetry = self.telemetry
        attributes = {NAME: self.attributes[NAME], REASON: reason.name}
        telemetry._guard("retries", telemetry.retries.add, 1, attributes)
        telemetry._guard("retry.delay", telemetry.retry_delay.record, delay, attributes)
        span = self.span
        if span is not None:
            telemetry._guard(
                "span",
                span.add_event,
                "sdkcore.retry",
                {REASON: reason.name, "sdkcore.retry.delay": delay},
            )

    def hedge_booked(self) -> None:
        """A copy after the first was booked: it is not a retry (``sdkcore.request.retries``)."""
        self.hedges += 1

    def hedge_sent(self) -> None:
        """A copy after the first went out (``sdkcore.hedges``)."""
        telemetry = self.telemetry
        telemetry._guard("hedges", telemetry.hedges.add, 1, self.attributes)

    def hedge_won(self) -> None:
        telemetry = self.telemetry
        telemetry._guard("hedge.wins", telemetry.hedge_wins.add, 1, self.attributes)

    def end(self, request: Any, error: BaseException | None) -> None:
        """The request ended (``error``: what the caller got, None on success). Once.

        ``error.type`` is the error's class name; for a gRPC call's (:attr:`rpc`), the
        status code's name of the ``AioRpcError`` it ended with, as OpenTelemetry's RPC
        conventions ask (``DEADLINE_EXCEEDED``, ``UNAVAILABLE``, ...).
        """
        if self.ended:
            return
        self.ended = True
        telemetry = self.telemetry
        state = request._state
        if state is _PENDING:  # a caller's mistake before anything ran (a bad argument)
            request._trace = None
            span = self.span
            if span is not None and self.owns_span:
                telemetry._guard("span", span.end)
            return
        # Request.retry_attempts counts hedged copies too (RFC 0049): they are reported
        # by sdkcore.hedges, so a retry ratio never mistakes a hedge for a retry.
        retries = request._retries - self.hedges
        elapsed = request._clock() - request._start  # request.elapsed, without its timedelta
        cls = ""
        if state is _SUCCEEDED:
            outcome = "success"
            attributes = self.success
        else:
            outcome = outcome_of(request)
            # No error: succeed() of a request Request.cancel() had completed (a hand-wired
            # loop whose answer came after the cancel); the caller's error is the cancel's.
            if error is None:
                cls = "RequestCanceledException"
            else:
                cls = _cut((self.rpc and _status_name(error)) or type(error).__name__)
            attributes = {NAME: self.attributes[NAME], OUTCOME: outcome, ERROR_TYPE: cls}
        try:
            telemetry.request_duration.record(elapsed, attributes)
        except Exception as exc:
            telemetry._failure("request.duration", exc)
        try:
            telemetry.request_retries.record(retries, self.attributes)
        except Exception as exc:
            telemetry._failure("request.retries", exc)
        if telemetry.threshold_reporter is not None:
            self._report_threshold(request, elapsed)
        span = self.span
        if span is not None:
            try:
                span.set_attribute(OUTCOME, outcome)
                span.set_attribute("sdkcore.request.retries", retries)
                if outcome != "success":
                    if error is not None:
                        _record_error(telemetry, span, error, cls)
                    else:  # as the metric above records it
                        trace = telemetry._trace
                        span.set_status(
                            trace.Status(trace.StatusCode.ERROR, "the request was cancelled")
                        )
                        span.set_attribute(ERROR_TYPE, cls)
                if self.owns_span:
                    span.end()
            except Exception as exc:
                telemetry._failure("span", exc)

    def _report_threshold(self, request: Any, elapsed: float) -> None:
        """Offer the request to the threshold reporter (RFC 67)."""
        telemetry = self.telemetry
        reporter = telemetry.threshold_reporter
        assert reporter is not None
        # The service from the request's client_context["service"] (e.g. "kv"), else
        # "default": a service without a threshold of its own gets default_threshold.
        service = request.client_context.get("service", "default")
        timeout = request.timeout
        try:
            reporter.record(
                str(service),
                self.attributes[NAME],
                elapsed,
                operation_id=str(request.id),
                timeout=None if timeout is None else timeout.total_seconds(),
            )
        except Exception as exc:
            telemetry._failure("threshold_reporter", exc)


Telemetry._request_trace = RequestTrace


def _copy_ending(request: Any, index: int, error: BaseException) -> BaseException:
    """What a hedged copy's span ends with: a copy cut by ``Request.cancel()`` as execute's
    attempt, a ``RequestCanceledException`` (the request's own is made only after every
    copy ended), not the bare cancellation (rfc/0008); else ``error`` itself."""
    if (
        not isinstance(error, Exception)
        and request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    ):
        return RequestCanceledException(
            f"request was cancelled (Request.cancel()) with hedge {index} in flight"
        )
    return error


def _status_name(error: BaseException) -> str | None:
    """The name of an RPC error's status code (``error.code().name``), else None."""
    code = getattr(error, "code", None)
    if not callable(code):
        return None
    try:
        name = code().name
    except Exception:  # a code() of another kind
        return None
    return name if isinstance(name, str) else None


def _record_error(
    telemetry: Telemetry, span: Any, error: BaseException, error_type: str | None = None
) -> None:
    """ERROR status and ``error.type`` on ``span`` (``error_type``, else the error's class
    name), the exception recorded. The status says the message alone (a
    CouchbaseException's error context, JSON, is in the recorded exception: cut at 100
    characters it ended mid-JSON); an attempt that failed with a RetryableError carries
    its reason as ``sdkcore.retry.reason``."""
    trace = telemetry._trace
    message = error.message if isinstance(error, CouchbaseException) else str(error)
    span.set_status(trace.Status(trace.StatusCode.ERROR, _cut(message)))
    span.set_attribute(ERROR_TYPE, _cut(error_type or type(error).__name__))
    if isinstance(error, RetryableError):
        span.set_attribute(REASON, error.reason.name)
    if isinstance(error, Exception):
        span.record_exception(error)
