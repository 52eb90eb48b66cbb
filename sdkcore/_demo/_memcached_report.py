"""The memcached outage scenario's settings, and what it measured (its JSON).

The settings and the values (:class:`Outage`, :class:`BudgetRun`, :class:`Transition`);
the scenario that runs and fills them is :mod:`sdkcore._demo._memcached`, the text
report :mod:`sdkcore._demo._memcached_text`.

JSON keys are stable snake_case identifiers; the only keys taken verbatim from the
library are opcode names (``frames_before_trip``, ``frames_after_trip``).
"""

from __future__ import annotations

from typing import Any

import attrs

from ._mcserver import INSTALL

__all__ = ["BudgetRun", "Outage", "Transition", "planned_requests"]

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
BUDGET: dict[str, Any] = {"ttl": 10.0, "min_retries_per_sec": 1, "retry_ratio": 0.2}
RESERVE = int(BUDGET["min_retries_per_sec"] * BUDGET["ttl"])
#: The budget run: this many GETs at once into a dead endpoint, with this timeout.
BUDGET_REQUESTS = 100
BUDGET_TIMEOUT = 0.3
#: How many failures after the breaker closed the report quotes (``Type: message``).
RECOVERED_ERRORS = 3
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

    #: The JSON key (``with_budget``, ``without_budget``).
    key: str
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
            "label": self.label,
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
    #: Outcomes of the requests to A issued between the kill and the restart, by outcome id
    #: (``timed_out``, ``refused_by_budget``, ...: see :func:`outcome_text`).
    outage_outcomes: dict[str, int] = attrs.field(factory=dict)
    #: Requests to A issued after its breaker closed, and how many succeeded.
    recovered: tuple[int, int] = (0, 0)
    #: Those that failed, by outcome id, and the first few of them quoted (when they were
    #: issued after the close, and ``Type: message``): the claim that requests succeed
    #: after the restart names what broke it.
    recovered_failures: dict[str, int] = attrs.field(factory=dict)
    recovered_errors: list[str] = attrs.field(factory=list)
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
        return int(BUDGET_REQUESTS * (1 + BUDGET["retry_ratio"])) + RESERVE

    @property
    def checks(self) -> dict[str, bool]:
        """The scenario's claims, each true or false."""
        if self.skipped:
            return {}
        states = [t.state for t in self.transitions if t.endpoint == "A"]
        probes = self.frames_after_trip.get("NOOP", 0)
        with_budget = [r for r in self.budget_runs if r.key == "with_budget"]
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
            "endpoints": {label.lower(): address for label, address in self.endpoints.items()},
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
                {
                    "t_s": round(t.t, 3),
                    "endpoint": t.endpoint.lower(),
                    "state": t.state,
                    "cause": t.cause,
                }
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
            "recovered": {
                "requests": self.recovered[0],
                "succeeded": self.recovered[1],
                "failures": dict(self.recovered_failures),
                "first_errors": list(self.recovered_errors),
            },
            "steady": {"requests": self.steady[0], "succeeded": self.steady[1]},
            "shared_budget": {"balance": self.budget_balance, "refused": self.budget_refused},
            "budget": {
                "requests": BUDGET_REQUESTS,
                "timeout_s": BUDGET_TIMEOUT,
                "bound": self.budget_bound,
                "runs": {run.key: run.to_json() for run in self.budget_runs},
            },
            "checks": self.checks,
            "errors": list(self.errors),
            "elapsed_s": round(self.elapsed_s, 3),
            "ok": self.ok,
        }
