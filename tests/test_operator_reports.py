"""An operator review's findings: telemetry labels, check-config's policy, explain's hints.

1. Two unnamed breakers (budgets, limiters, throttles, hedge delays) watched by one
   Telemetry reported under one ``sdkcore.endpoint=""`` series: one hid the other.
3. ``check-config`` warned that OK in retryableStatusCodes has no effect, yet printed it
   in the effective policy.
5. ``explain reason CIRCUIT_BREAKER_OPEN`` showed 1, 2, 4 ms retries, though a breaker's
   refusal carries retry_after (its sleep window), which the orchestrator waits out.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from telemetry_kit import Otel

from sdkcore import (
    AdaptiveThrottle,
    CircuitBreaker,
    ConcurrencyLimiter,
    LatencyQuantile,
    Request,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    Telemetry,
)
from sdkcore import _telemetry as sdkcore_telemetry
from sdkcore._cli import WIDTH, main
from sdkcore._failing import _HINTED_BY
from sdkcore.testing import VirtualClock

ENDPOINT = "sdkcore.endpoint"
STATE = "sdkcore.circuit_breaker.state"


@pytest.fixture
def otel() -> Any:
    o = Otel()
    try:
        yield o
    finally:
        o.shutdown()


def _points(otel: Otel, metric: str) -> dict[str, Any]:
    """endpoint label -> value, failing if two points share a label."""
    points = otel.metrics()[metric].points
    labels = [attributes[ENDPOINT] for attributes, _ in points]
    assert len(labels) == len(set(labels)), points
    return {attributes[ENDPOINT]: value for attributes, value in points}


# -- 1. distinct labels ------------------------------------------------------------------------


def test_an_open_unnamed_breaker_is_not_hidden_by_a_closed_one(otel: Otel) -> None:
    """The reviewer's repro (/tmp/rev_op/unnamed.py): each breaker is its own series."""
    clock = VirtualClock()
    a = otel.telemetry.watch(CircuitBreaker(volume_threshold=2, clock=clock.clock))
    b = otel.telemetry.watch(CircuitBreaker(volume_threshold=2, clock=clock.clock))
    for _ in range(3):
        a.record_failure(ConnectionResetError("x"))
    assert _points(otel, STATE) == {"unnamed-1": 1, "unnamed-2": 0}
    assert otel.telemetry.label(a) == "unnamed-1"
    assert otel.telemetry.label(b) == "unnamed-2"
    # The counters use the same label as the gauge (each at 0 from the watch: rfc/0008).
    transitions = otel.metrics()["sdkcore.circuit_breaker.transitions"].points
    assert {attributes[ENDPOINT] for attributes, _ in transitions} == {"unnamed-1", "unnamed-2"}
    assert [(a, n) for a, n in transitions if n] == [({ENDPOINT: "unnamed-1", STATE: "open"}, 1)]
    with pytest.raises(RetryableError), a.guard():
        pass  # pragma: no cover - refused
    assert _points(otel, "sdkcore.circuit_breaker.rejections") == {"unnamed-1": 1, "unnamed-2": 0}


def test_labels_are_stable_and_never_reused(otel: Otel) -> None:
    clock = VirtualClock()
    telemetry = otel.telemetry
    first = telemetry.watch(CircuitBreaker(clock=clock.clock))
    second = telemetry.watch(CircuitBreaker(clock=clock.clock))
    telemetry.watch(first)  # watching again keeps the label
    assert telemetry.label(first) == "unnamed-1"
    del second
    gc.collect()
    third = telemetry.watch(CircuitBreaker(clock=clock.clock))
    assert telemetry.label(third) == "unnamed-3"  # a gone breaker's number is not handed out
    assert set(_points(otel, STATE)) == {"unnamed-1", "unnamed-3"}


def test_unnamed_budgets_limiters_throttles_and_hedge_delays_are_told_apart(otel: Otel) -> None:
    clock = VirtualClock()
    telemetry = otel.telemetry
    budgets = [telemetry.watch(RetryBudget(clock=clock.clock)) for _ in range(2)]
    limiters = [telemetry.watch(ConcurrencyLimiter(2)) for _ in range(2)]
    throttles = [telemetry.watch(AdaptiveThrottle(clock=clock.clock)) for _ in range(2)]
    quantiles = [telemetry.watch(LatencyQuantile(0.01, min_samples=10)) for _ in range(2)]
    for quantile in quantiles:
        for _ in range(20):
            quantile.record(0.02)
    full = limiters[1]
    with full.guard(), full.guard(), pytest.raises(RetryableError), full.guard():
        pass  # pragma: no cover - refused
    both = {"unnamed-1", "unnamed-2"}  # numbered per kind
    assert set(_points(otel, "sdkcore.retry_budget.balance")) == both
    assert set(_points(otel, "sdkcore.concurrency_limiter.limit")) == both
    assert set(_points(otel, "sdkcore.throttle.rejection_probability")) == both
    assert set(_points(otel, "sdkcore.hedge.delay")) == both
    assert _points(otel, "sdkcore.concurrency_limiter.rejections") == {
        "unnamed-1": 0,
        "unnamed-2": 1,
    }
    assert len(budgets) == len(throttles) == 2


def test_an_orchestrators_unnamed_budget_has_a_label(otel: Otel) -> None:
    clock = VirtualClock()
    budgets = [RetryBudget(clock=clock.clock, min_retries_per_sec=1, ttl=1) for _ in range(2)]
    orchestrators = [otel.orchestrator(retry_budget=budget) for budget in budgets]
    for budget in budgets:
        while budget.try_withdraw():
            pass
    for orchestrator in orchestrators:
        with pytest.raises(Exception, match="retry budget"):
            orchestrator.execute_sync(
                Request(name="get", timeout=1.0, clock=clock.clock),
                _fails_once,
            )
    # one refusal by the drain above, one by the request
    assert _points(otel, "sdkcore.retry_budget.rejections") == {"unnamed-1": 2, "unnamed-2": 2}


def _fails_once(request: Request) -> str:
    raise RetryableError(RetryReason.KV_LOCKED)


def test_two_targets_with_one_name_get_distinct_labels(otel: Otel) -> None:
    clock = VirtualClock()
    telemetry = otel.telemetry
    a = telemetry.watch(CircuitBreaker(name="10.0.0.7:11210", clock=clock.clock))
    b = telemetry.watch(CircuitBreaker(name="10.0.0.7:11210", clock=clock.clock))
    c = telemetry.watch(CircuitBreaker(name="unnamed-1", clock=clock.clock))
    d = telemetry.watch(CircuitBreaker(clock=clock.clock))  # "unnamed-1" is taken
    long = [telemetry.watch(CircuitBreaker(name="b" * 150, clock=clock.clock)) for _ in range(2)]
    labels = [telemetry.label(x) for x in (a, b, c, d, *long)]
    assert labels == [
        "10.0.0.7:11210",
        "10.0.0.7:11210#2",
        "unnamed-1",
        "unnamed-2",
        "b" * 100,
        "b" * 98 + "#2",
    ]
    assert set(_points(otel, STATE)) == set(labels)


def test_watch_name_labels_an_unnamed_target_and_must_match_a_named_one(otel: Otel) -> None:
    clock = VirtualClock()
    telemetry = otel.telemetry
    breaker = telemetry.watch(CircuitBreaker(clock=clock.clock), name="node-a")
    assert telemetry.label(breaker) == "node-a"
    telemetry.watch(breaker)  # again, without a name: it keeps it
    assert telemetry.label(breaker) == "node-a"
    named = CircuitBreaker(name="node-b", clock=clock.clock)
    assert telemetry.label(telemetry.watch(named, name="node-b")) == "node-b"
    with pytest.raises(ValueError, match=r"watch\(name='other'\).*named 'node-b'"):
        telemetry.watch(named, name="other")


def test_a_target_moved_to_another_telemetry_is_labelled_there(otel: Otel) -> None:
    other = Otel()
    try:
        clock = VirtualClock()
        kept = otel.telemetry.watch(CircuitBreaker(clock=clock.clock))
        moved = otel.telemetry.watch(CircuitBreaker(clock=clock.clock))
        other.telemetry.watch(moved)
        assert other.telemetry.label(moved) == "unnamed-1"
        assert set(_points(otel, STATE)) == {otel.telemetry.label(kept)}
        assert set(_points(other, STATE)) == {"unnamed-1"}
    finally:
        other.shutdown()


# -- 3. check-config prints the effective codes --------------------------------------------------


def _check(tmp_path: Path, capsys: pytest.CaptureFixture[str], config: Any) -> tuple[str, str]:
    path = tmp_path / "service_config.json"
    path.write_text(json.dumps(config))
    assert main(["check-config", str(path)]) == 0
    captured = capsys.readouterr()
    return captured.out, " ".join(captured.err.split())


def test_check_config_leaves_ok_out_of_the_effective_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    retry = {
        "maxAttempts": 3,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["OK", "UNAVAILABLE"],
    }
    hedging = {"maxAttempts": 2, "hedgingDelay": "0.05s", "nonFatalStatusCodes": [0]}
    config = {
        "methodConfig": [
            {"name": [{"service": "pkg.Kv"}], "retryPolicy": retry},
            {"name": [{"service": "pkg.Query"}], "hedgingPolicy": hedging},
        ]
    }
    out, err = _check(tmp_path, capsys, config)
    flat = " ".join(out.split())
    assert "retry on UNAVAILABLE" in flat
    assert "non-fatal: none" in flat
    assert "OK" not in out
    # The warnings stay.
    assert "methodConfig[0].retryPolicy.retryableStatusCodes[0]: OK is not a failure" in err
    assert "methodConfig[1].hedgingPolicy.nonFatalStatusCodes[0]: OK is not a failure" in err


def test_check_config_shows_the_backoff_used_when_max_backoff_caps_every_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    retry = {
        "maxAttempts": 5,
        "initialBackoff": "1s",
        "maxBackoff": "0.1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    config = {"methodConfig": [{"name": [{"service": "pkg.Kv"}], "retryPolicy": retry}]}
    out, _ = _check(tmp_path, capsys, config)
    flat = " ".join(out.split())
    assert "backoff 0.1s every retry (initialBackoff 1s capped by maxBackoff)" in flat
    assert "x2 per retry" not in flat


# -- 5. explain names the retry_after a local refusal carries -------------------------------------


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["explain", *args]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert all(len(line) <= WIDTH for line in captured.out.splitlines())
    return " ".join(captured.out.split())


def test_explain_says_a_breaker_refusal_waits_out_the_sleep_window(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _explain(capsys, "reason", "CIRCUIT_BREAKER_OPEN")
    assert "retry after 1, 2, 4, 8, 16 ms" in text  # the strategies' backoff, as played
    assert (
        "An OPEN CircuitBreaker's refusal carries retry_after (the rest of the breaker's sleep "
        "window" in text
    )
    assert "each retry waits the longer of it and the backoff above" in text
    assert main(["explain", "reason", "CIRCUIT_BREAKER_OPEN", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "sleep window" in data["retry_after_note"]


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        ("CONCURRENCY_LIMITED", "AdaptiveConcurrencyLimiter's refusal carries retry_after"),
        ("CLIENT_THROTTLED", "AdaptiveThrottle's refusal carries no retry_after"),
    ],
)
def test_explain_names_the_hint_of_every_local_refusal(
    capsys: pytest.CaptureFixture[str], reason: str, said: str
) -> None:
    assert said in _explain(capsys, "reason", reason)


def test_explain_says_nothing_of_retry_after_for_other_reasons(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "retry_after" not in _explain(capsys, "reason", "KV_LOCKED")
    main(["explain", "reason", "KV_LOCKED", "--json"])
    assert json.loads(capsys.readouterr().out)["retry_after_note"] is None


def test_explain_covers_every_reason_a_local_refusal_hints() -> None:
    from sdkcore._explain import retry_after_note

    assert all(retry_after_note(reason) for reason in _HINTED_BY)


@pytest.mark.asyncio
async def test_what_explain_says_of_the_breaker_is_what_the_orchestrator_does() -> None:
    """The sentence is checked against the core: a breaker's refusal waits its window."""
    clock = VirtualClock()
    breaker = CircuitBreaker(volume_threshold=1, sleep_window=0.25, clock=clock.clock)
    breaker.record_failure(ConnectionResetError("down"))
    orchestrator = RetryOrchestrator(sleep=clock.sleep)
    request = Request(name="get", timeout=10.0, clock=clock.clock)
    with pytest.raises(RetryableError) as info, breaker.guard():
        pass  # pragma: no cover - refused
    refusal = info.value
    delay = await orchestrator.maybe_retry(request, refusal.reason, cause=refusal)
    assert delay.total_seconds() == pytest.approx(0.25)  # not the 1 ms backoff


# -- two Telemetry objects on one meter provider ----------------------------------------------


def test_a_second_telemetry_on_one_provider_reports_its_gauges(otel: Otel) -> None:
    """Two clients in one process, each with its own Telemetry on the same provider (the
    global one, typically): OpenTelemetry keeps one instrument per name in a meter, and
    the second Telemetry's gauge callbacks were dropped: its open breaker never showed."""
    clock = VirtualClock()
    second = Telemetry(meter_provider=otel.meters, tracer_provider=otel.tracers)
    a = otel.telemetry.watch(CircuitBreaker(name="clusterA:11210", clock=clock.clock))
    b = second.watch(CircuitBreaker(name="clusterB:11210", volume_threshold=1, clock=clock.clock))
    b.record_failure(ConnectionResetError("down"))
    budget = second.watch(RetryBudget(name="clusterB", clock=clock.clock))
    assert _points(otel, STATE) == {"clusterA:11210": 0, "clusterB:11210": 1}
    assert _points(otel, "sdkcore.retry_budget.balance") == {"clusterB": budget.balance}
    # Unnamed targets are told apart across the two, as within one.
    ua = otel.telemetry.watch(CircuitBreaker(clock=clock.clock))
    ub = second.watch(CircuitBreaker(clock=clock.clock))
    assert {otel.telemetry.label(ua), second.label(ub)} == {"unnamed-1", "unnamed-2"}
    assert set(_points(otel, STATE)) == {
        "clusterA:11210",
        "clusterB:11210",
        "unnamed-1",
        "unnamed-2",
    }
    # Watched again by its sibling on the same provider: its label stays.
    second.watch(ua)
    assert second.label(ua) == otel.telemetry.label(ua)
    del a


def test_labels_are_bounded_per_kind(otel: Otel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short-lived unnamed breakers (one per connection) must not grow series without end:
    past MAX_NAMES labels of a kind, a new target is labelled ``other``."""
    monkeypatch.setattr(sdkcore_telemetry, "MAX_NAMES", 3)
    clock = VirtualClock()
    telemetry = otel.telemetry
    breakers = [telemetry.watch(CircuitBreaker(clock=clock.clock)) for _ in range(5)]
    assert [telemetry.label(b) for b in breakers] == [
        "unnamed-1",
        "unnamed-2",
        "unnamed-3",
        "other",
        "other",
    ]
    budget = telemetry.watch(RetryBudget(clock=clock.clock))  # another kind: its own count
    assert telemetry.label(budget) == "unnamed-1"
    transitions = otel.metrics()["sdkcore.circuit_breaker.transitions"].points
    assert {attributes[ENDPOINT] for attributes, _ in transitions} == {
        "unnamed-1",
        "unnamed-2",
        "unnamed-3",
        "other",
    }


def test_every_way_a_breaker_refuses_counts_a_rejection(otel: Otel) -> None:
    """``guard()`` counted its refusals; ``admit()`` and ``try_acquire()``, which the
    memcached example's guard uses, did not: the counter disagreed with the retries."""
    from sdkcore.examples.memcached import refuse_if_open

    clock = VirtualClock()
    breaker = otel.telemetry.watch(
        CircuitBreaker(name="10.0.0.2:11210", volume_threshold=1, clock=clock.clock)
    )
    breaker.record_failure(ConnectionResetError("down"))
    assert breaker.admit() is None
    assert breaker.try_acquire() is False
    with pytest.raises(RetryableError), breaker.guard():
        pass  # pragma: no cover - refused
    with pytest.raises(RetryableError):
        refuse_if_open(breaker)
    assert _points(otel, "sdkcore.circuit_breaker.rejections") == {"10.0.0.2:11210": 4}


def test_a_name_handed_out_before_is_not_a_new_label(
    otel: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound counts distinct labels (series), not watches: a client made again under
    its name (its breaker gone, a new one named the same) keeps that name past the bound."""
    monkeypatch.setattr(sdkcore_telemetry, "MAX_NAMES", 2)
    clock = VirtualClock()
    telemetry = otel.telemetry
    for _ in range(5):  # made, watched and dropped again and again
        breaker = telemetry.watch(CircuitBreaker(name="db-1:11210", clock=clock.clock))
        assert telemetry.label(breaker) == "db-1:11210"
        del breaker
        gc.collect()
    other = telemetry.watch(CircuitBreaker(name="db-2:11210", clock=clock.clock))
    assert telemetry.label(other) == "db-2:11210"  # the second distinct label
    third = telemetry.watch(CircuitBreaker(name="db-3:11210", clock=clock.clock))
    assert telemetry.label(third) == "other"  # past the bound


_ORDERS = {
    "named, then global": """
a = sdkcore.Telemetry(meter_provider=provider)
metrics.set_meter_provider(provider)
b = sdkcore.Telemetry()
""",
    "global on the proxy, then named": """
a = sdkcore.Telemetry()
metrics.set_meter_provider(provider)
b = sdkcore.Telemetry(meter_provider=provider)
""",
}


@pytest.mark.parametrize("order", list(_ORDERS))
def test_one_provider_one_set_of_gauges_whichever_way_it_is_named(order: str) -> None:
    """A provider given by name and the same provider as the global one: one set of
    gauges, whichever Telemetry came first (the global provider is set once per process:
    each order runs in a fresh interpreter)."""
    import subprocess
    import sys

    script = (
        """
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
import sdkcore
reader = InMemoryMetricReader()
provider = MeterProvider(metric_readers=[reader])
"""
        + _ORDERS[order]
        + """
# kept: a Telemetry holds what it watches weakly (a collection between the two
# watches dropped A's gauge on Python 3.10)
kept = [a.watch(sdkcore.CircuitBreaker(name="A")), b.watch(sdkcore.CircuitBreaker(name="B"))]
seen = set()
for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for m in sm.metrics:
            if m.name == "sdkcore.circuit_breaker.state":
                seen |= {p.attributes["sdkcore.endpoint"] for p in m.data.data_points}
print(sorted(seen))
"""
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['A', 'B']", done.stderr


class _Unreferenceable:
    """A meter provider that cannot be weakly referenced (``__slots__``, no ``__weakref__``)
    and is not hashable: a wrapper some applications put around the SDK's."""

    __slots__ = ("inner",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_meter(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get_meter(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Unreferenceable) and other.inner is self.inner


def test_a_provider_that_cannot_be_weakly_referenced_still_gets_one_set_of_gauges() -> None:
    """Two Telemetry objects on one such provider share its gauges, as on any provider
    (a set of their own each lost the second's breakers: OpenTelemetry dropped its
    callbacks); a provider equal to it but another object has a set of its own."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    sdk = MeterProvider(metric_readers=[reader])
    try:
        clock = VirtualClock()
        provider = _Unreferenceable(sdk)
        first = Telemetry(meter_provider=provider)
        second = Telemetry(meter_provider=provider)
        a = first.watch(CircuitBreaker(name="A", clock=clock.clock))
        b = second.watch(CircuitBreaker(name="B", clock=clock.clock))
        data = reader.get_metrics_data()
        assert data is not None
        seen = {
            (point.attributes or {})[ENDPOINT]
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == STATE
            for point in m.data.data_points
        }
        assert seen == {"A", "B"}
        assert second._watched is first._watched
        other = Telemetry(meter_provider=_Unreferenceable(sdk))
        assert other._watched is not first._watched
        del a, b
    finally:
        sdk.shutdown()
