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

from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    RetryBudget,
    RetryOrchestrator,
)
from sdkcore.examples.memcached import MemcachedClient, endpoint_down
from sdkcore.examples.memcached._endpoint import pick
from sdkcore.mapping import KvOpcode

from ._mcserver import CountingProxy, MemcachedProcess, memcached_binary, memcached_version
from ._memcached_report import (
    BREAKER,
    BUDGET,
    BUDGET_REQUESTS,
    BUDGET_TIMEOUT,
    ISSUE_FOR,
    KILL_AT,
    LIMIT,
    NAME,
    OUTAGE,
    PAIRS_PER_S,
    RECOVERED_ERRORS,
    SKIP_LINE,
    TIMEOUT,
    BudgetRun,
    Outage,
    Transition,
    planned_requests,
)
from ._memcached_text import UNEXPECTED, OutageStream, outcome_of, render_outage
from ._metrics import CountedBreaker, CountingOrchestrator, Counts

__all__ = [
    "NAME",
    "SKIP_LINE",
    "Outage",
    "OutageStream",
    "planned_requests",
    "render_outage",
    "run_outage",
    "tally",
]


class _WatchedBreaker(CountedBreaker):
    """A breaker that reports its state changes (the demo's timeline).

    It looks at its state after every call the client makes; a HALF_OPEN probe that
    ran out of ``canary_timeout`` is found by the next of those calls, as always.
    """

    __slots__ = ("_label", "_on_change", "_seen")

    def __init__(
        self,
        label: str,
        on_change: Callable[[str, str, str], None],
        transitions: Counter[str],
        **settings: Any,
    ) -> None:
        super().__init__(transitions, **settings)
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


class _Wiring:
    """What every orchestrator, breaker and budget of the scenario is given: the demo's
    :class:`Counts`, and its :class:`sdkcore.Telemetry` (None without ``--metrics-port``)."""

    def __init__(self, counts: Counts | None, telemetry: Any) -> None:
        self.counts = Counts() if counts is None else counts
        self.telemetry = telemetry
        # Made (and watched) at once: each budget's refusals counter is at 0 from the
        # start, so a scrape sees it before the outage's burst (rfc/0008).
        self.shared = self.budget("demo-shared")
        self.outage = self.budget("demo-outage")

    def budget(self, name: str) -> RetryBudget:
        budget = RetryBudget(**BUDGET, name=name)
        if self.telemetry is not None:
            self.telemetry.watch(budget)
        return budget

    def orchestrator(self, budget: RetryBudget | None) -> RetryOrchestrator:
        kwargs: dict[str, Any] = {} if budget is None else {"retry_budget": budget}
        if budget is not None and self.telemetry is not None:
            self.counts.watched.append(budget)  # the orchestrator has it watched
        return CountingOrchestrator(
            self.counts, BestEffortRetryStrategy(), telemetry=self.telemetry, **kwargs
        )

    def watch(self, breaker: CircuitBreaker) -> CircuitBreaker:
        if self.telemetry is not None:
            self.telemetry.watch(breaker)
            self.counts.watched.append(breaker)
        return breaker

    def never_trips(self, name: str) -> CircuitBreaker:
        """A breaker that never trips: in the budget runs only the budget limits retries."""
        return self.watch(
            CountedBreaker(
                self.counts.breaker_transitions,
                name=name,
                is_failure=endpoint_down,
                volume_threshold=10**9,
            )
        )

    def refused(self, budget: RetryBudget | None) -> None:
        """Count what ``budget`` refused (once it serves no more requests)."""
        if budget is not None:
            self.counts.budget_rejections += budget.refused


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
    stream: OutageStream | None = None,
    counts: Counts | None = None,
    telemetry: Any = None,
    wiring: _Wiring | None = None,
) -> Outage:
    """Run the scenario (skipped, at once, when ``memcached`` is not on PATH).

    ``stream`` gets the text report's lines as they become known (the caller ends
    it with ``stream.finish(result)``). Every request, breaker transition and budget
    refusal is added to ``counts``; ``telemetry`` (an :class:`sdkcore.Telemetry`, or
    None) gets every orchestrator, breaker and budget.
    """
    if wiring is None:
        wiring = _Wiring(counts, telemetry)
    binary = memcached_binary(which)
    if binary is None:
        return Outage(skipped=True)
    result = Outage(version=memcached_version(binary))
    lines = _Lines(result, stream)
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
                if stream is not None:
                    stream.head(result)
                try:
                    await _around_a_restart(result, a, pa, pb, on_done, lines, wiring)
                    if stream is not None:
                        stream.restart_done(result)
                    a.kill()
                    budget = wiring.outage
                    runs: list[tuple[str, str, RetryBudget | None]] = [
                        ("with_budget", "with the budget", budget),
                        ("without_budget", "without a budget", None),
                    ]
                    for key, label, each in runs:
                        run = await _total_outage(key, label, pa, each, on_done, wiring)
                        result.budget_runs.append(run)
                        if stream is not None:
                            stream.budget_run(run)
                finally:
                    proxies.cancel_scope.cancel()
    except Exception as exc:  # memcached would not start, the safety net ran out, ...
        result.errors.append(f"the scenario failed: {_describe(exc)}")
    result.elapsed_s = time.perf_counter() - started
    return result


class _Lines:
    """The timeline: each line recorded in the result and streamed as it happens."""

    def __init__(self, result: Outage, stream: OutageStream | None) -> None:
        self._result = result
        self._stream = stream

    def add(self, t: float, text: str) -> None:
        self._result.timeline.append((t, text))
        if self._stream is not None:
            self._stream.event(t, text)


async def _around_a_restart(
    result: Outage,
    a: MemcachedProcess,
    pa: CountingProxy,
    pb: CountingProxy,
    on_done: Callable[[], None],
    lines: _Lines,
    wiring: _Wiring,
) -> None:
    budget = wiring.shared
    orchestrator = wiring.orchestrator(budget)
    t0 = anyio.current_time()
    marks: dict[str, dict[int, int]] = {}
    labels = {result.endpoints["A"]: "A", result.endpoints["B"]: "B"}

    def now() -> float:
        return anyio.current_time() - t0

    def changed(label: str, state: str, cause: str) -> None:
        t = now()
        result.transitions.append(Transition(t, label, state, cause))
        lines.add(t, f"{label}'s breaker {state}: {cause}")
        if label != "A" or result.killed_at is None:
            return
        if state == "open" and result.tripped_at is None:
            result.tripped_at = t
            marks["trip"] = pa.snapshot()
        elif state == "closed" and result.closed_at is None:
            result.closed_at = t  # only memcached's answer closes it: after the restart

    def breaker(name: str) -> CircuitBreaker:
        return wiring.watch(
            _WatchedBreaker(
                labels.get(name, name),
                changed,
                wiring.counts.breaker_transitions,
                name=name,
                is_failure=endpoint_down,
                **BREAKER,
            )
        )

    # (issued at, endpoint, outcome, "Type: message" of its failure or "") of every request
    done: list[tuple[float, str, str, str]] = []

    async with MemcachedClient(
        [result.endpoints["A"], result.endpoints["B"]],
        orchestrator=orchestrator,
        timeout=TIMEOUT,
        breaker=breaker,
    ) as client:
        # Both requests of a pair count as issued when the pair starts: a GET that follows
        # a SET the outage failed finds nothing, and belongs to the outage.
        async def one(issued: float, endpoint: str, call: Any) -> bool:
            error = ""
            try:
                await call()
                outcome = "ok"
            except Exception as exc:
                outcome = outcome_of(exc)
                error = _describe(exc)
                if outcome == UNEXPECTED:
                    result.errors.append(f"NOT an sdkcore exception: {error}")
            done.append((issued, endpoint, outcome, error))
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
            lines.add(result.killed_at, "memcached A killed (SIGKILL)")
            await anyio.sleep_until(t0 + KILL_AT + OUTAGE)
            # The outage ends when the restart begins: a probe may find memcached
            # listening (and close the breaker) before start() has seen it listen.
            result.restarted_at = now()
            marks["restart"] = pa.snapshot()
            lines.add(result.restarted_at, "memcached A restarted, same port, empty")
            await a.start()
            listening = (now() - result.restarted_at) * 1000
            lines.add(now(), f"memcached A listening again ({listening:.0f} ms after the restart)")

        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            for i in range(int(PAIRS_PER_S * ISSUE_FOR)):
                await anyio.sleep_until(t0 + i / PAIRS_PER_S)
                tg.start_soon(pair, i)

    wiring.refused(budget)
    result.requests = len(done)
    result.budget_balance = budget.balance
    result.budget_refused = budget.refused
    kill, trip, restart = marks.get("kill", {}), marks.get("trip"), marks.get("restart", {})
    if trip is not None:
        result.frames_before_trip = _opcodes(_minus(trip, kill))
        result.frames_after_trip = _opcodes(_minus(restart, trip))
    tally(result, done)


def tally(result: Outage, done: list[tuple[float, str, str, str]]) -> None:
    """Count ``done`` into ``result``: each request's (issued at, endpoint, outcome,
    ``Type: message`` of its failure or "") against the kill, trip, restart and close
    times ``result`` holds. No I/O: the test gives it made-up requests."""
    killed = result.killed_at or 0.0
    restarted = result.restarted_at or 0.0
    outage: Counter[str] = Counter()
    recovered = [0, 0]
    failed_after: Counter[str] = Counter()
    steady = [0, 0]
    for issued, endpoint, outcome, error in done:
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
            if outcome != "ok":
                failed_after[outcome] += 1
                if len(result.recovered_errors) < RECOVERED_ERRORS:
                    t = issued - result.closed_at
                    result.recovered_errors.append(f"issued {t * 1000:.0f} ms after: {error}")
    result.outage_outcomes = dict(outage.most_common())
    result.recovered = (recovered[0], recovered[1])
    result.recovered_failures = dict(failed_after.most_common())
    result.steady = (steady[0], steady[1])


async def _total_outage(
    key: str,
    label: str,
    proxy: CountingProxy,
    budget: RetryBudget | None,
    on_done: Callable[[], None],
    wiring: _Wiring,
) -> BudgetRun:
    """BUDGET_REQUESTS GETs at once to the dead endpoint behind ``proxy``."""
    orchestrator = wiring.orchestrator(budget)
    before = proxy.snapshot()
    refused = 0
    attempts = 0
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=orchestrator,
        timeout=BUDGET_TIMEOUT,
        breaker=wiring.never_trips,
    ) as client:

        async def one(i: int) -> None:
            nonlocal refused, attempts
            try:
                await client.get(f"outage:{i}")
                attempts += 1  # (memcached is dead: not expected)
            except Exception as exc:
                refused += outcome_of(exc) == "refused_by_budget"
                context = getattr(exc, "context", None)
                # Attempts sent: a retry booked and never sent (its backoff cut by the
                # deadline) was refunded to the budget, so it is not counted against it.
                records = getattr(context, "attempts", None)
                attempts += (
                    1
                    if not records
                    else sum(1 for a in records if a.effect is not AttemptEffect.NOT_SENT)
                )
            on_done()

        async with anyio.create_task_group() as tg:
            for i in range(BUDGET_REQUESTS):
                tg.start_soon(one, i)
    wiring.refused(budget)
    await anyio.sleep(CountingProxy.LINGER * 2)  # the proxy's last reads
    frames = sum(_minus(proxy.snapshot(), before).values())
    return BudgetRun(key, label, BUDGET_REQUESTS, attempts, frames, refused)


# -- text ----------------------------------------------------------------------------------
