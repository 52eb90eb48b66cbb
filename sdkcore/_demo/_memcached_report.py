"""The memcached outage scenario's settings, what it measured, and how the report shows it.

The settings, the values (:class:`Outage`, :class:`BudgetRun`, :class:`Transition`)
and the text rendering; the scenario that runs and fills them is
:mod:`sdkcore._demo._memcached`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ._mcserver import INSTALL

__all__ = ["BudgetRun", "Outage", "Transition", "render_outage"]

# -- the scenario's settings ---------------------------------------------------------------
NAME = "memcached-outage"
#: The one line a run without memcached prints.
SKIP_LINE = f"{NAME} skipped: no memcached on PATH; {INSTALL} (or your distro's package)"

#: The stream: SET+GET pairs per second (half to each endpoint), for ISSUE_FOR seconds.
PAIRS_PER_S = 100
ISSUE_FOR = 2.4
#: A is killed at KILL_AT and restarted OUTAGE seconds later (seconds from the start).
KILL_AT = 0.4
OUTAGE = 1.2
#: Every request's timeout (seconds), across its attempts.
TIMEOUT = 0.5
#: The breaker of each endpoint.
BREAKER: dict[str, Any] = {
    "volume_threshold": 10,
    "error_threshold_percentage": 50,
    "sleep_window": 0.25,
    "canary_timeout": 0.25,
    "rolling_window": 10.0,
}
#: The shared budget: 20 % of first attempts, plus a reserve of 1/s over 10 s.
BUDGET: dict[str, Any] = {"ttl": 10.0, "min_retries_per_sec": 1, "percent_can_retry": 0.2}
RESERVE = int(BUDGET["min_retries_per_sec"] * BUDGET["ttl"])
#: The budget run: this many GETs at once into a dead endpoint, with this timeout.
BUDGET_REQUESTS = 100
BUDGET_TIMEOUT = 0.3
#: A safety net on the whole scenario (it takes about 4 s).
LIMIT = 60.0


def planned_requests() -> int:
    """How many requests the scenario sends (for a progress bar)."""
    return 2 * int(PAIRS_PER_S * ISSUE_FOR) + 2 * BUDGET_REQUESTS


@attrs.frozen(slots=True)
class Transition:
    """A breaker changed state (``t``: seconds from the start of the stream)."""

    t: float
    endpoint: str
    state: str
    cause: str


@attrs.frozen(slots=True)
class BudgetRun:
    """One run of the total outage: what reached the dead endpoint."""

    label: str
    first_attempts: int
    #: Attempts the client made (first attempts and retries: each connects and writes).
    attempts: int
    #: Request frames that reached the endpoint's proxy before it hung up.
    frames: int
    #: Requests ended with RETRY_BUDGET_EXHAUSTED.
    refused_by_budget: int

    def to_json(self) -> dict[str, Any]:
        return {
            "first_attempts": self.first_attempts,
            "attempts": self.attempts,
            "per_first_attempt": round(self.attempts / max(self.first_attempts, 1), 3),
            "frames_at_endpoint": self.frames,
            "refused_by_budget": self.refused_by_budget,
        }


@attrs.define
class Outage:
    """What the scenario measured (``skipped`` without memcached)."""

    skipped: bool = False
    version: str = ""
    endpoints: dict[str, str] = attrs.field(factory=dict)
    #: (seconds from the start, what happened): kills, restarts, breaker transitions.
    timeline: list[tuple[float, str]] = attrs.field(factory=list)
    transitions: list[Transition] = attrs.field(factory=list)
    killed_at: float | None = None
    tripped_at: float | None = None
    restarted_at: float | None = None
    closed_at: float | None = None
    #: Frames at A from the kill to the trip, and from the trip to the restart, by opcode name.
    frames_before_trip: dict[str, int] = attrs.field(factory=dict)
    frames_after_trip: dict[str, int] = attrs.field(factory=dict)
    #: Requests to A issued while its breaker was open (trip to restart; ``restarted_at``
    #: is when the restart began, memcached listens a few ms later).
    requests_while_open: int = 0
    #: Outcomes of the requests to A issued between the kill and the restart.
    outage_outcomes: dict[str, int] = attrs.field(factory=dict)
    #: Requests to A issued after its breaker closed, and how many succeeded.
    recovered: tuple[int, int] = (0, 0)
    #: Requests to B (never killed), and how many succeeded.
    steady: tuple[int, int] = (0, 0)
    requests: int = 0
    budget_balance: int = 0
    budget_refused: int = 0
    budget_runs: list[BudgetRun] = attrs.field(factory=list)
    #: A failure outside sdkcore's exceptions, or the scenario itself failing.
    errors: list[str] = attrs.field(factory=list)
    elapsed_s: float = 0.0

    @property
    def sleep_windows(self) -> float:
        """Sleep windows from the trip to the restart."""
        if self.tripped_at is None or self.restarted_at is None:
            return 0.0
        return (self.restarted_at - self.tripped_at) / float(BREAKER["sleep_window"])

    @property
    def budget_bound(self) -> int:
        return int(BUDGET_REQUESTS * (1 + BUDGET["percent_can_retry"])) + RESERVE

    @property
    def checks(self) -> dict[str, bool]:
        """The scenario's claims, each true or false."""
        if self.skipped:
            return {}
        states = [t.state for t in self.transitions if t.endpoint == "A"]
        probes = self.frames_after_trip.get("NOOP", 0)
        with_budget = [r for r in self.budget_runs if r.label == "with the budget"]
        return {
            "breaker_opened": "open" in states,
            "breaker_closed_after_restart": self.closed_at is not None,
            "one_probe_per_sleep_window": self.tripped_at is not None
            and probes <= int(self.sleep_windows) + 1,
            "requests_succeed_after_restart": self.recovered[0] > 0
            and self.recovered[0] == self.recovered[1],
            "other_endpoint_breaker_stayed_closed": not any(
                t.endpoint == "B" for t in self.transitions
            ),
            "budget_held": bool(with_budget) and with_budget[0].attempts <= self.budget_bound,
        }

    @property
    def ok(self) -> bool:
        return self.skipped or (not self.errors and all(self.checks.values()))

    def to_json(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": True, "hint": SKIP_LINE, "ok": True}

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 3)

        return {
            "skipped": False,
            "memcached_version": self.version,
            "endpoints": dict(self.endpoints),
            "settings": {
                "pairs_per_s": PAIRS_PER_S,
                "issue_for_s": ISSUE_FOR,
                "timeout_s": TIMEOUT,
                "breaker": dict(BREAKER),
                "budget": dict(BUDGET),
            },
            "requests": self.requests,
            "killed_at_s": r(self.killed_at),
            "tripped_at_s": r(self.tripped_at),
            "restarted_at_s": r(self.restarted_at),
            "closed_at_s": r(self.closed_at),
            "transitions": [
                {"t_s": round(t.t, 3), "endpoint": t.endpoint, "state": t.state, "cause": t.cause}
                for t in self.transitions
            ],
            "outage": {
                "frames_before_trip": dict(self.frames_before_trip),
                "frames_after_trip": dict(self.frames_after_trip),
                "probes": self.frames_after_trip.get("NOOP", 0),
                "sleep_windows": round(self.sleep_windows, 2),
                "requests_while_open": self.requests_while_open,
                "outcomes": dict(self.outage_outcomes),
            },
            "recovered": {"requests": self.recovered[0], "succeeded": self.recovered[1]},
            "steady": {"requests": self.steady[0], "succeeded": self.steady[1]},
            "shared_budget": {"balance": self.budget_balance, "refused": self.budget_refused},
            "budget": {
                "requests": BUDGET_REQUESTS,
                "timeout_s": BUDGET_TIMEOUT,
                "bound": self.budget_bound,
                "runs": {run.label: run.to_json() for run in self.budget_runs},
            },
            "checks": self.checks,
            "errors": list(self.errors),
            "elapsed_s": round(self.elapsed_s, 3),
            "ok": self.ok,
        }


# -- the breakers ------------------------------------------------------------------------


def render_outage(result: Outage, style: Callable[[str], str], wrap: Any) -> list[str]:
    """The scenario's lines (``wrap(label, text, indent)`` wraps to the report's width)."""
    if result.skipped:
        return ["", SKIP_LINE]
    out = ["", style(f"Scenario {NAME}: memcached {result.version}, two endpoints on 127.0.0.1")]
    out += wrap(
        "",
        f"A {result.endpoints.get('A', '?')} and B {result.endpoints.get('B', '?')} "
        f"(counting proxies in front of memcached). BestEffort, timeout {TIMEOUT:g} s; a "
        f"CircuitBreaker per endpoint (volume {BREAKER['volume_threshold']}, "
        f"{BREAKER['error_threshold_percentage']} %, sleep window {BREAKER['sleep_window']:g} s, "
        f"a NOOP canary) and one shared RetryBudget; {PAIRS_PER_S} SET+GET pairs a second "
        f"for {ISSUE_FOR:g} s, half to each endpoint.",
        2,
    )
    for t, text in _compact(result.timeline):
        out += wrap(f"{t:+7.3f} s  ", text, 2)
    if result.tripped_at is not None and result.restarted_at is not None:
        after = result.frames_after_trip
        probes = after.get("NOOP", 0)
        others = sum(n for op, n in after.items() if op != "NOOP")
        out += wrap(
            "",
            f"While A's breaker was open ({result.restarted_at - result.tripped_at:.2f} s, "
            f"{result.sleep_windows:.1f} sleep windows): {result.requests_while_open} requests "
            f"to A were issued and {probes + others} frames reached it: {probes} NOOP probes"
            + (f" and {others} GET/SET let through just before the trip" if others else "")
            + f". From the kill to the trip: {sum(result.frames_before_trip.values())} frames.",
            2,
        )
    if result.outage_outcomes:
        text = ", ".join(f"{k} x{n}" for k, n in result.outage_outcomes.items())
        out += wrap("", f"Requests to A issued while it was down: {text}.", 2)
    out += wrap(
        "",
        f"After the NOOP canary closed A's breaker: {result.recovered[1]} of "
        f"{result.recovered[0]} requests to A succeeded. B (never killed): {result.steady[1]} "
        f"of {result.steady[0]} succeeded. Shared budget at the end: {result.budget_balance} "
        f"retries available, {result.budget_refused} withdrawal(s) refused.",
        2,
    )
    if result.budget_runs:
        out += wrap(
            "",
            f"Total outage: {BUDGET_REQUESTS} GETs at once to a dead A, timeout "
            f"{BUDGET_TIMEOUT:g} s, breaker held closed so that only the budget limits "
            "retries. Attempts: first attempts and retries, each one a connection and a write; "
            "frames: those that reached A's proxy before it hung up.",
            2,
        )
        out.append(f"    {'':<18}{'first attempts':>16}{'attempts':>10}{'per first':>11}"
                   f"{'frames at A':>13}{'refused by budget':>19}")  # fmt: skip
        for run in result.budget_runs:
            ratio = run.attempts / max(run.first_attempts, 1)
            out.append(
                f"    {run.label:<18}{run.first_attempts:>16}{run.attempts:>10}{ratio:>11.2f}"
                f"{run.frames:>13}{run.refused_by_budget:>19}"
            )
        pct = BUDGET["percent_can_retry"]
        out += wrap(
            "",
            f"Bound with the budget: {BUDGET_REQUESTS} first attempts x {1 + pct:g} + a reserve "
            f"of {RESERVE} = {result.budget_bound}.",
            4,
        )
    for error in result.errors:
        out += wrap("", style(f"FAILED: {error}"), 2)
    failed = [name.replace("_", " ") for name, held in result.checks.items() if not held]
    if failed:
        out += wrap("", style("FAILED: " + "; ".join(failed)), 2)
    elif not result.errors:
        out += wrap(
            "",
            "OK: A's breaker opened and closed around the restart, with at most one probe per "
            "sleep window; B's stayed closed; the budget held.",
            2,
        )
    return out


def _compact(timeline: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """A probe that went out and failed at once reads as one line."""
    out: list[tuple[float, str]] = []
    for t, text in timeline:
        if (
            out
            and "breaker open: the probe failed" in text
            and "breaker half_open" in out[-1][1]
            and out[-1][1].split("'")[0] == text.split("'")[0]
        ):
            who = text.split("'")[0]
            out[-1] = (out[-1][0], f"{who}'s breaker half_open: a NOOP probe, which failed: open")
            continue
        out.append((t, text))
    return out
