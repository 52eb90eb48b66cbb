"""Random schedules through ``execute_sync`` from many threads, checking the promises.

Each seed builds one ``RetryOrchestrator`` (a random ``max_requests_in_retry``, small ones
included so that backpressure refuses; sometimes a ``RetryBudget``) and, around a fake
endpoint, sometimes an ``AdaptiveThrottle``, a ``ConcurrencyLimiter`` or an
``AdaptiveConcurrencyLimiter``, and a ``CircuitBreaker``, composed in rfc/0009's order,
outermost first: throttle, limiter, breaker, send (the sync door uses ``guard()`` where the
async ones may use ``acquire()``). 8 to 32 threads share them and run one to four requests
each through ``execute_sync(request, send)``: idempotent or not, with a timeout of 5 to
100 ms or none, under the default strategy, ``BestEffortRetryStrategy`` with a small
backoff, or a user strategy that overrides ``decide``. The endpoint answers, fails
retryably (random reasons, effects and server hints, one of them ending a hair before the
deadline; always-retry reasons only for requests with a timeout, whose controlled backoff
grows to 1 s), fails for good (sometimes a socket timeout at the deadline, read from
``request.time_left``), and takes 0 to 3 ms. Another thread calls ``Request.cancel()`` at a
random moment, while an attempt is in flight (which then answers or fails), just after an
attempt failed (in its backoff, or in the step before it), or as an attempt hands its
outcome to the door; busy threads hog the interpreter now and then, and some seeds shorten
the switch interval so that threads interleave at more places. Once every thread has
joined (one still alive after ``SAFETY`` seconds fails the seed), every request is
checked; all violations of a seed are reported together.

Its plan (which requests, answers and interferences) is fixed by the seed; the
interleaving is not. Every check below holds whatever the interleaving.

The promises checked (README, rfc/0001 "The three doors", "Application cancel" and
"Ambiguity", rfc/0007, rfc/0009, docstrings):

* the door's outcome: the answer of the request's last send (then SUCCEEDED), the send's
  own non-retryable error (FAILED), or a documented ``CouchbaseException`` subclass: a
  timeout (CANCELLED, TIMEOUT; only for a request with a timeout; ambiguous exactly when
  the request is not idempotent and some attempt may have been applied, a final error
  raised past the deadline included), ``RequestCanceledException`` (CANCELLED, for the
  reason its context names), or the exception a strategy refused with (CANCELLED,
  NO_MORE_RETRIES); never a ``RetryableError``, a ``RuntimeError``, an
  ``AttributeError``...; whatever a send raised past the deadline is the timeout; sdkcore's
  exception after a failed attempt has that failure as ``__cause__`` (rfc/0001 "Final
  exception's cause": on every door, the cancellation included, as ``execute`` with a
  timeout and execute_sync's own cancel-in-flight path do); the request is complete once
  ``execute_sync`` returned or raised, and stays as it ended;
* ``Request.cancel()`` that completed the request (it reads CANCELLED_VIA_CONTEXT right
  after the call): the caller gets ``RequestCanceledException`` (CANCELLED_VIA_CONTEXT)
  "even if an answer arrived meanwhile" (``Request.cancel``'s docstring; rfc/0001
  "Application cancel"; execute_sync says so for a final error too), and the request stays
  so; with the default ``sleep`` a backoff wakes at the cancel (the door ends within
  ``WAKE_BOUND``); at most one send starts after the call (a thread cannot check the state
  and start a send atomically: the door may have checked just before), none after an
  attempt that was in flight across it; ``cancel()`` of a completed request changes nothing;
* a non-idempotent request is never sent again after an attempt that may have been
  applied (effect MAYBE_APPLIED) or whose reason forbids it (rfc/0001 "Which wins");
  sends stop at an answer or a final error; ``retry_attempts`` counts the retries sent
  (plus one booked and not sent);
* ``requests_in_retry`` stays in ``[0, max_requests_in_retry]`` (exact across threads,
  rfc/0001 "The three doors") and is 0 at the end; a limiter lets at most its limit through
  at once (``max_limit`` for the adaptive one) and, at the end, nothing is in flight or
  queued and exactly ``limit`` guards are let through (no permit lost or made);
* the retry budget: one deposit per request that dispatched; withdrawals minus refunds
  equal the retries sent after an attempt that reached the server (not NOT_SENT), per
  request and in all ("a retry never sent spends nothing": rfc/0001 "Application cancel",
  rfc/0007 section 4); the balance is what Finagle's arithmetic gives for those;
* the throttle counts exactly what rfc/0009 "What is counted" says: every local refusal is
  a request; an admitted block that ended is a request, and an accept unless its error is a
  rejection by ``default_is_rejection``'s documented rule; a ``NOT_SENT`` failure counts
  nothing (its window, 600 s, is longer than a seed: nothing leaves it);
* the breaker: a documented state, ``0 <= failures <= outcomes``; while HALF_OPEN a single
  probe (no second probe granted while one granted less than ``canary_timeout`` earlier is
  still in its block);
* no thread hangs.

Assumptions: cancel() from another thread is supported on this door (rfc/0001 "Application
cancel": "from any thread"); "cancel() completed the request" is read from the request
right after the call, since cancel() returns nothing; an attempt "may have been applied"
is what sdkcore books for it (the error's effect, else the reason's default,
``AttemptEffect.for_reason``; a final error is MAYBE_APPLIED); that no attempt starts past
the deadline is not checked (a thread may be switched out between the door's check and
the send's first line).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from fuzz_kit import (
    CountingBudget,
    PlainError,
    Step,
    Threads,
    check_budget_totals,
    check_drained,
    check_in_retry,
    check_request_budget,
    check_timed_out,
    random_breaker,
    random_budget,
    random_failure,
    show,
    small_backoff,
)

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AdaptiveThrottle,
    AmbiguousTimeoutException,
    AttemptEffect,
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    CancellationReason,
    CircuitBreaker,
    CircuitState,
    ConcurrencyLimiter,
    CouchbaseException,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    TemporaryFailureException,
    TimeoutException,
    UnambiguousTimeoutException,
)

SEEDS = range(30)
SAFETY = 5.0  # seconds: a seed whose threads are still running then fails instead of hanging
#: The deadline of a request planned without one on a seed with a throttle (see World.plan).
UNBOUNDED_UNDER_THROTTLE = 0.2
#: A server hint planted where another thread cancels a request without a timeout in its
#: backoff: execute_sync's default sleep must wake at the cancel, well before it is over.
LONG_HINT = 2.0
#: Seconds from cancel() to the door's end, default sleep (sends <= 0.1 s). Generous: under
#: two test runs at once on 2 cores a door once ended 0.61 s after the cancel (seed 25, a
#: cancel during the send); a backoff the cancel did not wake would end LONG_HINT later.
WAKE_BOUND = 1.0

NOT_SENT = AttemptEffect.NOT_SENT
MAYBE = AttemptEffect.MAYBE_APPLIED
R = RetryReason
VIA_CONTEXT = CancellationReason.CANCELLED_VIA_CONTEXT


@dataclass
class Attempt:
    """One call of the door's ``send`` (through throttle, limiter and breaker)."""

    start: int  # sequence numbers (one global order of events)
    end: int | None = None
    ended_at: float = math.inf  # time.monotonic() as send returned or raised
    reached: bool = False  # got past every guard to the endpoint
    outcome: str = "in_flight"  # ok, retry, plain (any other error), other (not an Exception)
    reason: RetryReason | None = None
    effect: AttemptEffect | None = None  # what sdkcore books for it when it failed
    value: str | None = None
    error: BaseException | None = None


@dataclass
class Plan:
    rid: int
    idempotent: bool
    timeout: float | None
    strategy: str  # default, best_effort, pushy (a user strategy that overrides decide)
    steps: list[Step]
    # none; cancel_at (Request.cancel() from another thread interfere_at after the start);
    # cancel_in_send (send number cancel_on waits in flight until another thread's cancel()
    # returned, then answers as planned); cancel_after_fail (send number cancel_on starts a
    # thread that cancels 0 to 2 ms after the failure is raised: in the backoff, or before;
    # a request without a timeout then waits LONG_HINT unless the cancel wakes it);
    # cancel_on_answer (a thread waiting for send number cancel_on cancels as soon as that
    # send answers or raises, while the door takes the outcome in)
    interference: str
    cancel_on: int
    interfere_at: float
    custom_sleep: bool  # execute_sync(..., sleep=<not time.sleep>): cancel() does not wake it


@dataclass
class Record:
    plan: Plan
    request: Request | None = None
    attempts: list[Attempt] = field(default_factory=list)
    next_step: int = 0
    cancel_start: int | None = None  # seq before Request.cancel() was called
    cancel_end: int | None = None  # seq after it returned
    cancel_took: bool = False  # the request read CANCELLED_VIA_CONTEXT right after it
    state_at_cancel: RequestState | None = None  # read just before cancel() was called
    cancel_time: float = math.inf  # time.monotonic() after cancel() returned
    end_time: float = math.inf  # time.monotonic() after execute_sync ended
    outcome: str = "not_started"  # returned, raised
    value: Any = None
    error: BaseException | None = None
    end: int | None = None
    state_at_end: tuple[RequestState, CancellationReason | None] | None = None
    deposits: int = 0  # the retry budget's operations made for this request
    withdrawn: int = 0
    refunded: int = 0


@dataclass
class Probe:
    """A breaker probe (admitted HALF_OPEN): monotonic times around it."""

    asked: float  # before guard() was entered
    granted: float  # after it returned HALF_OPEN (the grant was in between)
    done: float = math.inf  # when its block ended, before the guard reported


#: The request the current thread is running (its budget operations are its own).
CURRENT = threading.local()


def current_record() -> Record | None:
    return getattr(CURRENT, "record", None)


def is_rejection(error: BaseException) -> bool:
    """rfc/0009's ``default_is_rejection``, for what this endpoint raises: KV_TEMPORARY_FAILURE,
    SEARCH_TOO_MANY_REQUESTS, or SERVICE_NOT_AVAILABLE from an attempt that was sent."""
    if not isinstance(error, RetryableError):
        return False
    if error.reason in (R.KV_TEMPORARY_FAILURE, R.SEARCH_TOO_MANY_REQUESTS):
        return True
    effect = error.effect or AttemptEffect.for_reason(error.reason)
    return error.reason is R.SERVICE_NOT_AVAILABLE and effect is not NOT_SENT


def not_sent(error: BaseException) -> bool:
    """A failure that says nothing reached the backend: the throttle records nothing."""
    return (
        isinstance(error, RetryableError)
        and (error.effect or AttemptEffect.for_reason(error.reason)) is NOT_SENT
    )


def describe(attempt: Attempt) -> tuple[str, str | None, str | None]:
    """An attempt in a report: its outcome, reason and effect."""
    reason, effect = attempt.reason, attempt.effect
    return attempt.outcome, reason and reason.name, effect and effect.name


_GIVE_UP = RetryAction.no_retry(TemporaryFailureException)
_PUSH = [RetryAction.with_duration(small_backoff(n)) for n in range(3)]


class Pushy(BestEffortRetryStrategy):
    """A user strategy refining ``decide`` (README "Three ways", 1): it asks to retry every
    reason, even for a non-idempotent request that may have been applied (the orchestrator
    must refuse anyway), and gives up with its own exception after 6 retries."""

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        if request.retry_attempts >= 6:
            return _GIVE_UP
        return _PUSH[request.retry_attempts % 3]


class World:
    """One seed: the orchestrator, the endpoint's guards, the requests and what happened."""

    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.seq = itertools.count()  # next() is atomic in CPython: one global order
        self.lock = threading.Lock()
        self.problems: list[str] = []
        self.budget: CountingBudget | None = random_budget(rng, self.problems, current_record)
        self.orch = RetryOrchestrator(
            max_requests_in_retry=rng.choice([1, 3, 8, 32768, 32768]), retry_budget=self.budget
        )
        self.throttle: AdaptiveThrottle | None = None
        if rng.random() < 0.4:
            # a long window: nothing leaves it during the seed, so its counts are exact
            self.throttle = AdaptiveThrottle(
                k=rng.choice([1.0, 1.5, 2.0]),
                window=600,
                random=random.Random(seed).random,
            )
        self.throttle_refusals = 0
        self.throttle_requests = 0  # admitted blocks that ended with a countable outcome
        self.throttle_accepts = 0
        self.limiter: ConcurrencyLimiter | AdaptiveConcurrencyLimiter | None = None
        self.holder_bound = 0
        kind = rng.choice([None, "fixed", "adaptive"])
        if kind == "fixed":
            self.limiter = ConcurrencyLimiter(rng.randint(1, 4))
            self.holder_bound = self.limiter.limit
        elif kind == "adaptive":
            self.limiter = AdaptiveConcurrencyLimiter(
                initial_limit=rng.randint(1, 6), min_limit=1, max_limit=8
            )
            self.holder_bound = 8
        self.holders = 0
        self.breaker: CircuitBreaker | None = random_breaker(rng, 0.6)
        self.probes: list[Probe] = []
        # Shared strategies, as an application shares them between threads.
        self.strategies: dict[str, RetryStrategy | None] = {
            "default": None,
            "best_effort": BestEffortRetryStrategy(backoff=small_backoff),
            "pushy": Pushy(),
        }
        # The interpreter's switch interval: shorter makes threads interleave at more places.
        self.switch = rng.choice([None, 1e-4, 1e-5, 1e-5])
        self.records: list[Record] = []
        self.threads: list[list[Record]] = []
        for _ in range(rng.randint(8, 32)):
            mine = [Record(self.plan(len(self.records) + i)) for i in range(rng.randint(1, 4))]
            self.records.extend(mine)
            self.threads.append(mine)
        self.start_at = [rng.uniform(0.0, 0.01) for _ in self.threads]
        # Threads that hog the interpreter now and then: (when, for how long).
        self.spins = [
            (rng.uniform(0.0, 0.05), rng.uniform(0.001, 0.005)) for _ in range(rng.randint(0, 4))
        ]
        self.helpers = Threads(self.problems, self.lock)  # cancellers, started while running

    # -- the plan ----------------------------------------------------------------------------
    def plan(self, rid: int) -> Plan:
        rng = self.rng
        idempotent = rng.random() < 0.5
        timeout = rng.choice([None, rng.uniform(0.005, 0.1), rng.uniform(0.005, 0.1)])
        bounded = timeout is not None
        # A request without a deadline gets a small backoff: the default one grows to 500 ms,
        # and limiter, throttle or breaker refusals count as retries too.
        strategy = rng.choice(
            ["default", "best_effort", "pushy"] if bounded else ["best_effort", "pushy"]
        )
        steps = [self.step(bounded) for _ in range(rng.randint(0, 7 if bounded else 5))]
        interference = rng.choices(
            ["none", "cancel_at", "cancel_in_send", "cancel_after_fail", "cancel_on_answer"],
            weights=[4, 2, 2, 2, 3],
        )[0]
        if timeout is None and self.throttle is not None:
            # A throttle whose window holds many rejections and few accepts refuses almost
            # every attempt, and each refusal it counts keeps it there (the SRE rule,
            # rfc/0009 "Retrying a refusal"): a request without a deadline may then retry
            # far past SAFETY (seed 278: 8,000 refusals in 5 s). Given a deadline after the
            # draws, so every seed's other draws stay as they were.
            timeout = UNBOUNDED_UNDER_THROTTLE
        return Plan(
            rid=rid,
            idempotent=idempotent,
            timeout=timeout,
            strategy=strategy,
            steps=steps,
            interference=interference,
            cancel_on=rng.randint(0, max(0, len(steps) - 1)),
            interfere_at=rng.uniform(0.0, 0.03),
            custom_sleep=rng.random() < 0.2,
        )

    def step(self, bounded: bool) -> Step:
        rng = self.rng
        delay = rng.choice([0.0, 0.0, rng.uniform(0.0002, 0.003)])
        roll = rng.random()
        if roll < 0.08:
            return Step(delay, "plain", reset=rng.random() < 0.5)
        if roll < 0.18:
            return Step(delay, "ok")
        if roll < 0.24:
            return Step(delay, "expire")
        reason, effect = random_failure(rng, bounded)
        hint = rng.choice([None, None, None, None, 0.002, 0.01, -1.0 if bounded else None])
        return Step(delay, "retry", reason, effect, hint, reset=rng.random() < 0.5)

    # -- the send: throttle, limiter, breaker, endpoint (rfc/0009's order) --------------------
    def send(self, record: Record) -> str:
        attempt = Attempt(next(self.seq))
        record.attempts.append(attempt)
        try:
            value = self._throttled(record, attempt)
        except RetryableError as exc:
            attempt.outcome = "retry"
            attempt.reason = exc.reason
            attempt.effect = exc.effect or AttemptEffect.for_reason(exc.reason)
            attempt.error = exc
            raise
        except Exception as exc:
            attempt.outcome = "plain"
            attempt.effect = MAYBE  # a final answer: booked maybe applied (rfc/0001)
            attempt.error = exc
            raise
        except BaseException as exc:
            attempt.outcome = "other"
            attempt.error = exc
            raise
        else:
            attempt.outcome = "ok"
            attempt.value = value
        finally:
            attempt.end = next(self.seq)
            attempt.ended_at = time.monotonic()
        return value

    def _throttled(self, record: Record, attempt: Attempt) -> str:
        throttle = self.throttle
        if throttle is None:
            return self._limited(record, attempt)
        entered = False
        try:
            with throttle.guard():
                entered = True
                value = self._limited(record, attempt)
        except BaseException as exc:
            with self.lock:
                if not entered:
                    self.throttle_refusals += 1
                elif isinstance(exc, Exception) and not not_sent(exc):
                    self.throttle_requests += 1
                    self.throttle_accepts += not is_rejection(exc)
            raise
        with self.lock:
            self.throttle_requests += 1
            self.throttle_accepts += 1
        return value

    def _limited(self, record: Record, attempt: Attempt) -> str:
        limiter = self.limiter
        if limiter is None:
            return self._broken(record, attempt)
        with limiter.guard():
            with self.lock:
                self.holders += 1
                if self.holders > self.holder_bound:
                    self.problems.append(
                        f"limiter: {self.holders} sends hold a permit, bound {self.holder_bound}"
                    )
            try:
                return self._broken(record, attempt)
            finally:
                with self.lock:
                    self.holders -= 1

    def _broken(self, record: Record, attempt: Attempt) -> str:
        breaker = self.breaker
        if breaker is None:
            return self.endpoint(record, attempt)
        asked = time.monotonic()
        with breaker.guard() as admitted:
            probe = None
            if admitted is CircuitState.HALF_OPEN:
                probe = Probe(asked, time.monotonic())
                with self.lock:
                    self.probes.append(probe)
            try:
                return self.endpoint(record, attempt)
            finally:
                if probe is not None:
                    probe.done = time.monotonic()

    def endpoint(self, record: Record, attempt: Attempt) -> str:
        attempt.reached = True
        check_in_retry(self.orch, self.problems)
        plan = record.plan
        steps = plan.steps
        number = record.next_step
        step = steps[number] if number < len(steps) else Step(0.0)
        record.next_step += 1
        if step.delay:
            time.sleep(step.delay)
        if plan.interference == "cancel_in_send" and number == plan.cancel_on:
            # another thread cancels while this attempt is in flight; it answers afterwards
            canceller = self.helpers.start(self.cancel_request, record, 0.0)
            canceller.join(SAFETY)
        go = None
        if plan.interference == "cancel_on_answer" and number == plan.cancel_on:
            go = threading.Event()
            self.helpers.start(self.cancel_when, record, go)
        try:
            return self.answer(record, step, number)
        finally:
            if go is not None:
                go.set()  # the canceller runs as the door takes the answer in

    def answer(self, record: Record, step: Step, number: int) -> str:
        plan = record.plan
        if step.kind == "ok":
            return f"value {plan.rid}.{number}"
        if step.kind == "plain":
            plain = PlainError(f"request {plan.rid}: no such document ({number})")
            if step.reset:
                raise plain from ConnectionResetError("reset by the fake endpoint")
            raise plain
        if step.kind == "expire":
            assert record.request is not None
            left = record.request.time_left
            time.sleep(0.003 if left is None else left.total_seconds())
            raise TimeoutError(f"request {plan.rid}: socket timed out ({number})")
        assert step.reason is not None
        hint = step.hint
        if plan.interference == "cancel_after_fail" and number == plan.cancel_on:
            self.helpers.start(
                self.cancel_request, record, self.rng_for(record).uniform(0.0, 0.002)
            )
            if plan.timeout is None and not plan.custom_sleep:
                hint = LONG_HINT
        if hint == -1.0:
            assert record.request is not None
            left = record.request.time_left
            assert left is not None
            hint = max(0.0, left.total_seconds() - self.rng_for(record).uniform(0.0, 0.0003))
        error = RetryableError(step.reason, effect=step.effect, retry_after=hint)
        if step.reset:
            raise error from ConnectionResetError("reset by the fake endpoint")
        raise error

    def rng_for(self, record: Record) -> random.Random:
        """A generator for a choice made while running (threads must not share self.rng)."""
        return random.Random(self.seed * 1000 + record.plan.rid)

    # -- the threads ---------------------------------------------------------------------------
    def cancel_request(self, record: Record, wait: float) -> None:
        if wait:
            time.sleep(wait)
        request = record.request
        assert request is not None
        state = request.state  # one read: the door may be completing it meanwhile
        start = next(self.seq)
        request.cancel()
        end = next(self.seq)
        took = request.cancellation_reason is VIA_CONTEXT
        if record.cancel_start is None:  # one cancel per request is planned: the first counts
            record.cancel_time = time.monotonic()
            record.state_at_cancel = state
            record.cancel_start, record.cancel_end, record.cancel_took = start, end, took

    def cancel_when(self, record: Record, go: threading.Event) -> None:
        """Cancel as soon as the send hands its answer (or error) over, after a random few
        microseconds: while the door takes it in, at a random point of its code."""
        go.wait(SAFETY)
        end = time.perf_counter() + self.rng_for(record).uniform(0.0, 0.00005)
        while time.perf_counter() < end:
            pass
        self.cancel_request(record, 0.0)

    def spin(self, at: float, seconds: float) -> None:
        time.sleep(at)
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # hogs the interpreter: the others wait for it
            pass

    def worker(self, index: int) -> None:
        time.sleep(self.start_at[index])
        for record in self.threads[index]:
            self.run_one(record)

    def run_one(self, record: Record) -> None:
        plan = record.plan
        CURRENT.record = record
        request = record.request = Request(
            name=f"r{plan.rid}",
            idempotent=plan.idempotent,
            timeout=plan.timeout,
            retry_strategy=self.strategies[plan.strategy],
        )
        if plan.interference == "cancel_at":
            self.helpers.start(self.cancel_request, record, plan.interfere_at)
        try:
            if plan.custom_sleep:
                record.value = self.orch.execute_sync(
                    request, lambda r: self.send(record), sleep=lambda s: time.sleep(s)
                )
            else:
                record.value = self.orch.execute_sync(request, lambda r: self.send(record))
            record.outcome = "returned"
        except BaseException as exc:
            record.outcome = "raised"
            record.error = exc
        finally:
            record.end = next(self.seq)
            record.end_time = time.monotonic()
            record.state_at_end = (request.state, request.cancellation_reason)
            CURRENT.record = None

    def run(self) -> None:
        previous = sys.getswitchinterval()
        if self.switch is not None:
            sys.setswitchinterval(self.switch)
        try:
            workers = [
                threading.Thread(target=self.helpers.guarded, args=(self.worker, i), daemon=True)
                for i in range(len(self.threads))
            ]
            spinners = [
                threading.Thread(target=self.helpers.guarded, args=(self.spin, at, s), daemon=True)
                for at, s in self.spins
            ]
            for thread in spinners + workers:
                thread.start()
            deadline = time.monotonic() + SAFETY
            for thread in spinners + workers:
                thread.join(max(0.0, deadline - time.monotonic()))
            # the cancellers: every one was started by a worker (or by one of its sends)
            for thread in self.helpers.started():
                thread.join(max(0.0, deadline - time.monotonic()))
        finally:
            sys.setswitchinterval(previous)
        hung = [t for t in workers + spinners + self.helpers.started() if t.is_alive()]
        if hung:
            stuck = [r.plan.rid for r in self.records if r.end is None]
            self.problems.append(
                f"{len(hung)} thread(s) still running after {SAFETY} s: requests {stuck}"
            )

    # -- the invariants ----------------------------------------------------------------------
    def check(self) -> None:
        for record in self.records:
            if record.end is not None:
                self.check_record(record)
        limiter = self.limiter
        check_drained(self.orch, limiter, self.problems)
        if self.holders != 0:
            self.problems.append(f"{self.holders} sends still hold a permit at the end")
        if limiter is not None:
            self.check_permits(limiter)
        self.check_budget()
        self.check_throttle()
        self.check_breaker()

    def check_record(self, record: Record) -> None:
        plan = record.plan
        request = record.request
        assert request is not None
        attempts = record.attempts
        name = (
            f"request {plan.rid} (idempotent={plan.idempotent}, "
            f"timeout={None if plan.timeout is None else round(plan.timeout * 1000, 1)} ms, "
            f"{plan.strategy}, {plan.interference}"
            f"{' (custom sleep)' if plan.custom_sleep else ''}, "
            f"outcome {record.outcome} {show(record.error)}, state {request.state.name} "
            f"{request.cancellation_reason}, attempts {[describe(a) for a in attempts]})"
        )

        def problem(text: str) -> None:
            self.problems.append(f"{name}: {text}")

        error = record.error

        # Every request is complete once execute_sync returned or raised, and stays as it
        # ended (a later cancel() changes nothing).
        if not request.completed:
            problem("still PENDING after execute_sync ended")
        if record.state_at_end != (request.state, request.cancellation_reason):
            problem(f"its state changed after execute_sync ended (was {record.state_at_end})")

        # The door raises only the send's own non-retryable error (a PlainError, a socket's
        # TimeoutError) or sdkcore's documented exceptions.
        last = attempts[-1] if attempts else None
        own = last is not None and last.outcome == "plain" and error is last.error
        if record.outcome == "raised" and not (own or isinstance(error, CouchbaseException)):
            problem(f"execute_sync raised {type(error).__name__}: {error}")

        # What the door answered agrees with the request's state.
        if record.outcome == "returned":
            if request.state is not RequestState.SUCCEEDED:
                problem("execute_sync returned an answer but the request is not SUCCEEDED")
            if last is None or last.outcome != "ok" or record.value != last.value:
                problem(f"returned {record.value!r}, which is not its last send's answer")
        elif own:
            if request.state is not RequestState.FAILED:
                problem("failed with the send's own error but the request is not FAILED")
        elif isinstance(error, TimeoutException):
            check_timed_out(plan.timeout, request, problem)
            # rfc/0001 "Ambiguity": ambiguous exactly when the request is not idempotent and
            # some attempt may have been applied: one that said so, or a final error raised
            # past the deadline (execute_sync books it as an attempt cut in flight).
            maybe = any(a.effect is MAYBE for a in attempts)
            wanted = (
                AmbiguousTimeoutException
                if not plan.idempotent and maybe
                else UnambiguousTimeoutException
            )
            if not isinstance(error, wanted):
                problem(f"timed out with {type(error).__name__}, expected {wanted.__name__}")
        elif isinstance(error, RequestCanceledException):
            why = error.context.cancellation_reason if error.context is not None else None
            if request.state is not RequestState.CANCELLED:
                problem("RequestCanceledException but the request is not CANCELLED")
            if why is not request.cancellation_reason:
                problem(f"RequestCanceledException for {why}, the request says otherwise")
            if why is VIA_CONTEXT and record.cancel_start is None:
                problem("CANCELLED_VIA_CONTEXT, yet Request.cancel() was not called")
            if why is CancellationReason.TOO_MANY_REQUESTS_IN_RETRY and (
                self.orch.max_requests_in_retry > len(self.records)
            ):
                problem("refused for backpressure with room for every request")
            if why is CancellationReason.RETRY_BUDGET_EXHAUSTED and self.budget is None:
                problem("refused for the retry budget, but there is none")
        elif isinstance(error, (AuthenticationFailureException, TemporaryFailureException)):
            # a strategy's refusal with its own exception: FastFail's AUTHENTICATION_ERROR,
            # Pushy's TemporaryFailureException (rfc/0001 orchestration step 4)
            if request.cancellation_reason is not CancellationReason.NO_MORE_RETRIES:
                problem("a strategy's refusal, but the request is not NO_MORE_RETRIES")
            expected = (
                "pushy"
                if isinstance(error, TemporaryFailureException)
                else "default"
                if last is not None and last.reason is R.AUTHENTICATION_ERROR
                else None
            )
            if plan.strategy != expected:
                problem(f"{type(error).__name__} from strategy {plan.strategy}")
        elif record.outcome == "raised":
            problem(f"unexpected exception {show(error)}")
        # "Whatever send raises once the deadline has passed becomes the timeout" (rfc/0001
        # "The three doors"; the door reads its clock after send: later than ended_at).
        if (
            last is not None
            and last.outcome in ("retry", "plain")
            and last.ended_at >= request.deadline
            and request.cancellation_reason is not VIA_CONTEXT
            and not isinstance(error, TimeoutException)
        ):
            problem(f"its last send failed past the deadline, yet it raised {show(error)}")

        # rfc/0001 "Final exception's cause": sdkcore's final exception has the last attempt's
        # failure as __cause__ (a RetryableError's own cause if it has one), on every door.
        if isinstance(error, CouchbaseException) and last is not None and last.error is not None:
            failure = last.error
            wanted_cause = (failure.__cause__ or failure) if last.outcome == "retry" else failure
            if error.__cause__ is not wanted_cause:
                problem(
                    f"__cause__ {show(error.__cause__)}, not the last attempt's failure "
                    f"{show(wanted_cause)}"
                )

        # Request.cancel() that completed the request: the caller gets
        # RequestCanceledException (CANCELLED_VIA_CONTEXT), whatever the attempt in flight then
        # did, and the request stays CANCELLED_VIA_CONTEXT.
        if request.cancellation_reason is VIA_CONTEXT or record.cancel_took:
            if not (
                isinstance(error, RequestCanceledException)
                and error.context is not None
                and error.context.cancellation_reason is VIA_CONTEXT
            ):
                problem(
                    "Request.cancel() completed the request, yet execute_sync did not raise "
                    "RequestCanceledException (CANCELLED_VIA_CONTEXT)"
                )
            if request.cancellation_reason is not VIA_CONTEXT:
                problem("Request.cancel() completed the request, then its ending changed")
            # execute_sync's default sleep waits on an event cancel() sets, from any thread
            # (rfc/0001 "Application cancel"); a send takes at most 0.1 s here
            if not plan.custom_sleep and record.end_time - record.cancel_time > WAKE_BOUND:
                problem(
                    f"execute_sync ended {record.end_time - record.cancel_time:.3f} s after "
                    "Request.cancel() completed the request"
                )
        if record.cancel_start is not None and record.state_at_cancel is not None:
            if record.state_at_cancel is not RequestState.PENDING and (
                request.state is not record.state_at_cancel or record.cancel_took
            ):
                problem(f"cancel() of a request already {record.state_at_cancel} changed it")
            start, end = record.cancel_start, record.cancel_end
            assert end is not None
            # A thread checks the state before each send; cancel() may come right after that
            # check: one send may start after it returned, no more, and none after an attempt
            # that was in flight while cancel() ran (the door checks the state after each
            # send). Counted from its return, not its call: a loaded machine can hold the
            # cancelling thread between the two (seen once: four sends in that window).
            later = [a.start for a in attempts if a.start > end]
            if len(later) > 1:
                problem(f"{len(later)} sends started after Request.cancel() returned: {later}")
            across = [a for a in attempts if a.start < start and (a.end or 0) > end]
            if across and any(a.start > across[0].start for a in attempts):
                problem("a send started after the attempt in flight across Request.cancel()")

        # A request that is not idempotent is never sent again once an attempt may have been
        # applied, or failed for a reason that forbids it, whatever the strategy said.
        if not plan.idempotent:
            for before in attempts[:-1]:
                assert before.reason is not None or before.outcome != "retry"
                if before.outcome == "retry" and (
                    before.effect is MAYBE
                    or not (before.reason and before.reason.allows_non_idempotent_retry)
                ):
                    problem(
                        f"sent again after an attempt {before.reason} / {before.effect}: "
                        "it may be applied twice"
                    )
        # Sends stop at an answer or a final error; a retry is booked before each later send.
        if any(a.outcome in ("ok", "plain", "other") for a in attempts[:-1]):
            problem("a send after an answer or a final error")
        if any(a.end is None for a in attempts):
            problem("a send is still in flight after execute_sync ended")
        if attempts and not len(attempts) - 1 <= request.retry_attempts <= len(attempts):
            problem(f"retry_attempts {request.retry_attempts} for {len(attempts)} sends")

    def check_permits(self, limiter: ConcurrencyLimiter | AdaptiveConcurrencyLimiter) -> None:
        """Nothing in flight: exactly ``limit`` guards are let through at once, the next is
        refused (a permit comes back however its block ended: none lost, none made)."""
        limit = limiter.limit
        held = 0
        with contextlib.ExitStack() as stack:
            try:
                for _ in range(limit):
                    stack.enter_context(limiter.guard())
                    held += 1
            except RetryableError:
                self.problems.append(f"limiter: {held} permits of {limit} at the end")
                return
            try:
                with limiter.guard():
                    self.problems.append(f"limiter: a permit beyond its limit {limit} at the end")
            except RetryableError:
                pass

    def check_budget(self) -> None:
        budget = self.budget
        if budget is None:
            return
        # Every retry that sends again after an attempt that reached the server (not NOT_SENT)
        # withdraws once; a retry never sent is refunded (rfc/0007 section 4, rfc/0001
        # "Application cancel").
        spent = 0
        dispatched = 0
        for record in self.records:
            attempts = record.attempts
            dispatched += bool(attempts)
            # a retry after an attempt that reached the server withdraws; given back if its
            # own attempt was never sent (an OPEN breaker's refusal)
            mine = sum(
                1
                for before, after in itertools.pairwise(attempts)
                if before.effect is not NOT_SENT and after.effect is not NOT_SENT
            )
            spent += mine
            # Its own operations: net withdrawals as computed above; execute_sync deposits
            # once per request, before its first attempt.
            plan = record.plan
            check_request_budget(
                plan.rid,
                record,
                mine,
                len(attempts),
                self.problems,
                about=f"idempotent={plan.idempotent}, timeout {plan.timeout}, "
                f"{plan.interference}, outcome {record.outcome} {show(record.error)}, "
                f"retry_attempts {record.request and record.request.retry_attempts}",
                sends=f"attempts {[(a.outcome, a.effect and a.effect.name) for a in attempts]}",
            )
        check_budget_totals(
            budget,
            spent=spent,
            dispatched=dispatched,
            at_most=len(self.records),
            problems=self.problems,
        )

    def check_throttle(self) -> None:
        throttle = self.throttle
        if throttle is None:
            return
        # rfc/0009 "What is counted": a refusal is a request; an admitted block that ended is a
        # request, and an accept unless its error is a rejection; NOT_SENT counts nothing.
        requests, accepts = throttle.requests, throttle.accepts
        wanted = (self.throttle_refusals + self.throttle_requests, self.throttle_accepts)
        if (requests, accepts) != wanted or throttle.refused != self.throttle_refusals:
            self.problems.append(
                f"throttle: requests {requests}, accepts {accepts}, refused {throttle.refused}; "
                f"expected {wanted[0]}, {wanted[1]}, {self.throttle_refusals}"
            )
        if not 0.0 <= throttle.rejection_probability < 1.0:
            self.problems.append(f"throttle: probability {throttle.rejection_probability}")

    def check_breaker(self) -> None:
        breaker = self.breaker
        if breaker is None:
            return
        if breaker.state not in tuple(CircuitState):
            self.problems.append(f"breaker: state {breaker.state!r}")
        outcomes, failures = breaker.counts
        if not 0 <= failures <= outcomes:
            self.problems.append(f"breaker: counts {outcomes} outcomes, {failures} failures")
        # While HALF_OPEN only one probe is out: a second one is granted only after the first
        # reported, or once it ran out of canary_timeout (rfc/0007 section 1).
        canary = breaker.canary_timeout.total_seconds()
        probes = sorted(self.probes, key=lambda p: p.granted)
        for first, second in itertools.combinations(probes, 2):
            if (
                first.granted < second.asked  # granted in this order
                and second.granted < first.done  # before the first one's block ended
                and second.granted < first.asked + canary  # and before it could run out
            ):
                self.problems.append(
                    f"breaker: a probe granted {1000 * (second.granted - first.asked):.2f} ms "
                    "after another, still in its block and within canary_timeout"
                )


@pytest.mark.parametrize("seed", SEEDS)
def test_sync_door_keeps_its_promises_under_random_schedules(seed: int) -> None:
    world = World(seed)
    world.run()
    world.check()
    assert not world.problems, f"seed {seed}:\n" + "\n".join(world.problems)
