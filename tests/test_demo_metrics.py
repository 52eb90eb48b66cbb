"""``sdkcore demo --metrics-port/--linger``, and the counts its ``--json`` report carries.

Without a Prometheus server (tests/test_prometheus.py has the real one): the endpoint is
read with prometheus_client's own parser, in a subprocess that may import only what the
``demo`` extra installs; the options' errors; the counting orchestrator and breaker
against the OpenTelemetry SDK's in-memory reader (asyncio and trio).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from stderr_kit import tracebacks

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitState,
    HedgePolicy,
    Request,
    RetryableError,
    RetryBudget,
    RetryReason,
    Telemetry,
)
from sdkcore._demo import main

ROOT = Path(__file__).resolve().parent.parent
#: What the 'demo' extra does not install: the demo must run without any of these.
NOT_IN_THE_DEMO_EXTRA = ("rich", "pytest", "hypothesis", "trio", "mypy", "ruff", "google")
#: A safety net on every wait, not a timing claim.
WAIT = 60.0


def _metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The endpoint's samples, by sample name (``sdkcore_retries_total``: its labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def _sum(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, own: bool) -> float:
    """The sum of ``name``'s samples of the demo's own requests (``own``) or its channels'."""
    return sum(
        value
        for labels, value in samples.get(name, [])
        if labels.get("sdkcore_request_name", "").startswith("/") is not own
    )


def _read_to_eof(stream: Any, deadline: float) -> bytes:
    out = b""
    fd = stream.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return out
            out += chunk
    raise AssertionError(f"no end of file on stdout within {WAIT} s: {out[-500:]!r}")


def test_metrics_port_serves_what_the_report_counts_with_only_the_demo_extra(
    tmp_path: Path,
) -> None:
    """The README's first command plus --metrics-port/--linger: the extra is enough, the
    endpoint's sums are the report's counts, the report's end of file comes before the
    linger's, and Ctrl-C ends the linger quietly with the report's exit code."""
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.prometheus")
    script = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_IN_THE_DEMO_EXTRA!r}:
            raise ImportError(f"{{name}} is not installed by --no-dev --extra demo", name=name)
        return None
sys.meta_path.insert(0, Refuse())
from sdkcore._cli import main
sys.exit(main(["demo", "--scenario", "locked", "--scenario", "hedged-reads", "--json",
               "--metrics-port", "0", "--linger", "{WAIT:g}"]))
"""
    err = tmp_path / "stderr"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr
        )
    try:
        assert proc.stdout is not None
        report = json.loads(_read_to_eof(proc.stdout, time.monotonic() + WAIT))
        assert proc.poll() is None, err.read_text()  # the report ended; the linger goes on
        text = err.read_text()
        found = re.search(r"serving metrics at (http://127\.0\.0\.1:(\d+)/metrics)\n", text)
        assert found, text
        # The linger's line follows the report's end of file: wait for it (a loaded machine
        # may run this test between the two).
        lingering = f"still serving {found.group(1)} for {WAIT:g} s (Ctrl-C stops)"
        until = time.monotonic() + WAIT
        while lingering not in text and time.monotonic() < until:
            time.sleep(0.05)
            text = err.read_text()
        assert lingering in text, text
        samples = _metrics(found.group(1))
        counts = report["counts"]
        assert counts["requests"] > 0
        assert counts["retries"] > 0  # KV_LOCKED
        assert counts["hedges"] > 0
        assert counts["channel"]["calls"] >= counts["requests"]
        own = [
            ("sdkcore_request_duration_seconds_count", counts["requests"]),
            ("sdkcore_retries_total", counts["retries"]),
            ("sdkcore_request_retries_sum", counts["retries"]),
            ("sdkcore_hedges_total", counts["hedges"]),
        ]
        for name, expected in own:
            assert _sum(samples, name, own=True) == expected, name
        calls = counts["channel"]["calls"]
        assert _sum(samples, "sdkcore_request_duration_seconds_count", own=False) == calls
        assert sum(v for _, v in samples["grpc_client_call_duration_seconds_count"]) == calls
        [(info, _)] = samples["target_info"]
        assert info["service_name"] == "sdkcore-demo"
        proc.send_signal(signal.SIGINT)  # Ctrl-C while lingering
        assert proc.wait(timeout=10) == (0 if report["ok"] else 1), err.read_text()
        assert not tracebacks(err.read_text()), err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_endpoint_listens_on_loopback_only_and_stops_with_the_demo() -> None:
    pytest.importorskip("opentelemetry.exporter.prometheus")
    from sdkcore._demo._metrics import serve

    endpoint = serve(0)
    try:
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        assert endpoint._server.server_address[0] == "127.0.0.1"
        assert isinstance(endpoint.telemetry, Telemetry)
        with urllib.request.urlopen(endpoint.url, timeout=10) as answer:
            assert answer.status == 200
    finally:
        endpoint.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", endpoint.port), 1).close()
    endpoint.close()  # twice: nothing left to stop


def _usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--metrics-port", "70000"), "must be a TCP port number from 0 to 65535"),
        (("--metrics-port", "-1"), "must be a TCP port number from 0 to 65535"),
        (("--metrics-port", "http"), "got 'http'"),
        (("--metrics-port", "0", "--linger", "-1"), "must be a number of seconds from 0 to"),
        (("--metrics-port", "0", "--linger", "nan"), "got 'nan'"),
        (("--metrics-port", "0", "--linger", "inf"), "got 'inf'"),
        (("--linger", "5"), "--linger keeps the metrics endpoint serving: it needs --metrics-port"),
    ],
)
def test_bad_metrics_options_are_usage_errors_naming_the_option(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], says: str
) -> None:
    err = _usage_error(capsys, *args)
    assert says in err
    assert ("--metrics-port" in err) or ("--linger" in err)


def test_a_taken_port_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.prometheus")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--metrics-port", str(port), "--scenario", "locked"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"--metrics-port {port}: cannot serve on 127.0.0.1:{port}" in captured.err


def test_without_the_exporter_the_error_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("grpc")
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.prometheus", None)
    assert main(["--metrics-port", "0", "--scenario", "locked", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--metrics-port needs the OpenTelemetry SDK and its Prometheus exporter" in captured.err
    assert "pip install opentelemetry-sdk opentelemetry-exporter-prometheus" in captured.err
    assert "uv run --no-dev --extra demo sdkcore demo" in captured.err


def test_the_report_counts_without_metrics_port() -> None:
    """``counts`` is always in --json: the demo counts, the telemetry is optional."""
    pytest.importorskip("grpc")
    from sdkcore._demo._workload import SCENARIOS, STRATEGIES

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["--json", "--scenario", "locked"]) == 0
    counts = json.loads(out.getvalue())["counts"]
    [locked] = [s for s in SCENARIOS if s.name == "locked"]
    # every operation, and one warm-up per scenario and strategy
    assert counts["requests"] == (locked.ops + 1) * len(STRATEGIES)
    assert counts["retries"] > 0  # KV_LOCKED
    assert counts["hedges"] == counts["hedged_requests"] == 0
    assert counts["channel"]["calls"] == counts["requests"] + counts["retries"]
    assert counts["breaker_transitions"] == {"open": 0, "half_open": 0, "closed": 0}
    assert counts["budget_rejections"] == 0


# -- the counting orchestrator and breaker, against the telemetry -----------------------


def _telemetry() -> tuple[Telemetry, Any]:
    metrics = pytest.importorskip("opentelemetry.sdk.metrics")
    export = pytest.importorskip("opentelemetry.sdk.metrics.export")
    reader = export.InMemoryMetricReader()
    return Telemetry(meter_provider=metrics.MeterProvider(metric_readers=[reader])), reader


def _sums(reader: Any) -> dict[str, float]:
    """Each counter's sum, and each histogram's sum, by instrument name."""
    out: Counter[str] = Counter()
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    out[metric.name] += point.sum if value is None else value
    return dict(out)


@pytest.mark.anyio
async def test_the_counting_orchestrator_counts_what_the_telemetry_records() -> None:
    from sdkcore._demo._metrics import CountingOrchestrator, Counts
    from sdkcore.testing import instant_retries

    telemetry, reader = _telemetry()
    counts = Counts()
    orchestrator = CountingOrchestrator(counts, BestEffortRetryStrategy(), telemetry=telemetry)
    failures = [RetryableError(RetryReason.KV_LOCKED)] * 2

    async def flaky(request: Request) -> str:
        if failures:
            raise failures.pop()
        return "ok"

    async def broken(request: Request) -> str:
        raise ValueError("not retryable")

    answered = anyio.Event()

    async def hedged(request: Request, index: int) -> int:
        if index == 0:
            await answered.wait()  # the first copy answers only after the second
            return 0
        answered.set()
        return index

    with instant_retries():
        assert await orchestrator.execute(Request(name="get", timeout=5), flaky) == "ok"
        with pytest.raises(ValueError, match="not retryable"):
            await orchestrator.execute(Request(name="get", timeout=5), broken)
        policy = HedgePolicy(max_attempts=2, delay=0.01)
        request = Request(name="read", idempotent=True, timeout=5)
        assert await orchestrator.hedge(request, hedged, policy) == 1
    assert counts.to_json()["requests"] == 3
    assert (counts.retries, counts.hedged_requests, counts.hedges) == (2, 1, 1)
    sums = _sums(reader)
    assert sums["sdkcore.retries"] == counts.retries
    assert sums["sdkcore.request.retries"] == counts.retries  # a hedge's copy is no retry
    assert sums["sdkcore.hedges"] == counts.hedges
    assert sums["sdkcore.hedge.wins"] == 1


def test_the_counted_breaker_counts_transitions_a_state_reader_misses() -> None:
    """Probe lost, then a new probe, in one admit(): HALF_OPEN -> OPEN -> HALF_OPEN."""
    from sdkcore._demo._metrics import CountedBreaker

    telemetry, reader = _telemetry()
    now = [0.0]
    transitions: Counter[str] = Counter()
    breaker = CountedBreaker(
        transitions,
        volume_threshold=1,
        sleep_window=1.0,
        canary_timeout=1.0,
        clock=lambda: now[0],
        name="a",
    )
    telemetry.watch(breaker)
    breaker.record_failure(TimeoutError("no reply"))
    assert breaker.state is CircuitState.OPEN
    now[0] = 1.0
    assert breaker.admit() is CircuitState.HALF_OPEN  # the probe goes, and never reports
    seen = breaker.state  # what a reader after each call (the demo's timeline) notes
    now[0] = 3.5  # it ran out at 2.0 (OPEN again); the next sleep window ended at 3.0
    assert breaker.admit() is CircuitState.HALF_OPEN  # a new probe
    assert breaker.state is seen is CircuitState.HALF_OPEN  # type: ignore[comparison-overlap]  # that reader sees no change
    assert transitions == Counter({"open": 2, "half_open": 2})
    assert _sums(reader)["sdkcore.circuit_breaker.transitions"] == 4


def test_the_wiring_keeps_watched_breakers_and_budgets_for_their_gauges() -> None:
    """The telemetry holds them weakly: the demo keeps them, so the gauges last as it does."""
    from sdkcore._demo._memcached import _Wiring
    from sdkcore._demo._metrics import Counts

    telemetry, reader = _telemetry()
    counts = Counts()
    wiring = _Wiring(counts, telemetry)
    wiring.never_trips("127.0.0.1:1")
    wiring.orchestrator(RetryBudget(name="shared"))
    del wiring
    import gc

    gc.collect()
    names = set()
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name in ("sdkcore.circuit_breaker.state", "sdkcore.retry_budget.balance"):
                    names |= {p.attributes["sdkcore.endpoint"] for p in metric.data.data_points}
    assert names == {"127.0.0.1:1", "shared"}
    assert len(counts.watched) == 2
