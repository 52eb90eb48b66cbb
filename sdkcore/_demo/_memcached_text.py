"""The memcached outage scenario's text report: in one piece, or streamed as it runs.

:func:`render_outage` renders a finished :class:`~sdkcore._demo._memcached_report.Outage`;
:class:`OutageStream` emits the same lines, line for line, while the scenario runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sdkcore import (
    CouchbaseException,
    DocumentNotFoundException,
    RequestCanceledException,
    TimeoutException,
)

from .._untrusted import count
from ._memcached_report import (
    BREAKER,
    BUDGET,
    BUDGET_REQUESTS,
    BUDGET_TIMEOUT,
    ISSUE_FOR,
    NAME,
    PAIRS_PER_S,
    RESERVE,
    SKIP_LINE,
    TIMEOUT,
    BudgetRun,
    Outage,
)

__all__ = ["UNEXPECTED", "OutageStream", "outcome_of", "outcome_text", "render_outage"]


def outcome_of(exc: BaseException | None) -> str:
    """The outcome's id: a stable snake_case key (the text report shows :func:`outcome_text`)."""
    if exc is None:
        return "ok"
    if isinstance(exc, DocumentNotFoundException):
        return "not_found"
    if isinstance(exc, TimeoutException):
        return "timed_out"
    if isinstance(exc, RequestCanceledException):
        context = exc.context
        why = getattr(getattr(context, "cancellation_reason", None), "name", "")
        if why == "RETRY_BUDGET_EXHAUSTED":
            return "refused_by_budget"
        last = getattr(getattr(context, "reason", None), "name", why or "unknown")
        return f"canceled_after_{last.lower()}"
    if isinstance(exc, CouchbaseException):
        return _snake(type(exc).__name__)
    return UNEXPECTED


#: The outcome of a failure outside sdkcore's exceptions (a bug; named in ``errors``).
UNEXPECTED = "not_an_sdkcore_exception"


def _snake(name: str) -> str:
    """``TemporaryFailureException`` -> ``temporary_failure_exception``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def outcome_text(outcome: str) -> str:
    """How the text report shows an outcome id (``canceled_after_<reason>``: the reason's name)."""
    if outcome.startswith(_CANCELED):
        return f"canceled after {outcome[len(_CANCELED) :].upper()}"
    return _OUTCOMES.get(outcome, outcome.replace("_", " "))


_CANCELED = "canceled_after_"
_OUTCOMES = {"refused_by_budget": "refused by the budget"}

Wrap = Callable[[str, str, int], list[str]]


def _head(result: Outage, style: Callable[[str], str], wrap: Wrap) -> list[str]:
    """The heading and the set-up (known once both endpoints listen)."""
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
    return out


def _event(t: float, text: str, wrap: Wrap) -> list[str]:
    """One line of the timeline (a kill, a restart, a breaker's transition)."""
    return wrap(f"{t:+7.3f} s  ", text, 2)


def _restart_summary(result: Outage, wrap: Wrap) -> list[str]:
    """What the stream around the restart measured (known once it ends)."""
    out: list[str] = []
    if result.tripped_at is not None and result.restarted_at is not None:
        after = result.frames_after_trip
        probes = after.get("NOOP", 0)
        others = sum(n for op, n in after.items() if op != "NOOP")
        out += wrap(
            "",
            f"While A's breaker was open ({result.restarted_at - result.tripped_at:.2f} s, "
            f"{result.sleep_windows:.1f} sleep windows): {result.requests_while_open} requests "
            f"to A were issued and {count(probes + others, 'frame')} reached it: "
            f"{count(probes, 'NOOP probe')}"
            + (f" and {others} GET/SET let through just before the trip" if others else "")
            + ". From the kill to the trip (requests sent to A before its breaker opened): "
            + f"{count(sum(result.frames_before_trip.values()), 'frame')}.",
            2,
        )
    if result.outage_outcomes:
        text = ", ".join(f"{outcome_text(k)} x{n}" for k, n in result.outage_outcomes.items())
        out += wrap("", f"Requests to A issued while it was down: {text}.", 2)
    failed = ""
    if result.recovered_failures:
        failed = (
            " (failed: "
            + ", ".join(f"{outcome_text(k)} x{n}" for k, n in result.recovered_failures.items())
            + ")"
        )
    out += wrap(
        "",
        f"After the NOOP canary closed A's breaker: {result.recovered[1]} of "
        f"{result.recovered[0]} requests to A succeeded{failed}. B (never killed): "
        f"{result.steady[1]} of {result.steady[0]} succeeded. Shared budget at the end: "
        f"{result.budget_balance} retries available, "
        f"{count(result.budget_refused, 'withdrawal')} refused.",
        2,
    )
    for error in result.recovered_errors:
        out += wrap("", f"Failed after the close: {error}", 4)
    return out


def _budget_head(wrap: Wrap) -> list[str]:
    out = wrap(
        "",
        f"Total outage: {BUDGET_REQUESTS} GETs at once to a dead A, timeout "
        f"{BUDGET_TIMEOUT:g} s, breaker held closed so that only the budget limits "
        "retries. Attempts: first attempts and retries, each one a connection and a write; "
        "frames: those that reached A's proxy before it hung up.",
        2,
    )
    out.append(f"    {'':<18}{'first attempts':>16}{'attempts':>10}{'per first':>11}"
               f"{'frames at A':>13}{'refused by budget':>19}")  # fmt: skip
    return out


def _budget_row(run: BudgetRun) -> list[str]:
    ratio = run.attempts / max(run.first_attempts, 1)
    return [
        f"    {run.label:<18}{run.first_attempts:>16}{run.attempts:>10}{ratio:>11.2f}"
        f"{run.frames:>13}{run.refused_by_budget:>19}"
    ]


def _ending(result: Outage, style: Callable[[str], str], wrap: Wrap) -> list[str]:
    """The budget's bound, then the errors and the verdict (known at the end)."""
    out: list[str] = []
    if result.budget_runs:
        pct = BUDGET["retry_ratio"]
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


def render_outage(result: Outage, style: Callable[[str], str], wrap: Wrap) -> list[str]:
    """The scenario's lines (``wrap(label, text, indent)`` wraps to the report's width).

    The same lines, in the same order, as an :class:`OutageStream` emits while the
    scenario runs.
    """
    if result.skipped:
        return ["", SKIP_LINE]
    out = _head(result, style, wrap)
    for t, text in _compact(result.timeline):
        out += _event(t, text, wrap)
    out += _restart_summary(result, wrap)
    if result.budget_runs:
        out += _budget_head(wrap)
        for run in result.budget_runs:
            out += _budget_row(run)
    return out + _ending(result, style, wrap)


class OutageStream:
    """Emits the scenario's text lines as they become known: what a piped run streams.

    The scenario calls :meth:`head` once both endpoints listen, :meth:`event` for each
    line of the timeline as it happens, :meth:`restart_done` when the stream around
    the restart has been measured and :meth:`budget_run` as each budget run ends; the
    caller calls :meth:`finish` with the result. Together they emit
    :func:`render_outage`'s lines, line for line (a half-open line is held until the
    next event: a probe that fails at once reads as one line).
    """

    def __init__(
        self, emit: Callable[[list[str]], None], style: Callable[[str], str], wrap: Wrap
    ) -> None:
        self._emit = emit
        self._style = style
        self._wrap = wrap
        self._sent: list[str] = []
        self._held: tuple[float, str] | None = None
        self._budget_rows = 0

    def _out(self, lines: list[str]) -> None:
        if lines:
            self._sent += lines
            self._emit(lines)

    def head(self, result: Outage) -> None:
        self._out(_head(result, self._style, self._wrap))

    def event(self, t: float, text: str) -> None:
        held, self._held = self._held, None
        if held is not None:
            merged = _compact([held, (t, text)])
            if len(merged) == 1:
                self._out(_event(*merged[0], self._wrap))
                return
            self._out(_event(*held, self._wrap))
        if _HALF_OPEN in text:
            self._held = (t, text)
        else:
            self._out(_event(t, text, self._wrap))

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._out(_event(*held, self._wrap))

    def restart_done(self, result: Outage) -> None:
        self._flush()
        self._out(_restart_summary(result, self._wrap))

    def budget_run(self, run: BudgetRun) -> None:
        if not self._budget_rows:
            self._out(_budget_head(self._wrap))
        self._budget_rows += 1
        self._out(_budget_row(run))

    def finish(self, result: Outage) -> None:
        """What is left of :func:`render_outage` (all of it when nothing was emitted yet)."""
        self._flush()
        lines = render_outage(result, self._style, self._wrap)
        self._out(lines[len(self._sent) :] if lines[: len(self._sent)] == self._sent else lines)


_HALF_OPEN = "breaker half_open"
_PROBE_FAILED = "breaker open: the probe failed"


def _compact(timeline: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """A probe that went out and failed at once reads as one line."""
    out: list[tuple[float, str]] = []
    for t, text in timeline:
        if (
            out
            and _PROBE_FAILED in text
            and _HALF_OPEN in out[-1][1]
            and out[-1][1].split("'")[0] == text.split("'")[0]
        ):
            who = text.split("'")[0]
            out[-1] = (out[-1][0], f"{who}'s breaker half_open: a NOOP probe, which failed: open")
            continue
        out.append((t, text))
    return out
