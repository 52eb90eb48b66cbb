"""``sdkcore demo --metrics-port`` scraped by a real Prometheus: its sums equal the reports.

A Prometheus on 127.0.0.1 (temp config and storage, one job of three static targets,
scraped every 250 ms: the breakers' state is a sampled gauge, and the demo's breaker is
open for about a second) starts first; once it scrapes, three demo processes
(``--metrics-port P --linger --json``) run at once, so it sees each from its start.
Once every demo has printed its report and Prometheus has scraped it after that, the
HTTP query API must give, per demo (``sum by (instance)``) and for the fleet (``sum``),
the report's ``counts``: requests, retries and hedges of the demo's own orchestrators,
the channels' calls, breaker transitions by state, budget refusals (exactly), and the
channels' A96 retries and hedges (at least the report's: see AT_LEAST). The README's
Dashboards queries run on the same data (its open-time query at this scrape interval,
as the README says to write it), and none is 0 where the reports say something
happened: retries, each demo's budget refusals, breaker openings, the seconds a breaker
was open (and no more than the demo ran). The Prometheus names are the ones rfc/0006
and the README list.

Needs ``prometheus`` and ``memcached`` (the breaker transitions come from the
memcached-outage scenario): skipped without them locally, failing under ``CI=true``
(``.ci/run`` installs both). 10 to 25 s; every wait is bounded, every process killed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_server import JOB, Prometheus, free_port, prometheus_binary

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("node-restart", "hedged-reads", "memcached-outage")
FLEET = 3
#: The demos keep serving this long after their reports; they are killed once checked.
LINGER = 45
#: Everything (start, runs, scrapes) must be done within this many seconds.
BUDGET = 50.0
#: Prometheus scrapes every demo this often.
SCRAPE_INTERVAL_MS = 250

#: OpenTelemetry instrument -> the name Prometheus stores (dots become underscores, the
#: unit ``s`` adds ``_seconds``, a counter ``_total``; ``{...}`` units add nothing).
PROMETHEUS_NAMES = {
    "sdkcore.request.duration": "sdkcore_request_duration_seconds",  # _bucket, _sum, _count
    "sdkcore.request.retries": "sdkcore_request_retries",  # _bucket, _sum, _count
    "sdkcore.retries": "sdkcore_retries_total",
    "sdkcore.retry.delay": "sdkcore_retry_delay_seconds",  # _bucket, _sum, _count
    "sdkcore.hedges": "sdkcore_hedges_total",
    "sdkcore.hedge.wins": "sdkcore_hedge_wins_total",
    "sdkcore.circuit_breaker.state": "sdkcore_circuit_breaker_state",
    "sdkcore.circuit_breaker.transitions": "sdkcore_circuit_breaker_transitions_total",
    "sdkcore.circuit_breaker.rejections": "sdkcore_circuit_breaker_rejections_total",
    "sdkcore.retry_budget.balance": "sdkcore_retry_budget_balance",
    "sdkcore.retry_budget.rejections": "sdkcore_retry_budget_rejections_total",
}
HISTOGRAMS = {"sdkcore.request.duration", "sdkcore.request.retries", "sdkcore.retry.delay"}


@dataclass
class Demo:
    """One ``sdkcore demo`` process, its metrics port and its ``--json`` report."""

    process: subprocess.Popen[bytes]
    port: int
    stdout: Path
    stderr: Path
    report: dict[str, Any] = field(default_factory=dict)
    #: When the test had the whole report (wall clock, as Prometheus' timestamps).
    reported_at: float = 0.0
    #: When the process started (wall clock).
    started_at: float = 0.0

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def counts(self) -> dict[str, Any]:
        counts: dict[str, Any] = self.report["counts"]
        return counts

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def output(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:]


def _need_memcached() -> None:
    if shutil.which("memcached") is None:
        message = "memcached is not installed; install it with: apt-get install memcached"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message} (CI=true: the Prometheus integration test must run)")
        pytest.skip(message)


def _wait(what: str, deadline: float, ready: Any, detail: Any = lambda: "") -> Any:
    """Poll ``ready()`` until it is truthy; fail naming ``what`` at ``deadline``."""
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} ({BUDGET:.0f} s budget): {detail()}")
        time.sleep(0.05)


def _report_of(demo: Demo) -> dict[str, Any] | None:
    text = demo.stdout.read_text(errors="replace")
    if not text.endswith("}\n"):
        if demo.process.poll() is not None:
            pytest.fail(f"the demo exited ({demo.process.returncode}) with no report: "
                        f"{demo.output()}")  # fmt: skip
        return None
    try:
        report: dict[str, Any] = json.loads(text)
    except ValueError:
        return None  # still being written
    return report


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, list[Demo]]]:
    """Prometheus scraping three demos that have all reported and been scraped since."""
    binary = prometheus_binary()
    _need_memcached()
    deadline = time.monotonic() + BUDGET
    workdir = tmp_path_factory.mktemp("prometheus")
    ports = [free_port() for _ in range(FLEET)]
    targets = [f"127.0.0.1:{port}" for port in ports]
    prometheus = Prometheus(binary, workdir, targets, interval=f"{SCRAPE_INTERVAL_MS}ms")
    demos: list[Demo] = []
    try:
        prometheus.start().wait_scraping()  # before the demos start: it sees them all along
        for i, port in enumerate(ports):
            command = [sys.executable, "-m", "sdkcore", "demo", "--json"]
            command += ["--metrics-port", str(port), "--linger", str(LINGER)]
            for name in SCENARIOS:
                command += ["--scenario", name]
            out, err = workdir / f"demo{i}.json", workdir / f"demo{i}.err"
            with out.open("wb") as stdout, err.open("wb") as stderr:
                process = subprocess.Popen(
                    command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr
                )
            demos.append(Demo(process, port, out, err, started_at=time.time()))
        for demo in demos:
            demo.report = _wait("the demo's report", deadline, lambda d=demo: _report_of(d))
            demo.reported_at = time.time()

        def scraped_after_reports() -> bool:
            # A scrape that began after a demo's report sees its final counts.
            # (timestamp() of a plain selector: its sample's time; of an expression, now)
            up = prometheus.by("instance", f'up{{job="{JOB}"}}')
            last = prometheus.by("instance", f'timestamp(up{{job="{JOB}"}})')
            return all(
                up.get(d.instance) == 1 and last.get(d.instance, 0.0) > d.reported_at for d in demos
            )

        _wait("a scrape of every demo after its report", deadline, scraped_after_reports,
              lambda: prometheus.query(f'timestamp(up{{job="{JOB}"}})'))  # fmt: skip
        yield prometheus, demos
    finally:
        for demo in demos:
            demo.kill()
        prometheus.stop()


def _total(counts: dict[str, Any], *keys: str) -> int:
    """The sum of the report's ``counts`` at ``keys`` (``channel.calls``: a nested key)."""
    total = 0
    for key in keys:
        value: Any = counts
        for part in key.split("."):
            value = value[part]
        total += int(value)
    return total


#: The demo's own requests; a channel's calls are sdkcore requests too, named after
#: their method (``/demo.Kv/Get``).
OWN = '{sdkcore_request_name!~"/.*"}'
CHANNEL = '{sdkcore_request_name=~"/.*"}'

# (the PromQL series, the report's counts whose sum it must equal)
EXACT = [
    (f"sdkcore_request_duration_seconds_count{OWN}", ("requests",)),
    (f"sdkcore_request_retries_count{OWN}", ("requests",)),
    (f"sdkcore_retries_total{OWN}", ("retries",)),
    (f"sdkcore_request_retries_sum{OWN}", ("retries",)),  # a hedge's copies are not retries
    (f"sdkcore_hedges_total{OWN}", ("hedges",)),
    ("sdkcore_retry_budget_rejections_total", ("budget_rejections",)),
    (f"sdkcore_request_duration_seconds_count{CHANNEL}", ("channel.calls",)),
    ("grpc_client_call_duration_seconds_count", ("channel.calls",)),
]
# The channels' retries and hedges in the report are their RetryStats: the attempts that
# went out. The metrics count each retry when it is scheduled and each hedge when it is
# booked, so one whose call ended first (its deadline in the backoff, the winner's answer
# before the copy started) is in the metrics only: at least the report's.
AT_LEAST = [
    ("grpc_client_call_retries_sum", ("channel.retries",)),
    ("grpc_client_call_hedges_sum", ("channel.hedges",)),
    (
        "grpc_client_attempt_started_total",
        ("channel.calls", "channel.retries", "channel.hedges", "channel.transparent_retries"),
    ),
]


def test_each_demo_and_the_fleet_match_their_reports(
    fleet: tuple[Prometheus, list[Demo]],
) -> None:
    prometheus, demos = fleet
    assert prometheus.value(f'count(up{{job="{JOB}"}} == 1)') == FLEET
    for series, keys in EXACT + AT_LEAST:
        per_demo = prometheus.by("instance", f"sum by (instance) ({series})")
        expected = {d.instance: _total(d.counts, *keys) for d in demos}
        got = {d.instance: per_demo.get(d.instance, 0.0) for d in demos}
        fleet_sum = prometheus.value(f"sum({series})")
        detail = (series, [(d.instance, d.counts) for d in demos], got)
        if (series, keys) in EXACT:
            assert got == expected, detail
            assert fleet_sum == sum(expected.values()), detail
        else:
            assert all(got[i] >= expected[i] for i in got), detail
            assert fleet_sum == sum(got.values()), detail
    states = ("open", "half_open", "closed")
    for demo in demos:
        got = prometheus.by(
            "sdkcore_circuit_breaker_state",
            "sum by (sdkcore_circuit_breaker_state) "
            f'(sdkcore_circuit_breaker_transitions_total{{instance="{demo.instance}"}})',
        )
        assert {s: got.get(s, 0.0) for s in states} == demo.counts["breaker_transitions"]
    fleet_transitions = prometheus.by(
        "sdkcore_circuit_breaker_state",
        "sum by (sdkcore_circuit_breaker_state) (sdkcore_circuit_breaker_transitions_total)",
    )
    assert fleet_transitions == {
        s: float(sum(d.counts["breaker_transitions"][s] for d in demos)) for s in states
    }
    # The demos did what the comparison is about: retries, hedges, breakers opening.
    for demo in demos:
        counts = demo.counts
        for key in ("retries", "hedges", "budget_rejections", "channel.retries", "channel.hedges"):
            assert _total(counts, key) > 0, (key, counts)
    assert fleet_transitions.get("open", 0) >= 1  # (closing again depends on timing)
    # A win is a hedged request answered by a later copy: it took at least one hedge.
    wins = prometheus.by("instance", "sum by (instance) (sdkcore_hedge_wins_total)")
    for demo in demos:
        assert wins.get(demo.instance, 0.0) <= _total(demo.counts, "hedges", "channel.hedges")
    # Retries by reason add up to the retries.
    by_reason = prometheus.by(
        "sdkcore_retry_reason", "sum by (sdkcore_retry_reason) (sdkcore_retries_total)"
    )
    assert sum(by_reason.values()) == prometheus.value("sum(sdkcore_retries_total)")
    assert sum(by_reason.values()) >= sum(
        _total(d.counts, "retries", "channel.retries") for d in demos
    )


def test_the_documented_prometheus_names_are_what_prometheus_stores(
    fleet: tuple[Prometheus, list[Demo]],
) -> None:
    prometheus, _ = fleet
    names = {r["metric"]["__name__"] for r in prometheus.query('{__name__=~"sdkcore_.*"}')}
    expected = set()
    for instrument, name in PROMETHEUS_NAMES.items():
        if instrument in HISTOGRAMS:
            expected |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            expected.add(name)
    # Every counter of a watched breaker or budget is there from its watch, at 0 until it
    # counts: the breaker refusals too, which may not have happened.
    assert expected <= names, sorted(expected - names)
    assert names <= expected, sorted(names - expected)
    # The labels a dashboard groups by.
    labels = prometheus.query("sdkcore_retries_total")[0]["metric"]
    assert {"sdkcore_request_name", "sdkcore_retry_reason", "instance", "job"} <= set(labels)
    outcome = prometheus.query("sdkcore_request_duration_seconds_count")[0]["metric"]
    assert "sdkcore_request_outcome" in outcome
    # The service the demo reports as.
    info = prometheus.query(f'target_info{{job="{JOB}"}}')
    assert {r["metric"]["service_name"] for r in info} == {"sdkcore-demo"}


def _dashboard_queries() -> list[str]:
    """The README's Dashboards section: each non-comment line of its ```promql blocks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Dashboards\n", 1)[1].split("\n## ", 1)[0]
    queries = []
    for block in re.findall(r"```promql\n(.*?)```", section, re.DOTALL):
        queries += [line.strip() for line in block.splitlines() if line.strip() and line[0] != "#"]
    return queries


#: The README's open-time query assumes a 15 s scrape interval (in its step and its
#: factor) and says to write one's own: here, the fleet's.
README_INTERVAL = re.compile(r"\[1h:15s\]\) \* 15$")


def _for_the_fleet(query: str) -> str:
    """``query`` with the README's scrape interval (15 s) replaced by the fleet's."""
    seconds = SCRAPE_INTERVAL_MS / 1000
    return README_INTERVAL.sub(f"[1h:{SCRAPE_INTERVAL_MS}ms]) * {seconds}", query)


def _one(queries: list[str], *parts: str) -> str:
    """The README query that has every one of ``parts``."""
    [query] = [q for q in queries if all(part in q for part in parts)]
    return query


def test_the_readme_dashboard_queries_run_on_the_demos_metrics(
    fleet: tuple[Prometheus, list[Demo]],
) -> None:
    prometheus, demos = fleet
    queries = _dashboard_queries()
    assert len(queries) >= 5, queries
    text = " ".join(queries)
    for name in (
        "sdkcore_retries_total",
        "sdkcore_request_duration_seconds_count",
        "sdkcore_hedge_wins_total",
        "sdkcore_hedges_total",
        "sdkcore_circuit_breaker_state",
        "sdkcore_retry_budget_rejections_total",
    ):
        assert name in text, name
    results = {}
    for query in queries:
        result = prometheus.query(_for_the_fleet(query))  # raises on a PromQL error
        assert result, f"no data for the README's query {query!r}"
        for sample in result:
            value = float(sample["value"][1])
            assert value >= 0, (query, sample)  # neither NaN nor negative
        results[query] = result
    # What the reports show happened is not 0 on the dashboards (each demo retried, its
    # budgets refused retries, its breakers opened: see the test above).
    reports = [(d.instance, d.counts) for d in demos]

    def values(query: str) -> list[float]:
        return [float(sample["value"][1]) for sample in results[query]]

    ratio = _one(queries, "sdkcore_retries_total", "sdkcore_request_duration_seconds_count")
    assert '{sdkcore_request_name!~"/.*"}' in ratio  # the outer requests, not the calls
    [value] = values(ratio)
    assert value > 0, (ratio, reports)
    by_reason = _one(queries, "sum by (sdkcore_retry_reason) (rate(sdkcore_retries_total[5m]))")
    sent = _one(queries, "sum by (sdkcore_retry_reason)", "CIRCUIT_BREAKER_OPEN")
    assert 0 < sum(values(sent)) <= sum(values(by_reason)), (sent, by_reason)
    # Breaker open time: seconds, more than 0 where a breaker opened, and no more than the
    # demo ran (from its start to now: a breaker left open stays open while it lingers).
    open_time = _one(queries, "sdkcore_circuit_breaker_state == bool 1")
    assert README_INTERVAL.search(open_time), open_time
    seconds = prometheus.by("instance", f"sum by (instance) ({_for_the_fleet(open_time)})")
    for demo in demos:
        opened = demo.counts["breaker_transitions"]["open"]
        ran = time.time() - demo.started_at
        detail = (open_time, demo.instance, seconds, opened, ran)
        if opened:
            assert 0 < seconds.get(demo.instance, 0.0) <= ran, detail
    # Openings: the counters start at 0 when watched, so increase() sees every opening
    # (a little more: Prometheus extrapolates to the end of the range).
    openings = _one(queries, 'sdkcore_circuit_breaker_state="open"')
    opened = sum(d.counts["breaker_transitions"]["open"] for d in demos)
    assert opened <= sum(values(openings)) <= 2 * opened, (openings, results[openings], opened)


def test_the_readme_budget_query_sees_each_demos_refusals(
    fleet: tuple[Prometheus, list[Demo]],
) -> None:
    """Each demo's budgets refused retries (its report): the README's rate is not 0."""
    prometheus, demos = fleet
    refused = _one(_dashboard_queries(), "sdkcore_retry_budget_rejections_total")
    reports = [(d.instance, d.counts) for d in demos]
    assert sum(float(r["value"][1]) for r in prometheus.query(refused)) > 0, (refused, reports)
    per_demo = refused.replace("sum by (sdkcore_endpoint)", "sum by (instance)")
    got = prometheus.by("instance", per_demo)
    for instance, counts in reports:
        assert counts["budget_rejections"] > 0, counts  # (the first test checks this too)
        assert got.get(instance, 0.0) > 0, (per_demo, got, reports)
    # Per budget: every series that counted a refusal shows a rate.
    total = prometheus.by(
        "key",
        'label_join(sdkcore_retry_budget_rejections_total > 0, "key", "/", '
        '"instance", "sdkcore_endpoint")',
    )
    rates = prometheus.by(
        "key",
        'label_join(rate(sdkcore_retry_budget_rejections_total[5m]), "key", "/", '
        '"instance", "sdkcore_endpoint")',
    )
    assert all(rates.get(key, 0.0) > 0 for key in total), (total, rates)
