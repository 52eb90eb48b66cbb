"""The ``memcached-outage`` scenario: circuit breakers and a retry budget on a real memcached.

Two real ``memcached`` processes (A and B) on 127.0.0.1, each behind a
:class:`~sdkcore._demo._mcserver.CountingProxy` that counts the request frames
reaching it, and the example SDK :class:`sdkcore.examples.memcached.MemcachedClient`
in front of both: BestEffort retries, a :class:`~sdkcore.CircuitBreaker` per
endpoint (a NOOP canary as the probe) and one :class:`~sdkcore.RetryBudget`
shared by every request.

1. **Around a restart.** A steady stream of SET-then-GET pairs (half to each
   endpoint); A is killed, stays down for a while, and is restarted on the same
   port. The breaker of A opens, lets one NOOP probe through per sleep window,
   and closes when a canary is answered after the restart; B's stays closed.
2. **The budget in a total outage.** A is killed again and 100 GETs go to it at
   once, breaker held closed so that only the budget limits retries: once with
   the budget, once without, side by side.

Without ``memcached`` on PATH the scenario is skipped with one line saying how to
install it. Nothing here is scripted on the client side: every retry, refusal and
probe is sdkcore's (and the example client's) decision.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import attrs

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    CouchbaseException,
    DocumentNotFoundException,
    RequestCanceledException,
    RetryBudget,
    RetryOrchestrator,
    TimeoutException,
)
from sdkcore.examples.memcached import MemcachedClient, endpoint_down
from sdkcore.examples.memcached._endpoint import pick
from sdkcore.mapping import KvOpcode

from ._mcserver import INSTALL, CountingProxy, MemcachedProcess, memcached_binary, memcached_version

__all__ = [
    "NAME",
    "SKIP_LINE",
    "Outage",
    "planned_requests",
    "render_outage",
    "run_outage",
]

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


class _WatchedBreaker(CircuitBreaker):
    """A breaker that reports its state changes (the demo's timeline).

    It looks at its state after every call the client makes; a HALF_OPEN probe that
    ran out of ``canary_timeout`` is found by the next of those calls, as always.
    """

    __slots__ = ("_label", "_on_change", "_seen")

    def __init__(
        self, label: str, on_change: Callable[[str, str, str], None], **settings: Any
    ) -> None:
        super().__init__(**settings)
        self._label = label
        self._on_change = on_change
        self._seen = CircuitState.CLOSED

    def admit(self) -> CircuitState | None:
        admitted = super().admit()
        self._note(None)
        return admitted

    def try_acquire(self) -> bool:
        granted = super().try_acquire()
        self._note(None)
        return granted

    def record_success(self) -> None:
        super().record_success()
        self._note(False)

    def record_failure(self, error: BaseException) -> None:
        super().record_failure(error)
        self._note(True)

    def _note(self, failed: bool | None) -> None:
        state = self.state
        before = self._seen
        if state is before:
            return
        self._seen = state
        if state is CircuitState.OPEN and before is CircuitState.CLOSED:
            outcomes, failures = self.counts
            cause = f"{failures} failures in {outcomes} outcomes"
        elif state is CircuitState.OPEN:
            cause = "the probe failed" if failed else "the probe ran out of canary_timeout"
        elif state is CircuitState.HALF_OPEN:
            cause = "the sleep window is over; one probe (a NOOP) goes out"
        else:
            cause = "the NOOP canary was answered" if failed is False else "reset"
        self._on_change(self._label, state.value, cause)


def _never_trips(name: str) -> CircuitBreaker:
    """A breaker that never trips: in the budget runs only the budget limits retries."""
    return CircuitBreaker(name=name, is_failure=endpoint_down, volume_threshold=10**9)


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, DocumentNotFoundException):
        return "not found"
    if isinstance(exc, TimeoutException):
        return "timed out"
    if isinstance(exc, RequestCanceledException):
        context = exc.context
        why = getattr(getattr(context, "cancellation_reason", None), "name", "")
        if why == "RETRY_BUDGET_EXHAUSTED":
            return "refused by the budget"
        last = getattr(getattr(context, "reason", None), "name", why or "?")
        return f"canceled after {last}"
    if isinstance(exc, CouchbaseException):
        return type(exc).__name__
    return f"NOT an sdkcore exception: {type(exc).__name__}"


def _describe(exc: BaseException) -> str:
    """``Type: message``, looking inside exception groups (task groups raise them)."""
    inner = getattr(exc, "exceptions", None)
    if inner:
        return "; ".join(_describe(e) for e in inner)
    return f"{type(exc).__name__}: {exc}"


def _key_for(i: int, endpoint: int) -> str:
    """A fresh key that the client routes to ``endpoint`` (of two; crc32, as the client does)."""
    j = 0
    while pick(f"demo:{i}:{j}", 2) != endpoint:
        j += 1
    return f"demo:{i}:{j}"


def _opcodes(counts: dict[int, int]) -> dict[str, int]:
    names = {int(op): op.name for op in KvOpcode}
    return {names.get(op, f"0x{op:02x}"): n for op, n in sorted(counts.items()) if n}


def _minus(after: dict[int, int], before: dict[int, int]) -> dict[int, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}


# -- the run -------------------------------------------------------------------------------


async def run_outage(
    *,
    on_done: Callable[[], None] = lambda: None,
    which: Callable[[str], str | None] | None = None,
) -> Outage:
    """Run the scenario (skipped, at once, when ``memcached`` is not on PATH)."""
    binary = memcached_binary(which)
    if binary is None:
        return Outage(skipped=True)
    result = Outage(version=memcached_version(binary))
    started = time.perf_counter()
    try:
        with anyio.fail_after(LIMIT):
            async with (
                MemcachedProcess(binary) as a,
                MemcachedProcess(binary) as b,
                anyio.create_task_group() as proxies,
            ):
                pa, pb = CountingProxy(a.port), CountingProxy(b.port)
                await proxies.start(pa.serve)
                await proxies.start(pb.serve)
                result.endpoints = {"A": f"127.0.0.1:{pa.port}", "B": f"127.0.0.1:{pb.port}"}
                try:
                    await _around_a_restart(result, a, pa, pb, on_done)
                    a.kill()
                    for label, budget in (
                        ("with the budget", RetryBudget(**BUDGET, name="demo-outage")),
                        ("without a budget", None),
                    ):
                        result.budget_runs.append(await _total_outage(label, pa, budget, on_done))
                finally:
                    proxies.cancel_scope.cancel()
    except Exception as exc:  # memcached would not start, the safety net ran out, ...
        result.errors.append(f"the scenario failed: {_describe(exc)}")
    result.elapsed_s = time.perf_counter() - started
    return result


async def _around_a_restart(
    result: Outage,
    a: MemcachedProcess,
    pa: CountingProxy,
    pb: CountingProxy,
    on_done: Callable[[], None],
) -> None:
    budget = RetryBudget(**BUDGET, name="demo-shared")
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), retry_budget=budget)
    t0 = anyio.current_time()
    marks: dict[str, dict[int, int]] = {}
    labels = {result.endpoints["A"]: "A", result.endpoints["B"]: "B"}

    def now() -> float:
        return anyio.current_time() - t0

    def changed(label: str, state: str, cause: str) -> None:
        t = now()
        result.transitions.append(Transition(t, label, state, cause))
        result.timeline.append((t, f"{label}'s breaker {state}: {cause}"))
        if label != "A" or result.killed_at is None:
            return
        if state == "open" and result.tripped_at is None:
            result.tripped_at = t
            marks["trip"] = pa.snapshot()
        elif state == "closed" and result.closed_at is None:
            result.closed_at = t  # only memcached's answer closes it: after the restart

    def breaker(name: str) -> CircuitBreaker:
        return _WatchedBreaker(
            labels.get(name, name), changed, name=name, is_failure=endpoint_down, **BREAKER
        )

    # (issued at, endpoint, outcome) of every request
    done: list[tuple[float, str, str]] = []

    async with MemcachedClient(
        [result.endpoints["A"], result.endpoints["B"]],
        orchestrator=orchestrator,
        timeout=TIMEOUT,
        breaker=breaker,
    ) as client:
        # Both requests of a pair count as issued when the pair starts: a GET that follows
        # a SET the outage failed finds nothing, and belongs to the outage.
        async def one(issued: float, endpoint: str, call: Any) -> bool:
            try:
                await call()
                outcome = "ok"
            except Exception as exc:
                outcome = _outcome(exc)
            done.append((issued, endpoint, outcome))
            on_done()
            return outcome == "ok"

        async def pair(i: int) -> None:
            endpoint = i % 2
            label = "AB"[endpoint]
            key = _key_for(i, endpoint)
            value = f"value {i}".encode()
            issued = now()
            await one(issued, label, lambda: client.set(key, value))
            await one(issued, label, lambda: client.get(key))

        async def operator() -> None:
            await anyio.sleep_until(t0 + KILL_AT)
            a.kill()
            result.killed_at = now()
            marks["kill"] = pa.snapshot()
            result.timeline.append((result.killed_at, "memcached A killed (SIGKILL)"))
            await anyio.sleep_until(t0 + KILL_AT + OUTAGE)
            # The outage ends when the restart begins: a probe may find memcached
            # listening (and close the breaker) before start() has seen it listen.
            result.restarted_at = now()
            marks["restart"] = pa.snapshot()
            await a.start()
            listening = (now() - result.restarted_at) * 1000
            result.timeline.append(
                (
                    result.restarted_at,
                    f"memcached A restarted, same port, empty (listening after {listening:.0f} ms)",
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            for i in range(int(PAIRS_PER_S * ISSUE_FOR)):
                await anyio.sleep_until(t0 + i / PAIRS_PER_S)
                tg.start_soon(pair, i)

    result.timeline.sort(key=lambda item: item[0])
    result.requests = len(done)
    result.budget_balance = budget.balance
    result.budget_refused = budget.refused
    kill, trip, restart = marks.get("kill", {}), marks.get("trip"), marks.get("restart", {})
    if trip is not None:
        result.frames_before_trip = _opcodes(_minus(trip, kill))
        result.frames_after_trip = _opcodes(_minus(restart, trip))
    killed = result.killed_at or 0.0
    restarted = result.restarted_at or 0.0
    outage: Counter[str] = Counter()
    recovered = [0, 0]
    steady = [0, 0]
    for issued, endpoint, outcome in done:
        if outcome.startswith("NOT an sdkcore"):
            result.errors.append(outcome)
        if endpoint == "B":
            steady[0] += 1
            steady[1] += outcome == "ok"
            continue
        if killed <= issued < restarted:
            outage[outcome] += 1
            if result.tripped_at is not None and issued >= result.tripped_at:
                result.requests_while_open += 1
        if result.closed_at is not None and issued >= result.closed_at:
            recovered[0] += 1
            recovered[1] += outcome == "ok"
    result.outage_outcomes = dict(outage.most_common())
    result.recovered = (recovered[0], recovered[1])
    result.steady = (steady[0], steady[1])


async def _total_outage(
    label: str, proxy: CountingProxy, budget: RetryBudget | None, on_done: Callable[[], None]
) -> BudgetRun:
    """BUDGET_REQUESTS GETs at once to the dead endpoint behind ``proxy``."""
    kwargs: dict[str, Any] = {} if budget is None else {"retry_budget": budget}
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), **kwargs)
    before = proxy.snapshot()
    refused = 0
    attempts = 0
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=orchestrator,
        timeout=BUDGET_TIMEOUT,
        breaker=_never_trips,
    ) as client:

        async def one(i: int) -> None:
            nonlocal refused, attempts
            try:
                await client.get(f"outage:{i}")
                attempts += 1  # (memcached is dead: not expected)
            except Exception as exc:
                refused += _outcome(exc) == "refused by the budget"
                context = getattr(exc, "context", None)
                attempts += 1 + int(getattr(context, "retry_attempts", 0))
            on_done()

        async with anyio.create_task_group() as tg:
            for i in range(BUDGET_REQUESTS):
                tg.start_soon(one, i)
    await anyio.sleep(CountingProxy.LINGER * 2)  # the proxy's last reads
    frames = sum(_minus(proxy.snapshot(), before).values())
    return BudgetRun(label, BUDGET_REQUESTS, attempts, frames, refused)


# -- text ----------------------------------------------------------------------------------


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
