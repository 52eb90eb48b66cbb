"""Random schedules through every door WITH telemetry attached, checking rfc/0008 per request.

Each seed builds one ``RetryOrchestrator(telemetry=Telemetry(...))`` over the OpenTelemetry
SDK (in-memory reader and exporter, ``telemetry_kit.Otel``), sometimes with a
``RetryBudget``, a ``CircuitBreaker`` and a ``ConcurrencyLimiter`` (both watched), and 14 to
24 concurrent requests through a random mix of doors: ``execute`` (with and without a
timeout), the README's hand-wired loop (``attempt()`` + ``maybe_retry`` + ``succeed``/
``fail``), the same loop without ``attempt()`` ("bare": ``maybe_retry`` + ``succeed``/
``fail`` only), ``hedge`` with a random ``HedgePolicy``, and, in a separate test,
``execute_sync`` from 4 to 10 threads. Sends answer, fail retryably (random reasons,
effects, server hints; breaker and limiter refusals), fail for good, or take up to 3 ms,
and now and then first run a request of their own through a door (nested: a child of the
attempt's span); strategies retry with small backoffs, refuse (with the default or their
own exception), or must be awaited; timeouts of 1 to 25 ms expire in flight and in
backoffs; another task (thread) calls ``Request.cancel()`` at a random moment, right after
a failure, while a send is in flight, or as an answer is handed over; the caller's own
cancel scope is cancelled (or ``move_on_after`` runs out); hand-wired loops may await a
"pooled connection" between ``maybe_retry`` and their next attempt; the loop stalls now and
then. Every caller runs its door inside an application span.

The plan of a seed is fixed by the seed, its interleaving is not: every check holds
whatever the interleaving. After every seed, per request (each request has a name of its
own, so each metric point and span is its own; a failure prints the seed, the backend, and
per request its plan, what its caller got, its sends and what is wrong):

* ``sdkcore.request.duration``: exactly one point (count 1) for every request a door ran;
  none for a hedge refused before sending, nor for a request ``Request.cancel()``
  completed before a bare loop's first call into sdkcore ("records nothing, as the other
  doors" for a refused call); its ``sdkcore.request.outcome`` is what the caller got:
  ``success`` for an answer, ``timeout`` for a ``TimeoutException``, ``cancelled`` for
  ``RequestCanceledException`` whose context says ``CANCELLED_VIA_CONTEXT`` and for the
  caller's own cancellation, ``failure`` for every other error (refusals included);
  ``error.type`` the class name of what the caller got, absent on success;
  ``0 <= duration <=`` the time from just before the request was built to just after its
  door ended;
* ``sdkcore.request.retries``: exactly one point (count 1); its value is the request's
  ``retry_attempts`` for every door but ``hedge`` (0 there); that equals the sum of
  ``sdkcore.retries`` for the request (by reason: the reasons of its first ``retries``
  sends, each of which failed retryably), the count of ``sdkcore.retry.delay`` and of the
  request span's ``sdkcore.retry`` events (same reasons, same total delay); and it is
  ``sends - 1``, or ``sends`` only when the last send failed retryably and a retry was
  booked that was never sent (a backoff capped at the deadline, a cancellation in the
  backoff, the deadline found by the next ``attempt()``: rfc/0008 "A backoff capped at
  the deadline counts as a retry"); a refusal books none;
* hedges: ``sdkcore.hedges`` = the copies after the first whose ``send`` was called;
  ``sdkcore.hedge.wins`` = 1 exactly when the caller got the answer of a copy other than
  the first;
* spans: every span started is ended exactly once (``telemetry_kit.SpanCounter``; the SDK's
  ended-span warnings are caught too); exactly one request span per request (kind CLIENT,
  a child of the caller's span, ``sdkcore.request.id``, ``outcome`` and ``retries`` as the
  metrics; status ERROR with ``error.type`` unless it succeeded; started no later than its
  first send, ended no earlier than its last); one ``sdkcore.attempt`` child per call of
  ``send`` (none for the bare loop, whose sends sdkcore never sees), which was the current
  span inside that ``send``, numbered 1.. in order (hedges: ``index + 1``, with
  ``sdkcore.hedge.index``), ERROR when its ``send`` raised; no other sdkcore span;
* the OpenTelemetry context is the same after every door returned or raised as before
  (and the caller's span current again); inside the bare loop's ``send`` it is the
  caller's; nothing is logged by OpenTelemetry (``Failed to detach context``, ended-span
  warnings) and no telemetry call failed (``Telemetry._guard``);
* the watched objects: ``sdkcore.circuit_breaker.rejections`` and
  ``sdkcore.concurrency_limiter.rejections`` count the refusals the sends saw,
  ``sdkcore.retry_budget.rejections`` the budget's ``refused``, the gauges read the
  objects' state; no task outlives the doors (fuzz_kit.live_tasks).

Where rfc/0008 does not say, the checks accept what is consistent rather than guess:

* a loop without ``attempt()`` is not told of ``Request.cancel()`` while its ``send``
  runs: ``succeed()``/``fail()`` then find the request cancelled and record ``cancelled``
  (``error.type`` ``RequestCanceledException`` / the error ``fail`` was given), whatever
  the loop returns; the span must agree with the metric;
* the caller's cancellation outside sdkcore's calls (a bare loop's ``send``, a pool wait)
  reaches sdkcore only through ``fail(request, the cancellation)``, which completes the
  request CANCELLED (``TASK_CANCELLED``): ``cancelled``;
* nothing escapes the caller's scope (until 2026-11-28 sdkcore's own cancellation could
  escape an anyio scope that fired about when the request's deadline did: rfc/0001, "The
  deadline and the caller's own cancellation in one turn (asyncio)").
"""

from __future__ import annotations

import collections
import logging
import math
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

pytest.importorskip("opentelemetry.sdk")

from fuzz_kit import PlainError, Threads, run_seed, show, through_door, with_permit
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from telemetry_kit import Metric, Otel, SpanCounter

from sdkcore import (
    AttemptEffect,
    BestEffortRetryStrategy,
    CancellationReason,
    CircuitBreaker,
    ConcurrencyLimiter,
    HedgePolicy,
    InvalidArgumentException,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryAction,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    TimeoutException,
)

ASYNC_SEEDS = range(24)
SYNC_SEEDS = range(12)
SAFETY = 5.0  # seconds: a seed whose doors hang fails here instead of hanging the suite

R = RetryReason
NOT_SENT = AttemptEffect.NOT_SENT
NOT_APPLIED = AttemptEffect.NOT_APPLIED
MAYBE = AttemptEffect.MAYBE_APPLIED
VIA_CONTEXT = CancellationReason.CANCELLED_VIA_CONTEXT

NAME = "sdkcore.request.name"
OUTCOME = "sdkcore.request.outcome"
ERROR_TYPE = "error.type"
REASON = "sdkcore.retry.reason"
RETRIES = "sdkcore.request.retries"

#: Reasons a send may fail with (AUTHENTICATION_ERROR is terminal for the default strategy).
REASONS = [
    R.KV_LOCKED,
    R.KV_TEMPORARY_FAILURE,
    R.SOCKET_CLOSED_WHILE_IN_FLIGHT,  # maybe applied: never retried for a non-idempotent one
    R.UNKNOWN,
    R.SOCKET_NOT_AVAILABLE,  # not sent
    R.SERVICE_NOT_AVAILABLE,
    R.AUTHENTICATION_ERROR,
]
#: Always-retry: RFC 0049's controlled backoff (1, 10, 50 ms...) whatever the strategy, so
#: only for requests with a timeout, whose deadline then caps the wait (a capped retry).
ALWAYS_RETRY = [R.KV_NOT_MY_VBUCKET]
GUARD_REASONS = (R.CIRCUIT_BREAKER_OPEN, R.CONCURRENCY_LIMITED)


class Refused(Exception):
    """The exception a refusing strategy chooses (``RetryAction.no_retry(factory)``)."""


# -- what OpenTelemetry reports besides the spans and metrics -------------------------------


class Caught(logging.Handler):
    """Every record OpenTelemetry logs at WARNING or above (``Failed to detach context``,
    ``Calling end() on an ended span``, ``Setting attribute on ended span``...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({show(record.exc_info[1])})"
        self.records.append(text)


class Telemetered:
    """One seed's Otel kit, with the counting processor and OpenTelemetry's log caught."""

    def __init__(self) -> None:
        self.otel = Otel()
        self.processor = SpanCounter()
        self.otel.tracers.add_span_processor(self.processor)
        self.caught = Caught()
        self.logger = logging.getLogger("opentelemetry")
        self.level = self.logger.level

    def __enter__(self) -> Telemetered:
        self.logger.addHandler(self.caught)
        if self.logger.getEffectiveLevel() > logging.WARNING:
            self.logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.caught)
        self.logger.setLevel(self.level)
        self.otel.shutdown()


# -- plans and what happened ----------------------------------------------------------------


@dataclass
class Step:
    """One planned answer of the endpoint (the n-th send of a request; past the plan: ok)."""

    delay: float  # seconds the send takes after its first checkpoint
    kind: str = "ok"  # "ok", "retry" (RetryableError) or "plain" (PlainError)
    reason: RetryReason | None = None
    effect: AttemptEffect | None = None
    hint: float | None = None  # RetryableError(retry_after=...)
    nested: bool = False  # the send first runs a request of its own through a door

    def __repr__(self) -> str:
        if self.nested:
            return f"nested+{self.kind}@{self.delay * 1000:.1f}ms"
        if self.kind != "retry":
            return f"{self.kind}@{self.delay * 1000:.1f}ms"
        assert self.reason is not None
        extra = "" if self.effect is None else f"/{self.effect.name}"
        extra += "" if self.hint is None else f"/hint {self.hint * 1000:.0f}ms"
        return f"{self.reason.name}{extra}@{self.delay * 1000:.1f}ms"


@dataclass
class Plan:
    rid: int
    door: str  # execute, hand, bare, hedge, sync
    idempotent: bool
    timeout: float | None
    strategy: str  # default, best, refuse, async
    backoff: float  # the best/refuse/async strategies' constant backoff
    refuse_after: int  # refuse: no retry once this many were booked
    own_error: bool  # refuse: with Refused rather than RequestCanceledException
    steps: list[Step]
    # none; request_cancel / caller_cancel at interfere_at; move_on(interfere_at);
    # cancel_after_fail / caller_after_fail: right after send number cancel_on failed;
    # answer_then_cancel: send number cancel_on gets its answer from a task that calls
    # Request.cancel() right after handing it over; cancel_in_send: send number cancel_on
    # waits until another task (thread) called Request.cancel(), then answers as planned;
    # cancel_on_answer (sync): another thread cancels as that send answers
    interference: str
    interfere_at: float
    cancel_on: int
    start_at: float
    use_acquire: bool
    hedge: HedgePolicy | None
    nested: bool = False  # a request made inside another's send (no guards, no interference)
    # hand and bare loops: seconds awaited before each attempt after the first (a pooled
    # connection; 0: one checkpoint), outside any sdkcore call; None: nothing awaited
    pool_wait: float | None = None

    def __str__(self) -> str:
        timeout = "none" if self.timeout is None else f"{self.timeout * 1000:.1f}ms"
        strategy = self.strategy
        if strategy == "refuse":
            strategy += f"(after {self.refuse_after}, {'Refused' if self.own_error else 'RCE'})"
        hedge = ""
        if self.hedge is not None:
            delay = self.hedge.delay.total_seconds() * 1000
            hedge = f", hedge(max {self.hedge.max_attempts}, delay {delay:.1f}ms)"
        if self.pool_wait is not None:
            hedge += f", pool_wait={self.pool_wait * 1000:.2f}ms"
        return (
            f"door={self.door}, idempotent={self.idempotent}, timeout={timeout}, "
            f"strategy={strategy}, backoff={self.backoff * 1000:.1f}ms{hedge}, "
            f"interference={self.interference}@{self.interfere_at * 1000:.1f}ms "
            f"(send {self.cancel_on}), steps={self.steps}"
        )


@dataclass
class Call:
    """One call of the door's ``send`` (a hedge: of one copy)."""

    index: int  # hedge copy (0 for the other doors)
    ordinal: int  # 1-based, among this request's calls
    span_id: int  # the current span inside send
    trace_id: int
    wall_start: int  # time.time_ns() as send began
    wall_end: int = 0
    outcome: str = "in_flight"  # ok, retry, plain, cut (a BaseException)
    reason: RetryReason | None = None
    error: BaseException | None = None
    value: str | None = None

    def __repr__(self) -> str:
        what = self.outcome
        if self.reason is not None:
            what += f":{self.reason.name}"
        return f"#{self.ordinal}[{self.index}] {what} span={self.span_id:x}"


@dataclass
class Record:
    plan: Plan
    name: str
    request: Request | None = None
    calls: list[Call] = field(default_factory=list)
    next_step: int = 0
    outcome: str = "not_started"  # returned, raised, cancelled, escaped
    value: Any = None
    error: BaseException | None = None
    t0: float = 0.0  # time.monotonic() just before the request was built
    t1: float = 0.0  # ... just after its door ended
    caller_span_id: int = 0
    caller_trace_id: int = 0
    context_problems: list[str] = field(default_factory=list)
    cancel_called: bool = False  # Request.cancel() was called while the door ran
    # bare loop: the request was pending at the loop's first call into sdkcore (None: none)
    seen_pending: bool | None = None
    # the caller's cancellation reached a hand-wired loop outside sdkcore's calls (its bare
    # send, its pool wait): the loop told sdkcore with fail(request, the cancellation)
    failed_by_loop: bool = False
    ended: bool = False

    def first_call(self) -> None:
        """The bare loop is about to call into sdkcore (maybe_retry, succeed, fail)."""
        if self.seen_pending is None:
            assert self.request is not None
            self.seen_pending = self.request.state is RequestState.PENDING

    def describe(self) -> str:
        request = self.request
        state = "not built"
        if request is not None:
            why = request.cancellation_reason
            state = (
                f"{request.state.name} {why and why.name}, "
                f"retry_attempts {request.retry_attempts}, id {request.id}"
            )
        got = (
            f"returned {self.value!r}"
            if self.outcome == "returned"
            else f"{self.outcome} {show(self.error)}"
        )
        return (
            f"request {self.plan.rid} {self.name!r} ({self.plan})\n"
            f"    caller got: {got}; request: {state}; cancel() called: {self.cancel_called}\n"
            f"    sends: {self.calls}"
        )


# -- strategies --------------------------------------------------------------------------------


class Refusing(BestEffortRetryStrategy):
    """Best effort with a constant backoff, refusing once ``after`` retries were booked."""

    def __init__(self, backoff: float, after: int, own: bool) -> None:
        super().__init__(backoff=lambda n: backoff)
        self.after = after
        self.own = own

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.retry_attempts >= self.after:
            if self.own:
                return RetryAction.no_retry(lambda context: Refused(f"no: {context.request_id}"))
            return RetryAction.no_retry(why="the plan refuses")
        return super().decide(request, reason)


class Pondering:
    """A strategy that must be awaited (it "asks a service" first), then decides as a
    BestEffortRetryStrategy with a constant backoff."""

    def __init__(self, backoff: float, wait: float) -> None:
        self.inner = BestEffortRetryStrategy(backoff=lambda n: backoff)
        self.wait = wait

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        await anyio.sleep(self.wait)
        return self.inner.decide(request, reason)


def strategy_for(plan: Plan, rng: random.Random) -> RetryStrategy | None:
    if plan.strategy == "best":
        return BestEffortRetryStrategy(backoff=lambda n: plan.backoff)
    if plan.strategy == "refuse":
        return Refusing(plan.backoff, plan.refuse_after, plan.own_error)
    if plan.strategy == "async":
        return Pondering(plan.backoff, rng.uniform(0.0, 0.002))
    return None  # the orchestrator's default: FastFailOnTerminalErrorRetryStrategy


# -- the plan of a seed ------------------------------------------------------------------------


def make_step(rng: random.Random, bounded: bool) -> Step:
    delay = rng.choice([0.0, 0.0, rng.uniform(0.0002, 0.003), rng.uniform(0.0002, 0.003)])
    roll = rng.random()
    if roll < 0.12:
        return Step(delay, "plain")
    if roll < 0.25:
        return Step(delay, "ok", nested=rng.random() < 0.3)
    reason = rng.choice(REASONS + ALWAYS_RETRY if bounded else REASONS)
    effect = rng.choice([None, None, None, NOT_SENT, NOT_APPLIED, MAYBE])
    hints = [None, None, None, None, 0.001, 0.002]
    if bounded:
        hints.append(0.05)  # past most deadlines: the request times out at once
    return Step(delay, "retry", reason, effect, rng.choice(hints))


def make_plan(rng: random.Random, rid: int, door: str) -> Plan:
    idempotent = rng.random() < (0.9 if door == "hedge" else 0.5)
    timeout = rng.choice([None, rng.uniform(0.001, 0.025), rng.uniform(0.003, 0.025)])
    bounded = timeout is not None
    # Without a deadline: a constant small backoff (the default one grows to 500 ms).
    strategies = ["best", "refuse", "async"] + (["default", "default"] if bounded else [])
    if door == "sync":
        strategies.remove("async")  # execute_sync takes synchronous strategies only
    strategy = rng.choice(strategies)
    steps = [make_step(rng, bounded) for _ in range(rng.randint(0, 5))]
    if door == "hedge" and steps and rng.random() < 0.5:
        steps[0] = Step(rng.uniform(0.002, 0.005), "ok")  # a slow first copy: a later one wins
    if door == "sync":
        interferences = ["none", "request_cancel", "cancel_after_fail", "cancel_in_send",
                         "cancel_on_answer"]  # fmt: skip
        weights = [4, 2, 2, 1, 1]
    else:
        interferences = ["none", "request_cancel", "caller_cancel", "move_on", "cancel_after_fail",
                         "caller_after_fail", "answer_then_cancel", "cancel_in_send"]  # fmt: skip
        weights = [5, 2, 2, 1, 2, 1, 1, 2]
    hedge = None
    if door == "hedge":
        hedge = HedgePolicy(
            max_attempts=rng.randint(1, 4),
            delay=rng.choice([0.0, 0.0005, 0.001, 0.003]),
            non_fatal=rng.choice([None, None, frozenset({R.KV_TEMPORARY_FAILURE, R.KV_LOCKED})]),
        )
    pool_wait = None
    if door in ("hand", "bare"):
        pool_wait = rng.choice([None, None, 0.0, rng.uniform(0.0, 0.001)])
    return Plan(
        rid=rid,
        door=door,
        pool_wait=pool_wait,
        idempotent=idempotent,
        timeout=timeout,
        strategy=strategy,
        backoff=rng.choice([0.0, 0.0005, 0.001, 0.002]),
        refuse_after=rng.randint(0, 3),
        own_error=rng.random() < 0.5,
        steps=steps,
        interference=rng.choices(interferences, weights)[0],
        interfere_at=rng.uniform(0.0, 0.015),
        cancel_on=rng.randint(1, len(steps) + 1),  # + 1: the answer after the planned steps
        start_at=rng.uniform(0.0, 0.005),
        use_acquire=rng.random() < 0.5,
        hedge=hedge,
    )


class Guards:
    """The watched breaker, limiter and budget of a seed, and the refusals the sends saw."""

    def __init__(self, rng: random.Random, telemetered: Telemetered) -> None:
        telemetry = telemetered.otel.telemetry
        self.lock = threading.Lock()
        self.breaker_refusals = 0
        self.limiter_refusals = 0
        self.budget: RetryBudget | None = None
        if rng.random() < 0.5:
            self.budget = RetryBudget(
                ttl=10,
                min_retries_per_sec=rng.choice([0, 1, 10, 100]),
                retry_ratio=rng.choice([0.0, 0.2, 1.0]),
            )
        self.breaker: CircuitBreaker | None = None
        if rng.random() < 0.4:
            self.breaker = telemetry.watch(
                CircuitBreaker(
                    name="node",
                    volume_threshold=rng.randint(2, 8),
                    error_threshold_percentage=50,
                    sleep_window=rng.uniform(0.002, 0.008),
                    canary_timeout=0.03,
                    rolling_window=1.0,
                )
            )
        self.limiter: ConcurrencyLimiter | None = None
        if rng.random() < 0.4:
            self.limiter = telemetry.watch(
                ConcurrencyLimiter(rng.randint(1, 4), max_queued=rng.choice([0, 2, 8]), name="pool")
            )

    def saw(self, call: Call) -> None:
        """A call refused by a guard (the endpoint never raises these reasons)."""
        if call.reason is R.CIRCUIT_BREAKER_OPEN:
            with self.lock:
                self.breaker_refusals += 1
        elif call.reason is R.CONCURRENCY_LIMITED:
            with self.lock:
                self.limiter_refusals += 1

    def check(self, metrics: dict[str, Metric], problems: list[str]) -> None:
        def total(name: str) -> Any:
            metric = metrics.get(name)
            return 0 if metric is None else metric.total()

        wanted = {
            "sdkcore.circuit_breaker.rejections": self.breaker_refusals,
            "sdkcore.concurrency_limiter.rejections": self.limiter_refusals,
            "sdkcore.retry_budget.rejections": 0 if self.budget is None else self.budget.refused,
        }
        for name, count in wanted.items():
            if total(name) != count:
                problems.append(f"{name} is {total(name)}, but {count} refusals happened")
        gauges: list[tuple[str, Any, Any]] = []
        if self.breaker is not None:
            state = {"closed": 0, "open": 1, "half_open": 2}[self.breaker.state.value]
            gauges.append(("sdkcore.circuit_breaker.state", self.breaker, state))
        if self.limiter is not None:
            gauges.append(("sdkcore.concurrency_limiter.in_flight", self.limiter, 0))
            gauges.append(("sdkcore.concurrency_limiter.queued", self.limiter, 0))
        if self.budget is not None:
            gauges.append(("sdkcore.retry_budget.balance", self.budget, self.budget.balance))
        for name, _, value in gauges:
            metric = metrics.get(name)
            got = None if metric is None else [v for _, v in metric.points]
            if got != [value]:
                problems.append(f"{name} reads {got}, expected [{value}]")


# -- the checks, per request and per seed --------------------------------------------------------


@dataclass
class Expected:
    """What a request must be recorded with: one of ``outcomes`` and ``error_type`` (None:
    absent, a success); ``outcomes`` empty: nothing recorded at all (``why``)."""

    outcomes: frozenset[str]
    error_type: str | None
    why: str = ""


def expected_end(record: Record) -> Expected:
    """How the request must be recorded, from what its caller got (rfc/0008)."""
    plan, request, error = record.plan, record.request, record.error
    assert request is not None
    if plan.door == "hedge" and not plan.idempotent:
        # refused before anything was sent: records nothing (rfc/0008)
        return Expected(frozenset(), None, "a hedge refused before anything was sent")
    if plan.door == "bare" and record.seen_pending is False:
        # Request.cancel() completed the request before the loop's first call into sdkcore
        # (its first send, which sdkcore never sees, was in flight): that call is refused as
        # for any completed request, and a refused call records nothing ("as the other doors")
        return Expected(frozenset(), None, "completed before the bare loop's first sdkcore call")
    via_context = request.cancellation_reason is VIA_CONTEXT
    if record.outcome == "returned":
        if plan.door == "bare" and via_context:
            # The bare loop's send is not cut by Request.cancel(); succeed() then finds the
            # request cancelled (assumption, see the module's docstring).
            return Expected(frozenset({"cancelled"}), "RequestCanceledException")
        return Expected(frozenset({"success"}), None)
    assert error is not None
    name = type(error).__name__
    if isinstance(error, TimeoutException):
        return Expected(frozenset({"timeout"}), name)
    if isinstance(error, RequestCanceledException):
        context = error.context
        why = None if context is None else context.cancellation_reason
        return Expected(frozenset({"cancelled" if why is VIA_CONTEXT else "failure"}), name)
    if isinstance(error, Exception):
        if plan.door == "bare" and via_context and isinstance(error, PlainError):
            # fail() of a request Request.cancel() completed while the loop's send ran
            return Expected(frozenset({"cancelled"}), name)
        return Expected(frozenset({"failure"}), name)
    if record.failed_by_loop:
        # The caller's cancellation reached the loop outside sdkcore's calls (the bare loop's
        # send, a pool wait): sdkcore learns of it only from fail(request, the cancellation),
        # which completes the request CANCELLED (TASK_CANCELLED), as the other doors do.
        return Expected(frozenset({"cancelled"}), name)
    return Expected(frozenset({"cancelled"}), name)  # the caller's own cancellation


class Observed:
    """What OpenTelemetry holds at the end of a seed, indexed for the per-request checks."""

    def __init__(self, telemetered: Telemetered) -> None:
        otel = telemetered.otel
        self.metrics = otel.metrics()
        self.spans = otel.spans()
        self.by_id = {s.context.span_id: s for s in self.spans if s.context is not None}
        self.requests: dict[int, list[ReadableSpan]] = collections.defaultdict(list)
        self.children: dict[int, list[ReadableSpan]] = collections.defaultdict(list)
        for span in self.spans:
            if span.name.startswith("app."):
                continue
            attributes = span.attributes or {}
            if span.name == "sdkcore.attempt":
                if span.parent is not None:
                    self.children[span.parent.span_id].append(span)
            elif "sdkcore.request.id" in attributes:
                self.requests[int(attributes["sdkcore.request.id"])].append(span)  # type: ignore[arg-type]

    def points(self, metric: str, name: str) -> list[tuple[dict[str, Any], Any]]:
        found = self.metrics.get(metric)
        if found is None:
            return []
        return [(a, v) for a, v in found.points if a.get(NAME) == name]


def check_record(record: Record, seen: Observed, problems: list[str]) -> int:
    """Checks one request; returns how many sdkcore spans it accounts for."""
    mine: list[str] = []
    request = record.request
    assert request is not None
    plan, name, calls = record.plan, record.name, record.calls
    mine.extend(record.context_problems)
    if not record.ended:
        mine.append("its door never ended")
    end = expected_end(record)
    durations = seen.points("sdkcore.request.duration", name)
    retried = seen.points("sdkcore.request.retries", name)
    spans = seen.requests.get(request.id, [])
    counted = 0

    if not end.outcomes:
        if plan.door == "hedge" and not isinstance(record.error, InvalidArgumentException):
            mine.append("a non-idempotent hedge was not refused with InvalidArgumentException")
        if plan.door == "hedge" and calls:
            mine.append("a non-idempotent hedge sent something")
        if durations or retried or spans:
            mine.append(
                f"{end.why}: yet recorded {len(durations)} duration point(s), "
                f"{len(retried)} retries point(s), {len(spans)} span(s)"
            )
        if mine:
            problems.append(record.describe() + "\n      - " + "\n      - ".join(mine))
        return len(spans)

    hedged = plan.door == "hedge"
    sends = len(calls)
    retries = 0 if hedged else request.retry_attempts

    # -- sdkcore.request.duration: one point, the outcome and error.type the caller got ----
    error_type = end.error_type
    wanted_attributes: dict[str, Any] = {NAME: name, OUTCOME: "|".join(sorted(end.outcomes))}
    if error_type is not None:
        wanted_attributes[ERROR_TYPE] = error_type
    outcome = ""
    if len(durations) != 1 or durations[0][1][0] != 1:
        mine.append(
            f"sdkcore.request.duration: {[(a, v[0]) for a, v in durations]} "
            f"(want one point, count 1, {wanted_attributes})"
        )
    else:
        attributes, (_, seconds) = durations[0]
        outcome = str(attributes.get(OUTCOME))
        if outcome in end.outcomes:
            wanted_attributes[OUTCOME] = outcome
        if attributes != wanted_attributes:
            mine.append(
                f"sdkcore.request.duration attributes {attributes}, want {wanted_attributes}"
            )
        if not 0.0 <= seconds <= record.t1 - record.t0 + 1e-6:
            mine.append(
                f"sdkcore.request.duration {seconds * 1000:.3f} ms, but the door took at most "
                f"{(record.t1 - record.t0) * 1000:.3f} ms from the request's creation"
            )

    # -- sdkcore.request.retries, sdkcore.retries, sdkcore.retry.delay, the sends ----------
    if len(retried) != 1 or retried[0][1][0] != 1:
        mine.append(f"sdkcore.request.retries: {retried} (want one point, count 1)")
    elif retried[0][1][1] != retries:
        mine.append(f"sdkcore.request.retries is {retried[0][1][1]}, want {retries}")
    by_reason = {a[REASON]: v for a, v in seen.points("sdkcore.retries", name) if v}
    delays = seen.points("sdkcore.retry.delay", name)
    delay_count = sum(v[0] for _, v in delays)
    delay_sum = sum(v[1] for _, v in delays)
    if hedged:
        if by_reason or delay_count:
            mine.append(f"a hedged request counted retries {by_reason}, {delay_count} delays")
    else:
        if sends == 0 and retries != 0:
            mine.append(f"{retries} retries booked, but nothing was sent")
        elif sends and not sends - 1 <= retries <= sends:
            mine.append(f"{retries} retries booked for {sends} sends (want sends - 1 or sends)")
        elif sends and retries == sends:
            if calls[-1].outcome != "retry":
                mine.append(
                    f"a retry booked after the last send, which ended {calls[-1].outcome} "
                    f"(a booked retry follows a retryable failure)"
                )
            refusal = isinstance(record.error, Refused) or (
                isinstance(record.error, RequestCanceledException)
                and record.error.context is not None
                and record.error.context.cancellation_reason
                not in (VIA_CONTEXT, CancellationReason.TASK_CANCELLED)
            )
            if refusal:
                mine.append("the request was refused a retry, yet one was booked (counted)")
        booked = calls[:retries]
        if any(c.outcome != "retry" for c in booked):
            mine.append(f"retries booked after sends that did not fail retryably: {booked}")
        else:
            booked_reasons = collections.Counter(
                c.reason.name for c in booked if c.reason is not None
            )
            if dict(booked_reasons) != by_reason:
                mine.append(f"sdkcore.retries by reason {by_reason}, want {dict(booked_reasons)}")
        if delay_count != retries:
            mine.append(f"sdkcore.retry.delay has {delay_count} points, want {retries}")

    # -- hedges --------------------------------------------------------------------------
    hedges = sum(v for _, v in seen.points("sdkcore.hedges", name))
    wins = sum(v for _, v in seen.points("sdkcore.hedge.wins", name))
    copies = sum(1 for c in calls if c.index > 0)
    won = 0
    if hedged and record.outcome == "returned":
        winner = [c for c in calls if c.outcome == "ok" and c.value == record.value]
        won = int(bool(winner) and winner[0].index > 0)
    if hedges != (copies if hedged else 0):
        mine.append(f"sdkcore.hedges is {hedges}, but {copies} copies after the first were sent")
    if wins != won:
        mine.append(f"sdkcore.hedge.wins is {wins}, want {won}")

    # -- the request span ------------------------------------------------------------------
    if len(spans) != 1:
        mine.append(f"{len(spans)} request spans (want 1): {[s.name for s in spans]}")
    else:
        span = spans[0]
        counted += 1
        attributes = dict(span.attributes or {})
        if span.name != name or span.kind is not SpanKind.CLIENT:
            mine.append(f"request span {span.name!r} of kind {span.kind}")
        parent = None if span.parent is None else span.parent.span_id
        if parent != record.caller_span_id or span.context.trace_id != record.caller_trace_id:
            mine.append("the request span is not a child of the caller's span")
        want = {NAME: name, OUTCOME: outcome or wanted_attributes[OUTCOME], RETRIES: retries}
        got = {k: attributes.get(k) for k in want}
        if got != want:
            mine.append(f"request span attributes {got}, want {want} (as its duration point)")
        if "success" in end.outcomes:
            if span.status.status_code is StatusCode.ERROR or ERROR_TYPE in attributes:
                mine.append(f"a successful request's span has status {span.status.status_code}")
        elif span.status.status_code is not StatusCode.ERROR:
            mine.append(f"the {want[OUTCOME]} request's span has status {span.status.status_code}")
        elif attributes.get(ERROR_TYPE) != error_type:
            mine.append(f"request span error.type {attributes.get(ERROR_TYPE)}, want {error_type}")
        events = [e for e in span.events if e.name == "sdkcore.retry"]
        if len(events) != retries:
            mine.append(f"{len(events)} sdkcore.retry events on the request span, want {retries}")
        else:
            reasons = collections.Counter(str((e.attributes or {}).get(REASON)) for e in events)
            if not hedged and dict(reasons) != by_reason:
                mine.append(f"sdkcore.retry events {dict(reasons)}, sdkcore.retries {by_reason}")
            total = sum(float((e.attributes or {}).get("sdkcore.retry.delay", 0.0)) for e in events)  # type: ignore[arg-type,misc]
            if not math.isclose(total, delay_sum, rel_tol=1e-9, abs_tol=1e-12):
                mine.append(f"retry events wait {total} s in all, sdkcore.retry.delay {delay_sum}")
        tolerance = 200_000  # ns: the back-dated start is computed from two clocks
        assert span.start_time is not None
        assert span.end_time is not None
        if calls and span.start_time > min(c.wall_start for c in calls) + tolerance:
            mine.append("the request span starts after its first send")
        if calls and span.end_time + tolerance < max(c.wall_end for c in calls):
            mine.append("the request span ends before its last send ended")

        # -- attempt spans: one per send, current inside it --------------------------------
        children = seen.children.get(span.context.span_id, [])
        counted += len(children)
        if plan.door == "bare":
            if children:
                mine.append(f"{len(children)} attempt spans in a loop without attempt()")
            for call in calls:
                if call.span_id != record.caller_span_id:
                    mine.append(f"send {call!r} of the bare loop ran under another span")
        else:
            mine.extend(check_attempts(record, span, children))
    if mine:
        problems.append(record.describe() + "\n      - " + "\n      - ".join(mine))
    return counted


def check_attempts(record: Record, span: ReadableSpan, children: list[ReadableSpan]) -> list[str]:
    mine: list[str] = []
    hedged = record.plan.door == "hedge"
    by_id = {c.context.span_id: c for c in children if c.context is not None}
    if len(children) != len(record.calls):
        mine.append(f"{len(children)} attempt spans for {len(record.calls)} sends")
    ids = [c.span_id for c in record.calls]
    if len(set(ids)) != len(ids):
        mine.append(f"two sends ran under one span: {record.calls}")
    for call in record.calls:
        attempt = by_id.get(call.span_id)
        if attempt is None:
            mine.append(f"send {call!r} did not run under an attempt span of its request")
            continue
        if call.trace_id != span.context.trace_id:
            mine.append(f"send {call!r} ran in another trace")
        attributes = dict(attempt.attributes or {})
        number = call.index + 1 if hedged else call.ordinal
        if attributes.get("sdkcore.attempt.number") != number:
            got = attributes.get("sdkcore.attempt.number")
            mine.append(f"send {call!r}: sdkcore.attempt.number {got}, want {number}")
        if attributes.get("sdkcore.hedge.index") != (call.index if hedged else None):
            mine.append(
                f"send {call!r}: sdkcore.hedge.index {attributes.get('sdkcore.hedge.index')}"
            )
        code = attempt.status.status_code
        if call.outcome in ("retry", "plain", "cut"):
            if code is not StatusCode.ERROR or ERROR_TYPE not in attributes:
                mine.append(f"send {call!r} failed, its span has status {code}")
        elif call.outcome == "ok" and code is StatusCode.ERROR:
            # attempt() raises RequestCanceledException for a block whose answer came as
            # Request.cancel() did (rfc/0001 "Application cancel"): the attempt's error.
            request = record.request
            assert request is not None
            if not (
                attributes.get(ERROR_TYPE) == "RequestCanceledException"
                and request.cancellation_reason is VIA_CONTEXT
            ):
                mine.append(
                    f"send {call!r} answered, its span has error {attributes.get(ERROR_TYPE)}"
                )
    return mine


def check_seed(
    telemetered: Telemetered, records: list[Record], guards: Guards, problems: list[str]
) -> None:
    seen = Observed(telemetered)
    counted = sum(check_record(record, seen, problems) for record in records)
    stray = [s.name for s in seen.spans if not s.name.startswith("app.")]
    if len(stray) != counted:
        problems.append(
            f"{len(stray)} sdkcore spans, but the requests account for {counted} "
            "(an attempt span outside its request, or a span of its own)"
        )
    names = {r.name for r in records}
    for metric in ("sdkcore.request.duration", "sdkcore.request.retries", "sdkcore.retries"):
        found = seen.metrics.get(metric)
        others = [] if found is None else [a for a, _ in found.points if a.get(NAME) not in names]
        if others:
            problems.append(f"{metric} points of no request: {others}")
    problems.extend(telemetered.processor.problems())
    problems.extend(f"OpenTelemetry logged {text}" for text in telemetered.caught.records)
    failed = telemetered.otel.telemetry._failed
    if failed:
        problems.append(f"telemetry calls failed (Telemetry._guard): {sorted(failed)}")
    guards.check(seen.metrics, problems)


def span_of_now() -> tuple[int, int]:
    context = trace.get_current_span().get_span_context()
    return context.span_id, context.trace_id


# -- the async doors ------------------------------------------------------------------------------


class World:
    """One seed on asyncio or trio: the orchestrator, its guards, the requests."""

    def __init__(self, seed: int, telemetered: Telemetered) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.telemetered = telemetered
        self.problems: list[str] = []
        self.guards = Guards(rng, telemetered)
        self.orch = telemetered.otel.orchestrator(
            max_requests_in_retry=rng.choice([2, 8, 32768]), retry_budget=self.guards.budget
        )
        self.app = telemetered.otel.app
        doors = ["execute", "execute", "hand", "hand", "bare", "hedge", "hedge"]
        self.records = [
            Record(make_plan(rng, rid, rng.choice(doors)), name=f"s{seed}.r{rid}")
            for rid in range(rng.randint(14, 24))
        ]
        self.stalls = [
            (rng.uniform(0.0, 0.02), rng.uniform(0.0005, 0.003)) for _ in range(rng.randint(0, 3))
        ]
        self.nested: list[Record] = []  # requests made inside sends
        self.tg: anyio.abc.TaskGroup | None = None

    # -- the endpoint, behind the limiter and the breaker (rfc/0009's order) --------------
    async def dispatch(self, record: Record, index: int) -> str:
        span_id, trace_id = span_of_now()
        call = Call(index, len(record.calls) + 1, span_id, trace_id, time.time_ns())
        record.calls.append(call)
        try:
            value = await self.limited(record, call)
        except RetryableError as exc:
            call.outcome, call.reason, call.error = "retry", exc.reason, exc
            self.guards.saw(call)
            raise
        except Exception as exc:
            call.outcome, call.error = "plain", exc
            raise
        except BaseException as exc:
            call.outcome, call.error = "cut", exc
            raise
        finally:
            call.wall_end = time.time_ns()
        call.outcome, call.value = "ok", value
        return value

    async def limited(self, record: Record, call: Call) -> str:
        limiter = self.guards.limiter
        if limiter is None or record.plan.nested:
            return await self.broken(record, call)
        return await with_permit(
            limiter, record.plan.use_acquire, lambda: self.broken(record, call)
        )

    async def broken(self, record: Record, call: Call) -> str:
        breaker = self.guards.breaker
        if breaker is None or record.plan.nested:
            return await self.endpoint(record, call)
        with breaker.guard():
            return await self.endpoint(record, call)

    async def endpoint(self, record: Record, call: Call) -> str:
        plan = record.plan
        steps = plan.steps
        step = steps[record.next_step] if record.next_step < len(steps) else Step(0.0)
        record.next_step += 1
        number = record.next_step
        assert self.tg is not None
        await anyio.lowlevel.checkpoint()  # connect: a cancellation is checked here first
        if step.nested:
            await self.run_nested(record)
        if number == plan.cancel_on and plan.interference == "cancel_in_send":
            cancelled = anyio.Event()
            self.tg.start_soon(self.cancel_then_set, record, cancelled)
            await cancelled.wait()
        if plan.interference == "answer_then_cancel" and number == plan.cancel_on:
            answered = anyio.Event()
            self.tg.start_soon(self.answer_then_cancel, record, step.delay, answered)
            await answered.wait()
        elif step.delay:
            await anyio.sleep(step.delay)
        if step.kind == "ok":
            return f"{record.name}.{call.ordinal}.{call.index}"
        if step.kind == "plain":
            raise PlainError(f"{record.name}: no such document")
        assert step.reason is not None
        if number == plan.cancel_on:
            if plan.interference == "cancel_after_fail":
                self.tg.start_soon(
                    self.cancel_request, record, self.rng_for(record).uniform(0, 0.001)
                )
            elif plan.interference == "caller_after_fail":
                self.tg.start_soon(
                    self.cancel_caller, record, self.rng_for(record).uniform(0, 0.001)
                )
        raise RetryableError(step.reason, effect=step.effect, retry_after=step.hint)

    def rng_for(self, record: Record) -> random.Random:
        return random.Random(self.seed * 1000 + record.plan.rid * 10 + record.next_step)

    async def pool_wait(self, record: Record) -> None:
        """What a loop awaits between maybe_retry and its next attempt (a pooled
        connection). The caller's cancellation there reaches no sdkcore call: the loop
        completes the request with fail(), the only call that can say so."""
        wait = record.plan.pool_wait
        if wait is None:
            return
        try:
            await anyio.sleep(wait)
        except BaseException as exc:
            assert record.request is not None
            record.failed_by_loop = True
            self.orch.fail(record.request, exc)
            raise

    async def run_nested(self, outer: Record) -> None:
        """A request made inside ``outer``'s send, through a door of its own: a child of the
        attempt's span (the caller's, for the bare loop), within the outer's deadline."""
        rng = self.rng_for(outer)
        rid = 1000 + len(self.nested)
        plan = make_plan(rng, rid, rng.choice(["execute", "hand", "bare", "hedge"]))
        plan.interference, plan.nested, plan.steps = "none", True, plan.steps[:2]
        for step in plan.steps:
            step.nested = False
        record = Record(plan, name=f"{outer.name}.n{len(self.nested)}")
        self.nested.append(record)
        await self.run_door(record, strategy_for(plan, rng))

    async def run_door(self, record: Record, strategy: RetryStrategy | None) -> None:
        """Build the request and run its door from the current span (the caller's),
        recording what the caller got and whether the door left the context as it was."""
        plan = record.plan
        record.caller_span_id, record.caller_trace_id = span_of_now()
        caller = trace.get_current_span()
        before = otel_context.get_current()
        record.t0 = time.monotonic()
        record.request = Request(
            name=record.name,
            idempotent=plan.idempotent,
            timeout=plan.timeout,
            retry_strategy=strategy,
        )
        try:
            record.value = await self.door(record)
            record.outcome = "returned"
        except anyio.get_cancelled_exc_class() as exc:
            record.outcome, record.error = "cancelled", exc
            raise
        except BaseException as exc:
            record.outcome, record.error = "raised", exc
        finally:
            record.t1 = time.monotonic()
            record.ended = True
            if otel_context.get_current() != before:
                record.context_problems.append(
                    "the OpenTelemetry context changed across the door: "
                    f"{dict(otel_context.get_current())} != {dict(before)}"
                )
            if trace.get_current_span() is not caller:
                record.context_problems.append(
                    f"the current span after the door is {trace.get_current_span()}"
                )

    # -- the doors --------------------------------------------------------------------------
    async def door(self, record: Record) -> str:
        request = record.request
        assert request is not None
        plan, orch = record.plan, self.orch
        if plan.door != "bare":  # execute, hedge, or the README's loop ("hand")

            async def dispatch(index: int) -> str:
                return await self.dispatch(record, index)

            async def before_attempt() -> None:
                if record.calls:
                    await self.pool_wait(record)

            return await through_door(
                orch, request, plan.door, dispatch, plan.hedge, before_attempt
            )
        while True:  # bare: the README's loop without attempt()
            if record.calls:
                await self.pool_wait(record)
            try:
                value = await self.dispatch(record, 0)
            except RetryableError as exc:
                record.first_call()
                await orch.maybe_retry(request, exc.reason, cause=exc, effect=exc.effect)
                continue
            except PlainError as exc:
                record.first_call()
                raise orch.fail(request, exc) from None
            except BaseException as exc:  # the caller's cancellation: only fail() can say it
                record.first_call()
                record.failed_by_loop = True
                orch.fail(request, exc)
                raise
            record.first_call()
            orch.succeed(request)
            return value

    async def run_one(self, record: Record) -> None:
        plan = record.plan
        await anyio.sleep(plan.start_at)
        strategy = strategy_for(plan, self.rng_for(record))
        self.scopes[plan.rid] = scope = (
            anyio.move_on_after(plan.interfere_at)
            if plan.interference == "move_on"
            else anyio.CancelScope()
        )
        assert self.tg is not None
        if plan.interference == "request_cancel":
            self.tg.start_soon(self.cancel_request, record, plan.interfere_at)
        elif plan.interference == "caller_cancel":
            self.tg.start_soon(self.cancel_caller, record, plan.interfere_at)
        try:
            with scope, self.app.start_as_current_span(f"app.caller{plan.rid}"):
                await self.run_door(record, strategy)
        except BaseException as exc:  # a cancellation the caller's scope did not catch
            record.error = exc
            record.outcome = "escaped"
            self.problems.append(
                record.describe() + f"\n      - escaped the caller's scope: {show(exc)}"
            )

    async def cancel_request(self, record: Record, wait: float) -> None:
        await anyio.sleep(wait)
        request = record.request
        if request is not None and not record.ended:
            record.cancel_called = True
            request.cancel()

    async def cancel_caller(self, record: Record, wait: float) -> None:
        await anyio.sleep(wait)
        if not record.ended:
            self.scopes[record.plan.rid].cancel()

    async def cancel_then_set(self, record: Record, done: anyio.Event) -> None:
        await self.cancel_request(record, 0.0)
        done.set()

    async def answer_then_cancel(self, record: Record, delay: float, answered: anyio.Event) -> None:
        """A driver's reader task: hands the answer over, then the application cancels."""
        await anyio.sleep(delay)
        answered.set()
        await self.cancel_request(record, 0.0)

    async def run(self) -> None:
        self.scopes: dict[int, anyio.CancelScope] = {}

        def start(tg: anyio.abc.TaskGroup) -> None:
            self.tg = tg
            for record in self.records:
                tg.start_soon(self.run_one, record)

        timed_out, outlived = await run_seed(start, self.stalls, SAFETY)
        if timed_out:
            self.problems.append(f"doors still running after {SAFETY} s")
        if outlived:
            self.problems.append(f"{outlived} task(s) outlived the doors")


@pytest.mark.anyio
@pytest.mark.parametrize("seed", ASYNC_SEEDS)
async def test_telemetry_keeps_its_promises_under_random_schedules(
    seed: int, anyio_backend: str
) -> None:
    with Telemetered() as telemetered:
        world = World(seed, telemetered)
        await world.run()
        check_seed(telemetered, world.records + world.nested, world.guards, world.problems)
    assert not world.problems, f"seed {seed} on {anyio_backend}:\n" + "\n".join(world.problems)


# -- the sync door, from threads ----------------------------------------------------------------


class SyncWorld:
    """One seed of ``execute_sync`` from many threads; ``Request.cancel()`` from others."""

    def __init__(self, seed: int, telemetered: Telemetered) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.problems: list[str] = []
        self.guards = Guards(rng, telemetered)
        self.orch: RetryOrchestrator = telemetered.otel.orchestrator(
            max_requests_in_retry=rng.choice([2, 8, 32768]), retry_budget=self.guards.budget
        )
        self.app = telemetered.otel.app
        self.records = [
            Record(make_plan(rng, rid, "sync"), name=f"t{seed}.r{rid}")
            for rid in range(rng.randint(16, 28))
        ]
        threads = rng.randint(4, 10)
        self.queues: list[list[Record]] = [self.records[i::threads] for i in range(threads)]
        self.helpers_lock = threading.Lock()
        self.helpers = Threads(self.problems, self.helpers_lock)
        self.nested: list[Record] = []  # requests made inside sends (under helpers_lock)

    def send(self, record: Record) -> str:
        span_id, trace_id = span_of_now()
        call = Call(0, len(record.calls) + 1, span_id, trace_id, time.time_ns())
        record.calls.append(call)
        if call.ordinal == 1 and record.plan.interference == "request_cancel":
            # From the first send on: a request cancelled before execute_sync looked at it
            # is refused there and records nothing (rfc/0008), which this would not tell.
            self.helpers.start(self.cancel_request, record, record.plan.interfere_at)
        try:
            value = self.limited(record, call)
        except RetryableError as exc:
            call.outcome, call.reason, call.error = "retry", exc.reason, exc
            self.guards.saw(call)
            raise
        except Exception as exc:
            call.outcome, call.error = "plain", exc
            raise
        finally:
            call.wall_end = time.time_ns()
        call.outcome, call.value = "ok", value
        return value

    def limited(self, record: Record, call: Call) -> str:
        limiter = self.guards.limiter
        if limiter is None or record.plan.nested:
            return self.broken(record, call)
        with limiter.guard():
            return self.broken(record, call)

    def broken(self, record: Record, call: Call) -> str:
        breaker = self.guards.breaker
        if breaker is None or record.plan.nested:
            return self.endpoint(record, call)
        with breaker.guard():
            return self.endpoint(record, call)

    def endpoint(self, record: Record, call: Call) -> str:
        plan = record.plan
        steps = plan.steps
        step = steps[record.next_step] if record.next_step < len(steps) else Step(0.0)
        record.next_step += 1
        number = record.next_step
        mine = number == plan.cancel_on
        if mine and plan.interference == "cancel_in_send":
            # another thread cancels while this attempt is in flight; it answers afterwards
            self.helpers.start(self.cancel_request, record, 0.0).join(SAFETY)
        go = threading.Event()
        if mine and plan.interference == "cancel_on_answer":
            self.helpers.start(self.cancel_when, record, go)
        try:
            if step.nested:
                self.run_nested(record)
            if step.delay:
                time.sleep(step.delay)
            if step.kind == "ok":
                return f"{record.name}.{call.ordinal}.0"
            if step.kind == "plain":
                raise PlainError(f"{record.name}: no such document")
            assert step.reason is not None
            if mine and plan.interference == "cancel_after_fail":
                wait = random.Random(self.seed * 1000 + plan.rid).uniform(0.0, 0.001)
                self.helpers.start(self.cancel_request, record, wait)
            raise RetryableError(step.reason, effect=step.effect, retry_after=step.hint)
        finally:
            go.set()  # the canceller runs as the door takes the outcome in

    def cancel_request(self, record: Record, wait: float) -> None:
        if wait:
            time.sleep(wait)
        request = record.request
        if request is not None and not record.ended:
            record.cancel_called = True
            request.cancel()

    def cancel_when(self, record: Record, go: threading.Event) -> None:
        go.wait(SAFETY)
        self.cancel_request(record, 0.0)

    def run_nested(self, outer: Record) -> None:
        """A request made inside ``outer``'s send (a child of its attempt's span)."""
        rng = random.Random(self.seed * 1000 + outer.plan.rid * 10 + outer.next_step)
        with self.helpers_lock:
            number = len(self.nested)
            plan = make_plan(rng, 1000 + number, "sync")
            plan.interference, plan.nested, plan.steps = "none", True, plan.steps[:2]
            for step in plan.steps:
                step.nested = False
            record = Record(plan, name=f"{outer.name}.n{number}")
            self.nested.append(record)
        self.run_door(record, rng)

    def run_one(self, record: Record) -> None:
        with self.app.start_as_current_span(f"app.caller{record.plan.rid}"):
            self.run_door(record, self.rng)

    def run_door(self, record: Record, rng: random.Random) -> None:
        plan = record.plan
        strategy = strategy_for(plan, rng)
        caller = trace.get_current_span()
        record.caller_span_id, record.caller_trace_id = span_of_now()
        before = otel_context.get_current()
        record.t0 = time.monotonic()
        record.request = Request(
            name=record.name,
            idempotent=plan.idempotent,
            timeout=plan.timeout,
            retry_strategy=strategy,
        )
        try:
            record.value = self.orch.execute_sync(record.request, lambda r: self.send(record))
            record.outcome = "returned"
        except BaseException as exc:
            record.outcome, record.error = "raised", exc
        finally:
            record.t1 = time.monotonic()
            record.ended = True
            if otel_context.get_current() != before:
                record.context_problems.append("the OpenTelemetry context changed")
            if trace.get_current_span() is not caller:
                record.context_problems.append("the caller's span is not current after it")

    def worker(self, queue: list[Record]) -> None:
        for record in queue:
            time.sleep(record.plan.start_at)
            self.run_one(record)

    def run(self) -> None:
        workers = [
            threading.Thread(target=self.helpers.guarded, args=(self.worker, queue), daemon=True)
            for queue in self.queues
        ]
        for thread in workers:
            thread.start()
        deadline = time.monotonic() + SAFETY
        for thread in workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        helpers = self.helpers.started()
        for thread in helpers:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in workers + helpers if t.is_alive()]
        if alive:
            self.problems.append(f"{len(alive)} thread(s) still running after {SAFETY} s")


@pytest.fixture
def switchy() -> Iterator[None]:
    """Threads switch more often: more interleavings per seed."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("seed", SYNC_SEEDS)
@pytest.mark.usefixtures("switchy")
def test_sync_door_telemetry_keeps_its_promises_from_threads(seed: int) -> None:
    with Telemetered() as telemetered:
        world = SyncWorld(seed, telemetered)
        world.run()
        check_seed(telemetered, world.records + world.nested, world.guards, world.problems)
    assert not world.problems, f"seed {seed} (execute_sync):\n" + "\n".join(world.problems)
