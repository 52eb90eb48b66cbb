"""Random schedules through every async door, on asyncio and trio, checking the promises.

Each seed builds one ``RetryOrchestrator`` (sometimes with a ``RetryBudget``), sometimes a
``CircuitBreaker`` and a ``ConcurrencyLimiter`` / ``AdaptiveConcurrencyLimiter`` around a
fake endpoint (README: "One order for every door, outermost first: ... limiter, breaker,
send"), and a few dozen concurrent requests through a random mix of doors: ``execute``,
the hand-wired loop of the README (``attempt()`` + ``maybe_retry()`` + ``succeed()``/
``fail()``) and ``hedge``. The endpoint answers, fails retryably (random reasons and
effects, always-retry reasons included), fails for good, or takes a while; another task
calls ``Request.cancel()`` (at a random moment, or right as an answer is handed over), the
caller's own cancel scope is cancelled (or ``move_on_after`` runs out), and the event loop
stalls now and then. Once every door has ended, every request is checked; all violations
of a seed are reported together, with the seed and the backend.

Small real delays (0 to 60 ms) drive the schedule, so a seed's interleaving varies from
run to run, but its plan (which requests, doors, answers and interferences) is fixed by
the seed. Every check below holds whatever the interleaving.

The promises checked (README, rfc/0001, rfc/0004, rfc/0007, rfc/0009, docstrings):

* the door's outcome: an answer of one of its sends (then SUCCEEDED), the send's own
  non-retryable error (FAILED), a ``CouchbaseException`` (a timeout, CANCELLED with
  TIMEOUT, only for a request with a timeout, ambiguous exactly when the request is not
  idempotent and some attempt may have been applied; ``RequestCanceledException``,
  CANCELLED), or a cancellation that the caller's own scope catches; never an exception
  group, a ``RetryableError``, a ``RuntimeError``...; the request is complete afterwards
  (a hedge of a non-idempotent request is refused before anything is sent and stays
  pending, as rfc/0004 says);
* ``Request.cancel()`` while pending: the door raises ``RequestCanceledException``
  (CANCELLED_VIA_CONTEXT) "even if an answer arrived meanwhile", no attempt starts after
  it, no send is written after it (except the one execute without a timeout lets run to
  its end, as documented);
* the caller's cancellation: nothing is written after it and it is never retried;
* no attempt after the one that ended the request (an answer, a final error, a cut, a
  fatal hedge failure, or, for a non-idempotent request, an attempt that may have been
  applied or whose reason forbids a retry); nothing a door started outlives it;
* ``requests_in_retry`` stays in ``[0, max_requests_in_retry]`` and is 0 at the end; the
  limiter holds at most its limit (``max_limit`` for the adaptive one), and nothing is in
  flight or queued at the end; no task outlives the task group;
* the retry budget: one deposit per request that dispatched; withdrawals minus refunds
  equal the retries (and hedges) that were sent after an attempt that reached the server;
  the balance is what Finagle's arithmetic gives for those operations.

Model of the endpoint: a send passes one checkpoint before it "writes" (as trio's and
anyio's stream operations check for cancellation first). A send cut at that first
checkpoint never reached the server; "nothing after X" is checked on writes, because a
task that trio (or anyio on asyncio) had already woken when X happened runs up to its next
checkpoint first: that is the event loops' rule, not sdkcore's. For the same reason one
attempt may start after the caller's cancellation, and a hedge runner may start copies
before its caller's cancellation (or its deadline) reaches it; none of them writes, except
on asyncio a copy after the first, which runs as the loop's own task outside the caller's
anyio scope until the runner cuts it (an assumption: rfc/0004 promises that every copy is
cancelled and the cancellation propagates, which is checked, not that none starts).
"""

from __future__ import annotations

import contextvars
import itertools
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from fuzz_kit import (
    CountingBudget,
    PlainError,
    Step,
    check_budget_totals,
    check_drained,
    check_in_retry,
    check_request_budget,
    check_timed_out,
    random_breaker,
    random_budget,
    random_failure,
    run_seed,
    show,
    small_backoff,
    through_door,
    with_permit,
)

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    AmbiguousTimeoutException,
    AttemptEffect,
    BestEffortRetryStrategy,
    CancellationReason,
    CircuitBreaker,
    ConcurrencyLimiter,
    CouchbaseException,
    HedgePolicy,
    InvalidArgumentException,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    RetryStrategy,
    TimeoutException,
    UnambiguousTimeoutException,
)

if sys.version_info < (3, 11):  # pragma: no cover - trio brings the backport there
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

pytestmark = pytest.mark.anyio

SEEDS = range(40)
SAFETY = 5.0  # seconds: a seed whose doors hang fails here instead of hanging the suite

NOT_SENT = AttemptEffect.NOT_SENT
MAYBE = AttemptEffect.MAYBE_APPLIED
R = RetryReason


@dataclass
class RawSend:
    """One call of the endpoint (below the limiter and the breaker)."""

    index: int  # the hedge copy (0 for the other doors)
    start: int  # sequence numbers (one global order of events)
    attempt_start: int  # when the attempt (the door's send call) it belongs to started
    written: int | None = None  # when it passed its first checkpoint: it reached the server
    end: int | None = None
    outcome: str = "in_flight"  # ok, retry, plain, cancelled
    reason: RetryReason | None = None
    effect: AttemptEffect | None = None  # what it reported (its default for the reason)
    value: str | None = None
    error: BaseException | None = None


@dataclass
class Dispatch:
    """One call of the door's ``send`` (through limiter and breaker): an attempt."""

    index: int
    start: int
    end: int | None = None
    outcome: str = "in_flight"  # ok, retry, plain, cancelled
    effect: AttemptEffect | None = None  # what sdkcore books for it when it failed
    reason: RetryReason | None = None
    booked: int = 0  # request.retry_attempts when it ended (for a hedge: copies booked)
    reached: bool = False  # it got past the limiter (to the breaker and the endpoint)


@dataclass
class Plan:
    rid: int
    door: str  # execute, hand, hedge
    idempotent: bool
    timeout: float | None
    strategy: str  # default, best_effort or async (see SlowStrategy)
    strategy_wait: float  # seconds SlowStrategy takes to answer
    steps: list[Step]
    # none; request_cancel (Request.cancel() from another task at interfere_at);
    # caller_cancel (the caller's cancel scope, cancelled from another task at interfere_at);
    # move_on (anyio.move_on_after(interfere_at) around the door); answer_then_cancel (the
    # send numbered cancel_on waits for its answer from a reader task, which calls
    # Request.cancel() right after handing the answer over, before the sender runs)
    interference: str
    cancel_on: int
    interfere_at: float
    start_at: float
    use_acquire: bool  # limiter.acquire() (queue) rather than limiter.guard()
    hedge: HedgePolicy | None


@dataclass
class Record:
    plan: Plan
    request: Request | None = None
    raws: list[RawSend] = field(default_factory=list)
    dispatches: list[Dispatch] = field(default_factory=list)
    next_step: int = 0
    request_cancel: int | None = None  # seq of Request.cancel() while the door ran
    request_cancel_pending: bool = False  # ... and the request was pending then
    caller_cancel: int | None = None  # seq of the caller's scope.cancel() while the door ran
    outcome: str = "not_started"  # returned, raised, cancelled, escaped
    value: Any = None
    error: BaseException | None = None
    end: int | None = None
    scope_caught: bool = False
    left_running: int = 0  # attempts still running when the door ended
    deposits: int = 0  # the retry budget's operations made for this request
    withdrawn: int = 0
    refunded: int = 0


#: The request whose door runs in this task (or in a callback or task it scheduled): the
#: budget's operations are attributed to it.
CURRENT: contextvars.ContextVar[Record | None] = contextvars.ContextVar("CURRENT", default=None)


def running_backend() -> str:
    """The event loop running this task: "asyncio" or "trio"."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    return "asyncio"


def written_after(raws: list[RawSend], seq: int) -> list[RawSend]:
    """The sends that started after event ``seq`` and got past their first checkpoint."""
    return [r for r in raws if r.start > seq and r.written is not None]


class SlowStrategy:
    """A strategy that must be awaited (it "asks a service" first), then decides as a
    BestEffortRetryStrategy with a small backoff."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.inner = BestEffortRetryStrategy(backoff=small_backoff)

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        await anyio.sleep(self.seconds)
        return self.inner.decide(request, reason)


class World:
    """One seed: the orchestrator, the endpoint's guards, the requests and what happened."""

    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.seq = itertools.count()
        self.problems: list[str] = []
        self.budget: CountingBudget | None = random_budget(rng, self.problems, CURRENT.get)
        self.orch = RetryOrchestrator(
            max_requests_in_retry=rng.choice([2, 6, 32768]), retry_budget=self.budget
        )
        self.breaker: CircuitBreaker | None = random_breaker(rng, 0.5)
        self.limiter: ConcurrencyLimiter | AdaptiveConcurrencyLimiter | None = None
        self.holder_bound = 0
        kind = rng.choice([None, "fixed", "adaptive"])
        queue = rng.choice([0, 1, 4, 64])
        if kind == "fixed":
            self.limiter = ConcurrencyLimiter(rng.randint(1, 4), max_queued=queue)
            self.holder_bound = self.limiter.limit
        elif kind == "adaptive":
            self.limiter = AdaptiveConcurrencyLimiter(
                initial_limit=rng.randint(1, 6), min_limit=1, max_limit=8, max_queued=queue
            )
            self.holder_bound = 8
        self.holders = 0
        self.tg: anyio.abc.TaskGroup | None = None
        self.backend = ""
        self.records = [Record(self.plan(rid)) for rid in range(rng.randint(20, 36))]
        # The loop stalls now and then (a garbage collection, a slow callback): timers that
        # fall due meanwhile fire together, as on a loaded machine.
        self.stalls = [
            (rng.uniform(0.0, 0.05), rng.uniform(0.001, 0.006)) for _ in range(rng.randint(0, 4))
        ]

    # -- the plan ----------------------------------------------------------------------------
    def plan(self, rid: int) -> Plan:
        rng = self.rng
        door = rng.choice(["execute", "execute", "hand", "hand", "hedge"])
        idempotent = rng.random() < (0.85 if door == "hedge" else 0.5)
        timeout = rng.choice([None, rng.uniform(0.004, 0.05), rng.uniform(0.004, 0.05)])
        bounded = timeout is not None
        # A request without a deadline gets a small constant backoff: the default one grows to
        # 500 ms, and limiter or breaker refusals count as retries too.
        strategy = "best_effort" if not bounded or rng.random() < 0.5 else "default"
        if strategy == "best_effort" and rng.random() < 0.3:
            strategy = "async"  # the same decisions, awaited: maybe_retry bounds the await
        steps = [self.step(bounded) for _ in range(rng.randint(0, 5))]
        interference = rng.choices(
            ["none", "request_cancel", "caller_cancel", "move_on", "answer_then_cancel"],
            weights=[4, 2, 2, 1, 2],
        )[0]
        hedge = None
        if door == "hedge":
            hedge = HedgePolicy(
                max_attempts=rng.randint(1, 4),
                delay=rng.choice([0.0, 0.001, 0.003, 0.008]),
                non_fatal=rng.choice(
                    [None, None, frozenset({R.KV_TEMPORARY_FAILURE, R.KV_LOCKED})]
                ),
            )
        return Plan(
            rid=rid,
            door=door,
            idempotent=idempotent,
            timeout=timeout,
            strategy=strategy,
            strategy_wait=rng.uniform(0.0, 0.002),
            steps=steps,
            interference=interference,
            cancel_on=rng.randint(0, len(steps)),
            interfere_at=rng.uniform(0.0, 0.03),
            start_at=rng.uniform(0.0, 0.01),
            use_acquire=rng.random() < 0.5,
            hedge=hedge,
        )

    def step(self, bounded: bool) -> Step:
        rng = self.rng
        slow = rng.uniform(0.01, 0.06 if bounded else 0.02)
        delay = rng.choice([0.0, 0.0, rng.uniform(0.0005, 0.003), rng.uniform(0.0005, 0.003), slow])
        roll = rng.random()
        if roll < 0.1:
            return Step(delay, "plain")
        if roll < 0.2:
            return Step(delay, "ok")
        reason, effect = random_failure(rng, bounded)
        hint = rng.choice([None, None, None, None, 0.002, 0.01])
        return Step(delay, "retry", reason, effect, hint, reset=rng.random() < 0.3)

    # -- the endpoint, behind the limiter and the breaker ---------------------------------------
    async def dispatch(self, record: Record, index: int) -> str:
        """The door's ``send``: limiter (outermost), breaker, then the endpoint."""
        attempt = Dispatch(index, next(self.seq))
        record.dispatches.append(attempt)
        try:
            value = await self._limited(record, attempt)
        except RetryableError as exc:
            attempt.outcome = "retry"
            attempt.reason = exc.reason
            attempt.effect = exc.effect or AttemptEffect.for_reason(exc.reason)
            raise
        except PlainError:
            attempt.outcome = "plain"
            attempt.effect = MAYBE
            raise
        except BaseException:
            attempt.outcome = "cancelled"
            # A cut copy is booked maybe applied (hedge), unless it was cut while it waited
            # for a permit in the limiter's queue: nothing was sent, not sent and refunded.
            attempt.effect = MAYBE if attempt.reached else NOT_SENT
            raise
        else:
            attempt.outcome = "ok"
        finally:
            attempt.end = next(self.seq)
            assert record.request is not None
            attempt.booked = record.request.retry_attempts
        return value

    async def _limited(self, record: Record, attempt: Dispatch) -> str:
        limiter = self.limiter
        if limiter is None:
            return await self._broken(record, attempt)
        return await with_permit(
            limiter, record.plan.use_acquire, lambda: self._holding(record, attempt)
        )

    async def _holding(self, record: Record, attempt: Dispatch) -> str:
        self.holders += 1
        try:
            if self.holders > self.holder_bound:
                self.problems.append(
                    f"limiter: {self.holders} dispatches hold a permit, bound {self.holder_bound}"
                )
            return await self._broken(record, attempt)
        finally:
            self.holders -= 1

    async def _broken(self, record: Record, attempt: Dispatch) -> str:
        attempt.reached = True
        if self.breaker is None:
            return await self.endpoint(record, attempt)
        with self.breaker.guard():
            return await self.endpoint(record, attempt)

    async def endpoint(self, record: Record, attempt: Dispatch) -> str:
        raw = RawSend(attempt.index, next(self.seq), attempt.start)
        record.raws.append(raw)
        check_in_retry(self.orch, self.problems)
        steps = record.plan.steps
        step = steps[record.next_step] if record.next_step < len(steps) else Step(0.0)
        record.next_step += 1
        answer_then_cancel = (
            record.plan.interference == "answer_then_cancel"
            and record.next_step - 1 == record.plan.cancel_on
        )
        try:
            await anyio.lowlevel.checkpoint()  # connect: cancellation is checked here first
            raw.written = next(self.seq)
            if answer_then_cancel:
                answered = anyio.Event()
                assert self.tg is not None
                self.tg.start_soon(self.answer_then_cancel, record, step.delay, answered)
                await answered.wait()
            elif step.delay:
                await anyio.sleep(step.delay)
        except BaseException:
            raw.outcome = "cancelled"
            raw.end = next(self.seq)
            raise
        raw.end = next(self.seq)
        if step.kind == "ok":
            raw.outcome = "ok"
            raw.value = f"value {record.plan.rid}.{len(record.raws)}"
            return raw.value
        if step.kind == "plain":
            raw.outcome = "plain"
            raw.error = PlainError(f"request {record.plan.rid}: no such document")
            raise raw.error
        assert step.reason is not None
        raw.outcome = "retry"
        raw.reason = step.reason
        raw.effect = step.effect or AttemptEffect.for_reason(step.reason)
        error = RetryableError(step.reason, effect=step.effect, retry_after=step.hint)
        raw.error = error
        if step.reset:
            raise error from ConnectionResetError("reset by the fake endpoint")
        raise error

    # -- the doors ------------------------------------------------------------------------------
    async def door(self, record: Record) -> str:
        request = record.request
        assert request is not None

        async def dispatch(index: int) -> str:
            return await self.dispatch(record, index)

        return await through_door(self.orch, request, record.plan.door, dispatch, record.plan.hedge)

    async def run_one(self, record: Record, tg: anyio.abc.TaskGroup) -> None:
        plan = record.plan
        await anyio.sleep(plan.start_at)
        CURRENT.set(record)
        strategy: RetryStrategy | None = None
        if plan.strategy == "best_effort":
            strategy = BestEffortRetryStrategy(backoff=small_backoff)
        elif plan.strategy == "async":
            strategy = SlowStrategy(plan.strategy_wait)
        record.request = Request(
            name=f"r{plan.rid}",
            idempotent=plan.idempotent,
            timeout=plan.timeout,
            retry_strategy=strategy,
        )
        scope = (
            anyio.move_on_after(plan.interfere_at)
            if plan.interference == "move_on"
            else anyio.CancelScope()
        )
        if plan.interference == "request_cancel":
            tg.start_soon(self.cancel_request, record)
        elif plan.interference == "caller_cancel":
            tg.start_soon(self.cancel_caller, record, scope)
        cancelled = anyio.get_cancelled_exc_class()
        try:
            with scope:
                try:
                    record.value = await self.door(record)
                    record.outcome = "returned"
                except cancelled as exc:
                    record.outcome = "cancelled"
                    record.error = exc
                    raise
                except BaseException as exc:
                    record.outcome = "raised"
                    record.error = exc
                finally:
                    record.end = next(self.seq)
                    record.left_running = sum(1 for d in record.dispatches if d.end is None)
        except BaseException as exc:  # a cancellation the caller's scope did not catch
            record.outcome = "escaped"
            record.error = exc
        record.scope_caught = scope.cancelled_caught

    async def cancel_request(self, record: Record, wait: bool = True) -> None:
        if wait:
            await anyio.sleep(record.plan.interfere_at)
        request = record.request
        assert request is not None
        if record.end is None:
            record.request_cancel = next(self.seq)
            record.request_cancel_pending = not request.completed
        request.cancel()

    async def answer_then_cancel(self, record: Record, delay: float, answered: anyio.Event) -> None:
        """A driver's reader task: hands the answer over, then the application cancels."""
        await anyio.sleep(delay)
        answered.set()
        await self.cancel_request(record, wait=False)

    async def cancel_caller(self, record: Record, scope: anyio.CancelScope) -> None:
        await anyio.sleep(record.plan.interfere_at)
        if record.end is None:
            record.caller_cancel = next(self.seq)
        scope.cancel()

    async def run(self) -> None:
        self.backend = running_backend()

        def start(tg: anyio.abc.TaskGroup) -> None:
            self.tg = tg
            for record in self.records:
                tg.start_soon(self.run_one, record, tg)

        timed_out, outlived = await run_seed(start, self.stalls, SAFETY)
        if timed_out:
            hung = [r.plan.rid for r in self.records if r.outcome == "escaped"]
            self.problems.append(f"doors still running after {SAFETY} s: requests {hung}")
        if outlived:
            self.problems.append(f"{outlived} task(s) outlived the task group")

    # -- the invariants ----------------------------------------------------------------------
    def check(self) -> None:
        for record in self.records:
            self.check_record(record)
        check_drained(self.orch, self.limiter, self.problems)
        if self.holders != 0:
            self.problems.append(f"{self.holders} dispatches still hold a permit at the end")
        self.check_budget()

    def check_record(self, record: Record) -> None:
        plan = record.plan
        request = record.request
        assert request is not None
        name = (
            f"request {plan.rid} ({plan.door}, idempotent={plan.idempotent}, "
            f"timeout={None if plan.timeout is None else round(plan.timeout * 1000, 1)} ms, "
            f"{plan.strategy}, {plan.interference} at {plan.interfere_at * 1000:.1f} ms, "
            f"outcome {record.outcome} {show(record.error)}, state {request.state.name} "
            f"{request.cancellation_reason}, raws {[r.outcome for r in record.raws]})"
        )

        def problem(text: str) -> None:
            self.problems.append(f"{name}: {text}")

        error = record.error
        end = record.end if record.end is not None else math.inf

        # Hedging a request that is not idempotent is refused before anything is sent; the
        # request stays pending (rfc/0004, table).
        if plan.door == "hedge" and not plan.idempotent:
            if not (isinstance(error, InvalidArgumentException) or record.outcome == "cancelled"):
                problem("a non-idempotent hedge was not refused with InvalidArgumentException")
            if record.dispatches:
                problem("a non-idempotent hedge sent something")
            return

        # Every request is complete once its door returned or raised (every door completes
        # it: execute/hedge themselves, the hand-wired loop through attempt/maybe_retry/
        # succeed/fail; the caller's cancellation ends it CANCELLED, TASK_CANCELLED).
        if not request.completed:
            problem("still PENDING after its door ended")

        # A door raises only the send's own error, sdkcore's documented exceptions, or a
        # cancellation the caller's scope catches: never a group, a RetryableError, etc.
        if record.outcome == "escaped":
            problem(f"an exception escaped the caller's cancel scope: {error!r}")
        elif record.outcome == "cancelled":
            if plan.interference not in ("caller_cancel", "move_on"):
                problem("the door raised a cancellation nobody asked for")
            elif not record.scope_caught:
                problem("the caller's scope did not catch the door's cancellation")
            if request.state is not RequestState.CANCELLED:
                problem("a request whose caller was cancelled is not CANCELLED")
        elif record.outcome == "raised":
            assert error is not None
            if isinstance(error, BaseExceptionGroup) or not isinstance(
                error, (PlainError, CouchbaseException)
            ):
                problem(f"the door raised {type(error).__name__}: {error}")

        # What the door answered agrees with the request's state.
        if record.outcome == "returned":
            if request.state is not RequestState.SUCCEEDED:
                problem("the door returned an answer but the request is not SUCCEEDED")
            if record.value not in [r.value for r in record.raws if r.outcome == "ok"]:
                problem(f"returned {record.value!r}, which no send of this request answered")
        elif isinstance(error, PlainError):
            if request.state is not RequestState.FAILED and not record.request_cancel_pending:
                problem("failed with the send's own error but the request is not FAILED")
            if not any(error is r.error for r in record.raws):
                problem("raised a PlainError that none of its sends raised")
        elif isinstance(error, TimeoutException):
            check_timed_out(plan.timeout, request, problem)
            # rfc/0001 "Ambiguity": ambiguous exactly when the request is not idempotent and
            # some attempt may have been applied (reported so, or cut in flight).
            maybe = any(
                r.outcome == "cancelled" or (r.outcome == "retry" and r.effect is MAYBE)
                for r in record.raws
            )
            ambiguous = not plan.idempotent and maybe
            wanted = AmbiguousTimeoutException if ambiguous else UnambiguousTimeoutException
            if not isinstance(error, wanted):
                problem(f"timed out with {type(error).__name__}, expected {wanted.__name__}")
        elif isinstance(error, RequestCanceledException):
            if request.state is not RequestState.CANCELLED:
                problem("RequestCanceledException but the request is not CANCELLED")
            via_context = request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
            if via_context and not record.request_cancel_pending:
                problem("CANCELLED_VIA_CONTEXT, yet Request.cancel() was not called")

        # Request.cancel() while the request was pending: the caller gets
        # RequestCanceledException (CANCELLED_VIA_CONTEXT) "even if an answer arrived
        # meanwhile" (Request.cancel's docstring; rfc/0001 "Application cancel"), unless its
        # own cancellation came first; and nothing is written after it.
        if record.request_cancel is not None and record.request_cancel_pending:
            cancel = record.request_cancel
            if record.outcome != "cancelled" and not (
                isinstance(error, RequestCanceledException)
                and request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
            ):
                problem(
                    "Request.cancel() while pending, yet the door did not raise "
                    "RequestCanceledException (CANCELLED_VIA_CONTEXT)"
                )
            # Request.cancel() changes the request's state at once: every door checks it
            # before it starts an attempt, whatever the schedule.
            later = [d.start for d in record.dispatches if d.start > cancel]
            if later:
                problem(f"attempt(s) started after Request.cancel(): {later}")
            late = written_after(record.raws, cancel)
            if plan.door == "execute" and plan.timeout is None:
                # Documented: without a timeout execute arms no scope, and the attempt in
                # flight (here: one queued for a permit) runs to its end.
                late = [r for r in late if r.attempt_start > cancel]
            if late:
                problem(f"{len(late)} send(s) started and written after Request.cancel()")

        # The caller's own cancellation: nothing new is written after it (it is never a retry).
        if record.caller_cancel is not None:
            # The door's task may already have been woken when the scope was cancelled: it
            # then runs to its next checkpoint, which may be inside one more attempt (its
            # permit wait, or the send's first checkpoint), never further.
            later = [d.start for d in record.dispatches if d.start > record.caller_cancel]
            if len(later) > 1 and plan.door != "hedge":
                problem(f"attempts started after the caller's cancellation: {later}")
            late = written_after(record.raws, record.caller_cancel)
            if plan.door == "hedge" and self.backend == "asyncio":
                # On asyncio the copies after the first are the loop's own tasks, outside the
                # caller's anyio scope: one started before the runner is told (the caller's
                # task is woken with the cancellation) runs until the runner cuts it.
                late = [r for r in late if r.index == 0]
            if late:
                problem(f"{len(late)} send(s) started and written after the caller's cancellation")

        # No attempt starts after one that ended the request: an answer, a final error, a cut
        # (the deadline, Request.cancel(), the caller, a hedge that lost), a hedge failure
        # whose reason is not non-fatal, or, for a request that is not idempotent, an attempt
        # that may have been applied or whose reason forbids a retry (rfc/0001 "Which wins:
        # the effect or the flag"). The door decides in the step the attempt ended in, so
        # this holds whatever the schedule.
        non_fatal = plan.hedge.non_fatal if plan.hedge is not None else None
        finals: list[Dispatch] = []
        for attempt in record.dispatches:
            if attempt.end is None:
                continue  # reported below
            if attempt.outcome in ("ok", "plain", "cancelled"):
                finals.append(attempt)
            elif attempt.outcome == "retry":
                reason = attempt.reason
                assert reason is not None
                fatal = non_fatal is not None and reason not in non_fatal
                unsafe = not plan.idempotent and (
                    attempt.effect is MAYBE or not reason.allows_non_idempotent_retry
                )
                if fatal or unsafe:
                    finals.append(attempt)
        if finals:
            first = min(finals, key=lambda d: d.end or 0)
            assert first.end is not None
            after_final = [d for d in record.dispatches if d.start > first.end]
            if plan.door == "hedge" and first.outcome == "cancelled":
                # A copy cut by the deadline: the runner learns of the cut when it next runs,
                # and a copy it booked before may still begin after it (trio starts every
                # task it was given; on a loaded machine, late), to be cut before it writes.
                # A copy booked after the cut is a new send.
                after_final = [d for d in after_final if d.index > first.booked]
                written = written_after(record.raws, first.end)
                if written:
                    problem(f"{len(written)} send(s) written after a cut that ended the request")
            if plan.door == "hedge" and plan.interference == "move_on":
                after_final = []  # the caller's deadline: when it fired is not recorded
            elif plan.door == "hedge" and record.caller_cancel is not None:
                # The runner learns of its caller's cancellation only when it is delivered;
                # copies it starts before that are cut before they write (checked above).
                after_final = [d for d in after_final if d.start < record.caller_cancel]
            if after_final:
                problem(
                    f"attempt(s) started {[d.start for d in after_final]} after the attempt that "
                    f"ended the request (at {first.end})"
                )
        if record.left_running:
            # Structured concurrency: nothing a door started outlives it (rfc/0004 "Nothing
            # outlives hedge() whatever the outcome"; execute and attempt() run in the caller).
            problem(f"{record.left_running} attempt(s) still running when the door ended")
        if any(r.end is None for r in record.raws):
            problem("a send is still in flight after the door ended")
        if any(d.start > end for d in record.dispatches):
            problem("an attempt started after the door ended")

    def check_budget(self) -> None:
        budget = self.budget
        if budget is None:
            return
        # Every retry that sends again withdraws, once; a retry never sent is refunded
        # (rfc/0001 "Application cancel", rfc/0007 section 4): for execute and the
        # hand-wired loop, a dispatch after a failed one that was not NOT_SENT; for a hedge,
        # every copy after the first that was sent and not refused (NOT_SENT) before the
        # endpoint.
        spent = 0
        dispatched = started = 0
        for record in self.records:
            plan = record.plan
            if plan.door == "hedge" and not plan.idempotent:
                continue
            started += 1
            dispatches = record.dispatches
            dispatched += bool(dispatches)
            if plan.door == "hedge":
                mine = sum(1 for d in dispatches if d.index > 0 and d.effect is not NOT_SENT)
            else:
                # a retry after an attempt that reached the server withdraws; given back
                # if its own attempt was never sent (an OPEN breaker's refusal)
                mine = sum(
                    1
                    for before, after in itertools.pairwise(dispatches)
                    if before.effect is not NOT_SENT and booked_effect(plan, after) is not NOT_SENT
                )
            spent += mine
            # Its own operations: net withdrawals as computed above; its first attempt
            # deposits, once (a hedge deposits before its first copy runs, so a hedge cut
            # that early deposited without an attempt).
            check_request_budget(
                plan.rid,
                record,
                mine,
                len(dispatches),
                self.problems,
                about=f"{plan.door}, timeout {plan.timeout}, {plan.interference}, "
                f"outcome {record.outcome} {show(record.error)}",
                sends="dispatches "
                f"{[(d.index, d.outcome, d.effect and d.effect.name) for d in dispatches]}",
            )
        check_budget_totals(
            budget,
            spent=spent,
            dispatched=dispatched,
            at_most=started,
            problems=self.problems,
            spending="retries (or hedges)",
            at_most_are="started",
        )


def booked_effect(plan: Plan, dispatch: Dispatch) -> AttemptEffect | None:
    """The effect sdkcore can book for ``dispatch``: a dispatch cut in the limiter's queue
    says so with ``dispatch_unsent()``, through the mark the door set, and ``execute``
    without a deadline sets none (rfc/0001, "Dispatch not sent"): cut in flight for it."""
    if (
        dispatch.outcome == "cancelled"
        and dispatch.effect is NOT_SENT
        and plan.door == "execute"
        and plan.timeout is None
    ):
        return MAYBE
    return dispatch.effect


@pytest.mark.parametrize("seed", SEEDS)
async def test_doors_keep_their_promises_under_random_schedules(
    seed: int, anyio_backend: str
) -> None:
    world = World(seed)
    await world.run()
    world.check()
    assert not world.problems, f"seed {seed} on {anyio_backend}:\n" + "\n".join(world.problems)
