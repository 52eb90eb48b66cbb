"""What the demo shows: the summary per strategy, as text (<= 100 columns) or JSON."""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from typing import IO, Any

import attrs

from .._untrusted import count
from ._memcached_report import Outage
from ._memcached_text import OutageStream, render_outage
from ._metrics import Counts, percentile
from ._slowdown import CAPACITY, SECONDS, SERVICE, TIMEOUT, Slowdown, rate
from ._workload import STRATEGY_IDS, OpResult

__all__ = [
    "WIDTH",
    "Progress",
    "Report",
    "Summary",
    "memcached_stream",
    "render_head",
    "render_memcached",
    "render_row",
    "render_slowdown",
    "render_strategy",
    "render_tail",
    "render_text",
    "scenario_id",
    "strategy_id",
    "summarize",
    "to_json",
]

#: The text report never exceeds this many columns.
WIDTH = 100
#: An example error is cut after this many lines in the text report.
EXAMPLE_LINES = 8


@attrs.frozen(slots=True)
class Summary:
    """One scenario (or all of them) under one strategy."""

    ops: int
    successes: int
    #: Failures before the timeout, by exception class name.
    fast_fails: dict[str, int]
    ambiguous_timeouts: int
    unambiguous_timeouts: int
    retries_per_op: float
    p50_ms: float
    p99_ms: float
    retry_reasons: tuple[str, ...]
    #: Retries made by the gRPC channel itself (A6 retry policy, pushback).
    channel_retries: int
    #: Failures that are not sdkcore exceptions (bugs), by exception class name.
    errors: dict[str, int]
    #: Copies sent after the first (hedge() and the channel's hedging policy): not retries.
    hedges: int = 0

    @property
    def unexpected(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "successes": self.successes,
            "fast_fails": dict(self.fast_fails),
            "timeouts": {
                "ambiguous": self.ambiguous_timeouts,
                "unambiguous": self.unambiguous_timeouts,
            },
            "retries_per_op": round(self.retries_per_op, 3),
            "p50_ms": round(self.p50_ms, 2),
            "p99_ms": round(self.p99_ms, 2),
            "retry_reasons": list(self.retry_reasons),
            "channel_retries": self.channel_retries,
            "hedges": self.hedges,
            "unexpected": self.unexpected,
            "errors": dict(self.errors),
        }


def summarize(
    results: Sequence[OpResult], channel_retries: int, channel_hedges: int = 0
) -> Summary:
    latencies = [r.latency * 1000.0 for r in results]
    fast: Counter[str] = Counter(
        r.error for r in results if r.error and not r.timeout and not r.unexpected
    )
    errors: Counter[str] = Counter(r.error for r in results if r.error and r.unexpected)
    reasons: dict[str, None] = {}
    for r in results:
        reasons.update(dict.fromkeys(r.reasons))
    return Summary(
        ops=len(results),
        successes=sum(r.ok for r in results),
        fast_fails=dict(sorted(fast.items())),
        ambiguous_timeouts=sum(r.timeout and r.ambiguous for r in results),
        unambiguous_timeouts=sum(r.timeout and not r.ambiguous for r in results),
        retries_per_op=(sum(r.retries for r in results) / len(results)) if results else 0.0,
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        retry_reasons=tuple(sorted(reasons)),
        channel_retries=channel_retries,
        errors=dict(sorted(errors.items())),
        hedges=sum(r.hedges for r in results) + channel_hedges,
    )


@attrs.define
class Report:
    """Everything the demo measured."""

    target: str
    #: strategy label -> scenario name -> summary ("all" for the total).
    tables: dict[str, dict[str, Summary]] = attrs.field(factory=dict)
    #: exception class name -> (scenario, strategy, str(exc)) of its first occurrence.
    examples: dict[str, tuple[str, str, str]] = attrs.field(factory=dict)
    scenario_titles: dict[str, str] = attrs.field(factory=dict)
    writes_applied: int = 0
    writes_succeeded: int = 0
    duplicate_writes: list[tuple[str, str, int]] = attrs.field(factory=list)
    elapsed_s: float = 0.0
    #: The memcached-outage scenario (None when it was not selected).
    memcached: Outage | None = None
    #: The slowdown scenario (None when it was not selected).
    slowdown: Slowdown | None = None
    #: What sdkcore did, as the demo counted it (what ``--metrics-port`` exports).
    counts: Counts = attrs.field(factory=Counts)

    @property
    def ok(self) -> bool:
        """The demo's checks: no write applied twice, no failure outside sdkcore's exceptions,
        and the memcached scenario's claims (a skipped scenario claims nothing)."""
        unexpected = any(s.unexpected for t in self.tables.values() for s in t.values())
        outage_ok = self.memcached is None or self.memcached.ok
        return not self.duplicate_writes and not unexpected and outage_ok


def scenario_id(name: str) -> str:
    """A scenario's key in ``--json``: its ``--scenario`` name in snake_case."""
    return name.replace("-", "_")


def strategy_id(label: str) -> str:
    """A strategy's key in ``--json`` (stable snake_case; the label is for people)."""
    known = STRATEGY_IDS.get(label)
    return known if known is not None else re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def to_json(report: Report) -> dict[str, Any]:
    """The report as ``--json`` prints it (keys: rfc/0006-demo.md, "The JSON document")."""
    out = {
        "target": report.target,
        "elapsed_s": round(report.elapsed_s, 3),
        "scenarios": {
            scenario_id(name): {"name": name, "title": title}
            for name, title in report.scenario_titles.items()
        },
        "strategies": {
            strategy_id(label): {scenario_id(name): s.to_json() for name, s in table.items()}
            for label, table in report.tables.items()
        },
        "strategy_labels": {strategy_id(label): label for label in report.tables},
        "examples": [
            {
                "exception": name,
                "scenario": scenario_id(sc),
                "strategy": strategy_id(st),
                "message": msg,
            }
            for name, (sc, st, msg) in report.examples.items()
        ],
        "writes": {
            "applied": report.writes_applied,
            "succeeded": report.writes_succeeded,
            "duplicates": [
                {"key": k, "op": op, "applied": n} for k, op, n in report.duplicate_writes
            ],
        },
        "counts": report.counts.to_json(),
        "ok": report.ok,
    }
    if report.slowdown is not None:
        out["slowdown"] = report.slowdown.to_json()
    if report.memcached is not None:
        out["memcached"] = report.memcached.to_json()
    return out


# -- text ----------------------------------------------------------------------------------

_HEAD = (
    f"{'scenario':<16}{'ops':>5}{'ok':>5}{'fast-fail':>11}{'timeout a/u':>13}"
    f"{'retries/op':>12}{'p50 ms':>9}{'p99 ms':>9}{'A6 retries':>12}"
)

LEGEND = (
    ("ok", "operations that returned a value"),
    ("fast-fail", "failed before the timeout, by exception: a strategy or the mapping decided"),
    (
        "timeout a/u",
        "timed out: ambiguous (a write that may have been applied) / unambiguous "
        "(nothing was applied)",
    ),
    ("retries/op", "retries per operation made by sdkcore's RetryOrchestrator"),
    ("p50/p99", "latency of every operation (successes and failures), in milliseconds"),
    ("A6 retries", "retries the gRPC channel made itself (service config retryPolicy, pushback)"),
    ("reasons", "the RetryReasons (RFC 0049) the orchestrator was given"),
    ("hedges", "copies of a read sent after the first (hedging), counted apart from retries"),
)


def _wrap(label: str, text: str, indent: int = 4) -> list[str]:
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=" " * indent + label,
        subsequent_indent=" " * (indent + len(label)),
        break_on_hyphens=False,
    )


def _row(name: str, s: Summary) -> list[str]:
    fast = sum(s.fast_fails.values())
    timeouts = f"{s.ambiguous_timeouts}/{s.unambiguous_timeouts}"
    lines = [
        f"{name:<16.16}{s.ops:>5}{s.successes:>5}{fast:>11}{timeouts:>13}"
        f"{s.retries_per_op:>12.2f}{s.p50_ms:>9.1f}{s.p99_ms:>9.1f}{s.channel_retries:>12}"
    ]
    if name == "all":
        return lines
    if s.retry_reasons:
        lines += _wrap("reasons: ", ", ".join(s.retry_reasons))
    if s.hedges:
        lines += _wrap("hedges: ", f"{s.hedges} copies sent after the first (not retries)")
    if s.fast_fails:
        lines += _wrap("fast-fails: ", ", ".join(f"{k} x{v}" for k, v in s.fast_fails.items()))
    if s.errors:
        lines += _wrap(
            "NOT sdkcore exceptions (a bug): ",
            ", ".join(f"{k} x{v}" for k, v in s.errors.items()),
        )
    return lines


def _plain(text: str) -> str:
    return text


#: The head's words for the scenarios that run without the gRPC cluster.
_ALONE = {"slowdown": "a slow endpoint", "memcached-outage": "a memcached outage"}


def render_slowdown(report: Report, style: Callable[[str], str] = _plain) -> list[str]:
    """The slowdown scenario's lines: both runs side by side (none when it did not run)."""
    result = report.slowdown
    if result is None:
        return []
    out = ["", style("Slowdown: an endpoint past its capacity, without and with a limiter")]
    out += _wrap(
        "",
        f"{CAPACITY} served at a time, {SERVICE * 1000:g} ms each ({CAPACITY / SERVICE:g}/s); "
        f"offered {rate():g}/s for {SECONDS:g} s; timeout {TIMEOUT * 1000:g} ms; "
        "the limiter guards each dispatch inside send.",
        indent=2,
    )
    out.append(
        f"  {'run':<30}{'sent':>6}{'answered':>9}{'goodput/s':>10}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'timed out':>10}{'shed':>6}{'limit':>6}"
    )
    for run in result.runs.values():
        doc = run.to_json()
        limit = "-" if run.settled_limit is None else str(run.settled_limit)
        out.append(
            f"  {run.label:<30.30}{run.sent:>6}{run.answered:>9}{run.goodput:>10.0f}"
            f"{doc['p50_ms']:>8.1f}{doc['p99_ms']:>8.1f}{run.timed_out:>10}{run.shed:>6}{limit:>6}"
        )
    out += _wrap(
        "",
        "timed out: cut in flight (the endpoint did the work, nobody got the answer); shed: "
        "ended without being sent (refused by the limiter until the deadline); p50/p99: "
        "answered requests, from their start; limit: the limiter's limit over the run's last "
        "quarter (the median: overloaded from the start, it first grows, then comes down).",
        indent=2,
    )
    return out


def render_head(report: Report, n_ops: int, style: Callable[[str], str] = _plain) -> list[str]:
    """The first lines: what runs where, and the scenario list (known before anything runs)."""
    head = (
        f"sdkcore demo: {n_ops} operations against a troubled cluster at {report.target}"
        if report.target
        else "sdkcore demo: "
        + " and ".join(_ALONE[n] for n in report.scenario_titles if n in _ALONE)
    )
    out = [style(head), "", "Scenarios"]
    for name, title in report.scenario_titles.items():
        out += _wrap(f"{name:<17}", title, indent=2)
    return out


def render_strategy(label: str, style: Callable[[str], str] = _plain) -> list[str]:
    """The heading of one strategy's table."""
    return ["", style(f"Strategy: {label}"), _HEAD]


def render_row(name: str, summary: Summary) -> list[str]:
    """One scenario's line (and its reasons), or the strategy's ``all`` line."""
    return _row(name, summary)


def memcached_stream(
    emit: Callable[[list[str]], None], style: Callable[[str], str] = _plain
) -> OutageStream:
    """Streams the memcached-outage scenario's lines as it runs (:func:`render_memcached`'s)."""
    return OutageStream(emit, style, _wrap)


def render_memcached(report: Report, style: Callable[[str], str] = _plain) -> list[str]:
    """The memcached-outage scenario's lines (one line when it was skipped)."""
    if report.memcached is None:
        return []
    return render_outage(report.memcached, style, _wrap)


def render_text(report: Report, style: Callable[[str], str] = _plain) -> list[str]:
    """The report as lines of at most :data:`WIDTH` columns.

    The same lines, in the same order, as :func:`render_head`, then per strategy
    :func:`render_strategy` and one :func:`render_row` per scenario, then
    :func:`render_memcached`, then :func:`render_tail`: what a piped run streams as
    each scenario ends.
    """
    n_ops = sum(t["all"].ops for t in report.tables.values() if "all" in t)
    out = render_head(report, n_ops, style)
    for label, table in report.tables.items():
        out += render_strategy(label, style)
        for name, summary in table.items():
            out += render_row(name, summary)
    out += render_slowdown(report, style)
    return out + render_memcached(report, style) + render_tail(report, style)


def render_tail(report: Report, style: Callable[[str], str] = _plain) -> list[str]:
    """What follows the tables: an example of each failure, the writes check, the legend."""
    out: list[str] = []
    if report.examples:
        out.append("")
        out.append(style("One example of each failure (str(exc))"))
        for name, (scenario, strategy, message) in report.examples.items():
            out += _wrap("", f"{name}, in {scenario} under {strategy}:", indent=2)
            lines = textwrap.wrap(
                message, width=WIDTH, initial_indent="    ", subsequent_indent="    "
            )
            if len(lines) > EXAMPLE_LINES + 2:  # never cut just a line or two
                left = len(message) - sum(len(line) - 3 for line in lines[:EXAMPLE_LINES])
                lines = [
                    *lines[:EXAMPLE_LINES],
                    f"    ... ({left} more characters; --json has all)",
                ]
            out += lines
    if not report.tables:  # only the memcached scenario ran
        return ["", f"Finished in {report.elapsed_s:.1f} s."]
    out.append("")
    out.append(style("Writes (non-idempotent)"))
    # Applications beyond the first of a write applied more than once: not lost replies.
    again = sum(n - 1 for _, _, n in report.duplicate_writes)
    lost = report.writes_applied - again - report.writes_succeeded
    text = f"the server applied {count(report.writes_applied, 'write')}"
    if again:
        text += f" ({again} of them a write it had applied already)"
    text += f"; {report.writes_succeeded} returned success to the client"
    if lost > 0:
        text += (
            f"; {lost} {'was' if lost == 1 else 'were'} applied but "
            f"{'its reply was' if lost == 1 else 'their replies were'} lost: the client got an "
            f"error for {'it' if lost == 1 else 'each'}"
        )
        if not again:  # none was applied twice (the FAILED line below says when one was)
            text += ", and none was applied again"
    out += _wrap("", text + ".", indent=2)
    if report.duplicate_writes:
        out.append(style("  FAILED: writes applied more than once:"))
        for key, op, n in report.duplicate_writes[:10]:
            out.append(f"    key {key!r} op {op!r}: {n} times")
    else:
        out.append("  OK: no write was applied twice.")
    unexpected = sum(t["all"].unexpected for t in report.tables.values() if "all" in t)
    if unexpected:
        out.append(
            style(f"  FAILED: {unexpected} operations failed with an error that is not an sdkcore")
        )
        out.append(style("  exception (listed under each strategy): a bug."))
    out.append("")
    out.append(style("Legend"))
    for term, meaning in LEGEND:
        out += _wrap(f"{term:<13}", meaning, indent=2)
    out.append("")
    out.append(f"Finished in {report.elapsed_s:.1f} s.")
    return out


def colour_enabled(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bold(text: str) -> str:
    return f"\x1b[1m{text}\x1b[0m"


class Progress:
    """A live progress line on stderr while the demo runs (rich if installed).

    Shown only when stderr is a terminal: piped or captured runs get nothing.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total = total
        self.done = 0
        self.label = ""
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = enabled and bool(isatty and isatty())
        self._rich: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        try:  # optional (extra "cli"): a plain line otherwise
            console_mod: Any = importlib.import_module("rich.console")
            progress_mod: Any = importlib.import_module("rich.progress")
        except ImportError:
            return self
        console = console_mod.Console(file=self.stream, width=min(WIDTH, _terminal_width()))
        self._rich = progress_mod.Progress(
            progress_mod.TextColumn("{task.description}"),
            progress_mod.BarColumn(bar_width=30),
            progress_mod.MofNCompleteColumn(),
            progress_mod.TimeElapsedColumn(),
            console=console,
            transient=True,
            # The report streams to the real stdout (e.g. a pipe) while the bar is on
            # stderr: rich must not take stdout over.
            redirect_stdout=False,
        )
        self._rich.__enter__()
        self._task = self._rich.add_task("starting", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.__exit__(None, None, None)
        elif self.enabled:
            self.stream.write("\r" + " " * (WIDTH - 1) + "\r")
            self.stream.flush()

    def stage(self, label: str) -> None:
        self.label = label
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, description=self.label[:50])
            return
        line = f"{self.label[:60]:<60} {self.done:>5}/{self.total} ops"
        self.stream.write("\r" + line[: WIDTH - 1])
        self.stream.flush()


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((WIDTH, 24)).columns
