"""Hedged requests: the generic runner behind ``RetryOrchestrator.hedge`` (rfc/0004).

A hedge is a copy of an idempotent request sent while earlier copies are still
in flight. The first attempt goes out at once; every ``delay`` without a final
answer sends the next one, up to ``max_attempts`` (capped). The first success
wins and cancels the others. Scheduling follows gRPC A6 "Hedging Policy" and
needs no gRPC.

This module decides (the chain: what is sent when, what each outcome means, the
final answer); the event loop's own tasks run the copies, through the runtime
layer's ``Hedges`` (:mod:`sdkcore._runtime`, one per backend).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _failing, _log, _runtime
from ._action import RetryAction
from ._context import AttemptEffect, CancellationReason, describe_error
from ._decision import Verdict, spends_budget
from ._errors import (
    CouchbaseException,
    InvalidArgumentException,
    RequestCanceledException,
    RetryableError,
    final_effect,
    sent_nothing,
)
from ._hooks import INSTANT_DELAYS
from ._log import EVENT_HEDGE_CANCELLED, EVENT_HEDGE_FAILED, EVENT_HEDGE_SENT, EVENT_HEDGE_WON
from ._reason import RetryReason
from ._request import Request, RequestState
from ._strategy import sync_decide

if TYPE_CHECKING:
    from ._core import OrchestratorCore, RetryBudgetLike
    from ._hedge_policy import HedgePolicy, HedgeThrottler

__all__ = [
    "EVENT_HEDGE_CANCELLED",
    "EVENT_HEDGE_FAILED",
    "EVENT_HEDGE_SENT",
    "EVENT_HEDGE_WON",
    "answered_before_hedge",
    "check_hedge",
    "run_hedged",
]

T = TypeVar("T")


def _copy_of(request: Request, failure: RetryableError) -> dict[str, Any]:
    """``attempt``, ``effect`` and ``caused_by`` of the copy booked with ``failure``: the
    event about the copy that decided names it, not the copy booked last (a sibling cut
    after it, which may raise an error of its own as it is cut; reviews). Empty when it
    is not found (the request's own then stand)."""
    error = failure.__cause__ or failure
    history = request._history
    for number in range(len(history), 0, -1):  # the latest booking of it: the one that decided
        reason, effect, booked, _, _ = history[number - 1]
        if booked is error and reason is not None:  # (a cut sibling's booking has none)
            return {
                "attempt": number,
                "effect": effect.name,
                "caused_by": describe_error(error),
            }
    return {}


def answered_before_hedge(elapsed: float, delay: float) -> float:
    """The latency a learned delay records for an answer read before the next copy went
    out (rfc/0009, "Answered before the hedge went out"): ``elapsed`` when shorter than
    ``delay``, else just under ``delay``. Such an answer cost no extra load; past the
    delay, it is only later than the delay because the loop read it before it ran the
    hedge's timer, or the task that sends the hedge."""
    return elapsed if elapsed < delay else math.nextafter(delay, 0.0)


# Per-attempt outcomes, as they appear in error contexts.
_IN_FLIGHT = "in_flight"
_WON = "won"
_FAILED = "failed"
_FATAL = "fatal"
_CANCELLED = "cancelled"  # cut in flight: booked maybe applied
_NOT_SENT = "not_sent"  # cut before anything was sent (its task not begun, a limiter's queue)
_DROPPED = "dropped"


class _Attempt:
    __slots__ = ("begun", "error", "index", "outcome", "reason", "started", "trigger")

    def __init__(self, index: int, trigger: str, started: float) -> None:
        self.index = index
        self.trigger = trigger
        self.started = started
        self.begun = False  # its run() began: send may have been called
        self.outcome = _IN_FLIGHT
        self.reason: RetryReason | None = None
        self.error = ""

    def as_dict(self, origin: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "trigger": self.trigger,
            "sent_at_ms": round((self.started - origin) * 1000.0, 3),
            "outcome": self.outcome,
        }
        if self.reason is not None:
            out["reason"] = self.reason.name
        if self.error:
            out["error"] = self.error
        return out


class _Chain:
    """One hedged request: what is sent when, and what each copy's outcome means.

    It never waits and starts no task: the runtime's ``Hedges`` runs the copies
    (:meth:`run`) as the event loop's tasks, asks :meth:`send_due` what to send
    whenever something changed, cuts the losers once :attr:`over`, and sets
    :attr:`cut` when the deadline or ``Request.cancel()`` cut the chain.
    """

    __slots__ = (
        "_cut",
        "_cut_before",
        "asked",
        "attempts",
        "budget",
        "callers_cut",
        "clock",
        "cutting",
        "deadline",
        "decide",
        "delay",
        "fatal",
        "first_elapsed",
        "last_failure",
        "latency",
        "limit",
        "next_at",
        "next_trigger",
        "origin",
        "outstanding",
        "policy",
        "refusal",
        "request",
        "result",
        "send",
        "stop",
        "strategy",
        "throttler",
        "wake",
        "winner",
    )

    def __init__(
        self,
        request: Request,
        send: Callable[[Request, int], Awaitable[Any]],
        policy: HedgePolicy,
        throttler: HedgeThrottler | None,
        clock: Callable[[], float],
        budget: RetryBudgetLike | None = None,
        strategy: object = None,
    ) -> None:
        self.request = request
        #: The request's strategy, asked whether a non-fatal failure may be hedged past
        #: (:meth:`_answer`); None: the policy's ``non_fatal`` alone decides.
        self.strategy = strategy
        self.decide = None if strategy is None else sync_decide(strategy)
        self.refusal: RetryAction | None = None  # the strategy's no_retry that ended the chain
        #: The strategy's method that gave the last answer (:meth:`_answer`), for errors.
        self.asked = "decide"
        self.budget = budget  # the orchestrator's retry budget: every hedge after the first
        self.clock = clock  # the event loop's clock
        self.send = send
        self.policy = policy
        self.throttler = throttler
        self.limit = policy.effective_max_attempts
        # A LatencyQuantile's delay is math.inf before min_samples: no hedge for latency.
        delay = policy.delay.total_seconds()
        self.delay = 0.0 if INSTANT_DELAYS.get() and delay != math.inf else delay
        self.latency = policy.latency  # learns the delay from each copy's latency (rfc/0009)
        self.attempts: list[_Attempt] = []
        self.outstanding = 0  # copies sent and not ended
        self.first_elapsed = 0.0
        self.origin = clock()
        self.next_at = self.origin
        self.next_trigger = "first"
        self.stop: str | None = None  # why no more hedges are sent
        self.winner: int | None = None
        self.result: Any = None
        self.fatal: BaseException | None = None
        self.last_failure: RetryableError | None = None
        self._cut = False  # the deadline or Request.cancel() cut the chain (:attr:`cut`)
        self._cut_before: _failing.Before | None = None
        self.deadline = math.inf  # the request's, on ``clock`` (set by run_hedged)
        #: Whether copy ``index`` is being cut now (set by the runner, asked in the copy's
        #: task): an error its send raises then is how it ended being cut (:meth:`run`).
        self.cutting: Callable[[int], bool] | None = None
        #: Whether the caller's own cancellation is reaching copy ``index`` in the caller's
        #: task (asyncio's hedge 0; set by the runner): a cut its send turned into a
        #: RetryableError is then the caller's (:meth:`run`).
        self.callers_cut: Callable[[int], bool] | None = None
        self.wake: Callable[[], None] | None = None  # called by every copy that ends

    @property
    def over(self) -> bool:
        """A copy won, or a failure (or a broken hook) ended the chain: cut the others."""
        return self.winner is not None or self.fatal is not None

    # -- scheduling (A6 "Hedging Policy") ---------------------------------------------
    def next_due(self) -> float:
        """When the next hedge is due on the clock (``math.inf``: no more will be sent)."""
        if self.over or self.stop is not None or len(self.attempts) >= self.limit:
            return math.inf
        return self.next_at

    def send_due(self, start: Callable[[_Attempt], object]) -> float:
        """Book every hedge due now and hand each to ``start``; then :meth:`next_due`.

        Hedge 0 always goes; a later one only while the throttler allows it (once it
        does not, no more are sent: A6 "the hedged request is cancelled") and the
        orchestrator's retry budget pays for it (likewise).
        """
        while True:
            when = self.next_due()
            if when == math.inf:
                return when
            now = self.clock()
            if now < when:
                return when
            sent = len(self.attempts)
            if sent > 0:
                throttler, budget = self.throttler, self.budget
                if throttler is not None and not self._lets(throttler.allows_retry, "throttled"):
                    return math.inf
                # a hedge is a retry: the budget pays for it
                if budget is not None and not self._lets(budget.try_withdraw, "retry_budget"):
                    return math.inf
            start(self.begin(sent, now))

    def _lets(self, hook: Callable[[], bool], stop: str) -> bool:
        """Whether ``hook`` (the throttler's, the budget's) lets the next hedge go. No:
        no more are sent (``stop`` says why); a hook that raises ends the chain with its
        error instead."""
        try:
            allowed = hook()
        except Exception as exc:
            self._end_with(exc)
            return False
        if not allowed:
            self.stop = stop
        return bool(allowed)

    def begin(self, index: int, now: float) -> _Attempt:
        """Book hedge ``index`` as sent at ``now`` (its :meth:`run` starts right after)."""
        attempt = _Attempt(index, self.next_trigger, now)
        self.attempts.append(attempt)
        self.outstanding += 1
        request = self.request
        if index > 0:
            request._hedge_sent()
            trace = request._trace
            if trace is not None:
                trace.hedge_booked()
        self.next_at = now + self.delay - (self.first_elapsed if index == 0 else 0.0)
        self.next_trigger = "delay"
        log = _log.enabled(_log.DEBUG)
        if log is not None:
            log.debug(
                EVENT_HEDGE_SENT,
                request_id=request.id,
                request_name=request.name,
                hedge=index,
                trigger=attempt.trigger,
                max_attempts=self.limit,
            )
        return attempt

    async def run(self, attempt: _Attempt) -> None:
        """Send one copy and book its outcome. Raises only the copy's cancellation."""
        attempt.begun = True
        if self.over or self.cut or self.stop == "pushback":
            # Booked before the answer that ended the chain (or the cut, or a "don't retry"
            # pushback, after which A6 sends no hedge), and begun after it (trio starts
            # every task it was given, cancelled or not): not sent.
            self.skip(attempt)
            return
        trace = self.request._trace
        if trace is not None and attempt.index > 0 and trace.owns_span:
            # Counted here, where the copy is really sent: a copy booked and then cut before
            # its task ran (the winner answered in the same turn) is not a hedge sent. A door
            # that adopted the request's span (a gRPC call) counts the copies it makes.
            trace.hedge_sent()
        mark = self.request._dispatching()  # requests made inside send keep within its deadline
        pending = None
        try:
            pending = self.send(self.request, attempt.index)
            result = await pending
        except RetryableError as failure:
            self.outstanding -= 1
            cut = _failing.raised_for_cut(failure)  # send turned a cancellation into it
            if cut is not None:
                if self.over or self._being_cut(attempt):
                    # The copy's own cut (a send that turns it into SOCKET_CLOSED_WHILE_IN_
                    # FLIGHT): a cut copy, as a plain error below; the cut ends the chain (the
                    # timeout, Request.cancel()'s error), whatever the reason or the strategy
                    # would say, as execute gives the timeout for it.
                    self._book_converted_cut(attempt, mark, failure)
                    return
                if self.callers_cut is not None and self.callers_cut(attempt.index):
                    # Hedge 0 in the caller's task (asyncio) turned the caller's own
                    # cancellation into this: the caller's cancellation, never retried (as
                    # execute's; rfc/0001). The runner cuts every copy and re-raises it.
                    self._book_converted_cut(attempt, mark, failure)
                    raise cut from None
            non_fatal = self.policy.non_fatal
            if non_fatal is None or failure.reason in non_fatal:
                self._failed(attempt, failure)  # unless the strategy refuses to go past it
            else:
                self._fatal(attempt, failure)
        except Exception as exc:
            self.outstanding -= 1
            if self.over or self._being_cut(attempt):
                # Raised as the copy was being cut (another copy's answer, Request.cancel(),
                # the deadline, the caller's cancellation reaching a copy): a send whose read
                # is cut may raise its own error ("connection reset") for the cancellation.
                # It ended cut, its error kept as its failure (rfc/0004, "A cut copy that
                # raises its own error").
                self._cut_copy(attempt, mark, exc)
                return
            if isinstance(exc, TypeError) and not (
                pending is None or hasattr(pending, "__await__")
            ):
                exc = TypeError(
                    f"hedge(request, send, policy): send returned {type(pending).__name__}, "
                    "not an awaitable; make it a coroutine function (async def send(request, "
                    "index): ...)"
                )
            self._fatal(attempt, exc)
        except BaseException as cut:
            self.outstanding -= 1
            parts = _failing.split_cut(cut)  # a nursery's errors beside the cut (trio's group)
            self._cut_copy(attempt, mark, cut if parts is None else parts[0])
            if parts is None:
                raise
            # Only the cancellation: the runner's scope takes it back, where the errors
            # would escape it and replace the winner's answer.
            raise parts[1] from None
        else:
            self.outstanding -= 1
            latency = self.latency
            if latency is not None:
                latency.record(self._learned(attempt))
            self._won(attempt, result)
        finally:
            self.request._dispatched_done(mark)
            wake = self.wake
            if wake is not None:
                wake()

    def _book_converted_cut(self, attempt: _Attempt, mark: Any, failure: RetryableError) -> None:
        """``failure`` was raised while handling ``attempt``'s cut (its ``__context__``, as
        ``execute`` tells it): booked as cut in flight, its error kept (a copy that says it
        sent nothing, ``NOT_SENT``, booked so). As ``execute``, whose deadline gives the
        timeout for it whatever its reason (rfc/0004, "A cut copy that raises its own error")."""
        if sent_nothing(failure):
            attempt.outcome = _NOT_SENT
            self._book(attempt, failure.reason, AttemptEffect.NOT_SENT, failure)
            self._log_cancelled(attempt)
            return
        self._cut_copy(attempt, mark, failure)

    def _being_cut(self, attempt: _Attempt) -> bool:
        """Whether ``attempt`` is being cut: ``Request.cancel()`` or the deadline cut the
        chain, or the caller's cancellation is reaching the copy."""
        cutting = self.cutting
        return (
            self.cut
            or self.clock() >= self.deadline
            or (cutting is not None and cutting(attempt.index))
        )

    def _cut_copy(self, attempt: _Attempt, mark: Any, cut: BaseException) -> None:
        """``attempt`` was cut in flight, ending with ``cut`` (the cancellation, or what
        ``send`` raised for it): it may have reached the server, unless it was cut where
        nothing is sent yet (a limiter's queue): then not sent, its budget withdrawal
        refunded. An error ``send`` raised for it is kept as its failure."""
        unsent = Request._dispatch_was_unsent(mark, cut)
        latency = self.latency
        if latency is not None and self.winner is not None and not unsent:
            # superseded: as Finagle, but known only to be longer (a first copy cut at
            # delay + the hedge's latency is not placed there: LatencyQuantile.record)
            latency.record(self._elapsed(attempt), cut=True)
        attempt.outcome = _NOT_SENT if unsent else _CANCELLED
        effect = AttemptEffect.NOT_SENT if unsent else AttemptEffect.MAYBE_APPLIED
        reason = Request._dispatch_unsent_reason(mark) if unsent else None
        self._book(attempt, reason, effect, cut if isinstance(cut, Exception) else None)
        self._log_cancelled(attempt)

    def _allows(self, failure: RetryableError) -> bool:
        """Whether the request's strategy lets the chain go past ``failure`` (a non-fatal
        reason): False when it refuses to retry the reason (e.g. a terminal error under
        FastFailOnTerminalErrorRetryStrategy), kept in :attr:`refusal` for the final
        error. An always-retry reason is not asked (RFC 0049's controlled backoff). A
        strategy that raises, or answers with something that is not a RetryAction, ends
        the chain with its error."""
        reason = failure.reason
        if self.strategy is None or reason.always_retry or self.over:
            return True
        name = _failing.strategy_name(self.strategy)
        try:
            action = self._answer(reason)
        except Exception as exc:  # the chain ends with the strategy's error (logged)
            _failing.strategy_failed(self.request, reason, name, exc)
            self._end_with(exc)
            return True  # booked as a failure; the chain is over
        if action is _UNASKED:  # it waits for I/O: not asked (see _answer)
            return True
        if not isinstance(action, RetryAction):  # sdkcore's error, naming the strategy
            error = _failing.bad_action(name, reason, action, self.asked)
            _failing.strategy_failed(self.request, reason, name, error, raised=False)
            self._end_with(error)
            return True
        if action.seconds is None:
            self.refusal = action
            return False
        return True

    def _answer(self, reason: RetryReason) -> object:
        """The strategy's answer for ``reason``, when it can be had without waiting (the
        chain decides in the failed copy's turn and never waits; rfc/0004, "The
        strategy"): its synchronous ``decide`` when its ``retry_after`` is a built-in's
        (:func:`sync_decide`); else its ``retry_after``'s answer when that is a plain
        method's. A ``retry_after`` that returns an awaitable (an ``async def``) is not
        run: its coroutine is closed before its first step, so none of its code runs, and
        the strategy's synchronous ``decide``, if it has one (every built-in's subclass),
        answers instead; without one, :data:`_UNASKED`."""
        decide = self.decide
        if decide is None:
            strategy: Any = self.strategy
            self.asked = "retry_after"
            answer = strategy.retry_after(self.request, reason)
            if type(answer) is RetryAction or not _unrun(answer):
                return answer  # (not a RetryAction: the strategy's error, see _allows)
            decide = getattr(strategy, "decide", None)
            if not callable(decide):
                return _UNASKED
        self.asked = "decide"
        answer = decide(self.request, reason)
        if type(answer) is not RetryAction and _unrun(answer):  # an async decide
            return _UNASKED
        return answer

    def _elapsed(self, attempt: _Attempt) -> float:
        """Seconds since ``attempt`` was sent (hedge 0 handed over: since its own send)."""
        elapsed = self.clock() - attempt.started
        if attempt.index == 0:
            elapsed += self.first_elapsed
        return elapsed if elapsed > 0.0 else 0.0

    def _learned(self, attempt: _Attempt) -> float:
        """The latency of ``attempt``, an answer, as the learned delay takes it (rfc/0009,
        "Answered before the hedge went out").

        An answer read after the delay but before the next copy went out (the loop ran
        the answer before the hedge's timer, or before the task that sends it) counts as
        just under the delay (:func:`answered_before_hedge`).
        """
        elapsed = self._elapsed(attempt)
        delay = self.delay
        if elapsed < delay or delay <= 0.0:  # 0: instant_retries() in tests, nothing to beat
            return elapsed
        following = attempt.index + 1
        if following < len(self.attempts):  # booked: had it begun?
            after = self.attempts[following]
            unsent = after.trigger == "delay" and not after.begun
        else:  # due, and not booked yet (a refusal by the budget or throttler sets stop)
            unsent = self.next_trigger == "delay" and self.stop is None and following < self.limit
        return answered_before_hedge(elapsed, delay) if unsent else elapsed

    def skip(self, attempt: _Attempt) -> None:
        """A copy whose task began but will not send (the chain is over or cut, or its
        task began cancelled: ``_runtime._trio``): booked as not sent, and the runner
        woken to see it ended."""
        self.unsent(attempt)
        wake = self.wake
        if wake is not None:
            wake()

    @property
    def cut(self) -> bool:
        """The deadline or ``Request.cancel()`` cut the chain (set by the runner). The
        failure before it is taken then (:meth:`before_cut`): a copy may still answer
        with a failure as it winds down, which came after the cut."""
        return self._cut

    @cut.setter
    def cut(self, value: bool) -> None:
        if value and not self._cut:
            self._cut_before = self._before()
        self._cut = value

    def before_cut(self) -> _failing.Before:
        """The failure before the copies cut in flight (reason, error as booked): as it
        stood when the deadline or ``Request.cancel()`` cut the chain, else the fatal
        failure that ended the chain and cut them, else the last copy failure the chain
        went past, else none. Not the request's last booking: a cut copy may be booked
        with an error, or a reason, of its own."""
        before = self._cut_before
        return self._before() if before is None else before

    def _before(self) -> _failing.Before:
        fatal = self.fatal
        if isinstance(fatal, RetryableError):
            return (fatal.reason, fatal.__cause__ or fatal)
        if fatal is not None:
            return (None, fatal)
        failure = self.last_failure
        if failure is None:
            return (None, None)
        return (failure.reason, failure.__cause__ or failure)

    def copies_cut(self) -> int:
        """The copies cut in flight (booked maybe applied; not the ones cut unsent)."""
        return sum(1 for a in self.attempts if a.outcome == _CANCELLED)

    def unsent(self, attempt: _Attempt) -> None:
        """``attempt`` was cut before its :meth:`run` began (asyncio can cancel a task
        before its first step), or began once the chain was already over: ``send`` was
        never called, so it is booked as not sent."""
        if attempt.outcome is _IN_FLIGHT:
            self.outstanding -= 1
            attempt.outcome = _NOT_SENT
            self._book(attempt, None, AttemptEffect.NOT_SENT, None)
            self._log_cancelled(attempt)

    # -- outcomes --------------------------------------------------------------------
    def _book(
        self,
        attempt: _Attempt,
        reason: RetryReason | None,
        effect: AttemptEffect,
        error: BaseException | None,
    ) -> None:
        self.request._attempt_failed(reason, effect, error, self.clock(), started=attempt.started)
        if attempt.index > 0 and self.budget is not None and not spends_budget(effect):
            # Nothing reached the server (an OPEN breaker refused the copy, or it was cut
            # before it began): the withdrawal it paid is given back. The rule is the
            # retry doors' (``_decision.spends_budget``: a retry that puts no load on the
            # server costs nothing), applied the other way round: a retry is paid for
            # after the attempt before it, and not at all when that one was not sent; a
            # hedge is paid for when it is booked, before anyone knows, and refunded here.
            refund = getattr(self.budget, "refund", None)
            if refund is not None:
                refund()

    def _won(self, attempt: _Attempt, result: Any) -> None:
        if self.over:  # finished in the same step as the winner: dropped
            attempt.outcome = _DROPPED
            self._log_cancelled(attempt)
            return
        attempt.outcome = _WON
        self.winner = attempt.index
        self.result = result
        if self.throttler is not None:
            try:
                self.throttler.record_success()
            except Exception as exc:  # a broken throttler fails the call with its error
                self.winner = None
                self.result = None
                self._end_with(exc)
                return
        log = _log.enabled(_log.DEBUG)
        if log is not None:
            log.debug(
                EVENT_HEDGE_WON,
                request_id=self.request.id,
                request_name=self.request.name,
                hedge=attempt.index,
                hedges_sent=len(self.attempts),
                # since the request began: hedge 0's time before the chain (a gRPC call's)
                elapsed_ms=round((self.clock() - self.origin + self.first_elapsed) * 1000.0, 3),
            )

    def _failed(self, attempt: _Attempt, failure: RetryableError) -> None:
        reason = failure.reason
        attempt.outcome = _FAILED
        attempt.reason = reason
        attempt.error = _text(failure)
        request = self.request
        effect = failure.effect or AttemptEffect.for_reason(reason)
        # Booked before the strategy is asked: it sees this copy's failure (last_error,
        # last_reason, attempts), as every other door's strategy sees the attempt's.
        self._book(attempt, reason, effect, failure.__cause__ or failure)
        if self.over:
            return
        if not self._allows(failure):
            self._fatal(attempt, failure, booked=True)
            return
        if self.over:  # the strategy failed: the chain ends with its error
            return
        request._reason_seen(reason)
        self.last_failure = failure
        pushback = None
        hook = self.policy.pushback
        try:
            if self.throttler is not None and effect is not AttemptEffect.NOT_SENT:
                # A copy refused before anything was sent (a breaker, a limiter) is no
                # failure of the server's: A6 counts none for throttling.
                self.throttler.record_failure()
            if hook is not None:
                pushback = _pushback(hook, failure)
        except Exception as exc:  # a broken throttler or hook ends the chain with its error
            self._end_with(exc)
            return
        now = self.clock()
        if pushback is None:
            # A6: a non-fatal status sends the next hedge at once; later ones resume
            # at the delay. Not before a server's pushback for it: the wait it asked for
            # stands (as grpc-java; A6 does not say which wins, rfc/0004).
            if now < self.next_at and self.next_trigger != "pushback":
                self.next_at = now
                self.next_trigger = "non_fatal"
        elif pushback < 0 or math.isnan(pushback):
            if self.stop is None:
                self.stop = "pushback"
        else:
            self.next_at = now + (0.0 if INSTANT_DELAYS.get() else float(pushback))
            self.next_trigger = "pushback"
        log = _log.enabled(_log.DEBUG)
        if log is not None:
            log.debug(
                EVENT_HEDGE_FAILED,
                request_id=request.id,
                request_name=request.name,
                hedge=attempt.index,
                reason=reason.name,
                fatal=False,
                pushback_ms=None if pushback is None else round(pushback * 1000.0, 3),
                error=attempt.error,
            )

    def _fatal(self, attempt: _Attempt, error: BaseException, *, booked: bool = False) -> None:
        """``attempt`` failed with ``error`` and ends the chain (``booked``: the request
        has it already, :meth:`_failed` booked it before the strategy refused)."""
        attempt.outcome = _FATAL
        attempt.error = _text(error)
        effect = final_effect(error, self.request.id)
        cause: BaseException = error
        if isinstance(error, RetryableError):
            attempt.reason = error.reason
            effect = error.effect or AttemptEffect.for_reason(error.reason)
            cause = error.__cause__ or error
        if not booked:
            self._book(attempt, attempt.reason, effect, cause)
        if self.over:
            return
        self.fatal = error
        # debug, as a non-fatal one: how the request ended is the door's event at info
        # (retry.not_retried for a reason the policy does not hedge past), and an answer
        # such as "not found" is logged by no door (rfc/0004, "Log events")
        log = _log.enabled(_log.DEBUG)
        if log is not None:
            log.debug(
                EVENT_HEDGE_FAILED,
                request_id=self.request.id,
                request_name=self.request.name,
                hedge=attempt.index,
                reason=None if attempt.reason is None else attempt.reason.name,
                fatal=True,
                error=attempt.error,
            )

    def _end_with(self, error: BaseException) -> None:
        """A hook of the chain (throttler, pushback) failed: the call fails with its error."""
        if not self.over:
            self.fatal = error

    def _log_cancelled(self, attempt: _Attempt) -> None:
        log = _log.enabled(_log.DEBUG)
        if log is not None:
            log.debug(
                EVENT_HEDGE_CANCELLED,
                request_id=self.request.id,
                request_name=self.request.name,
                hedge=attempt.index,
                winner=self.winner,
            )

    def extra(self) -> dict[str, Any]:
        return {
            "hedge_winner": self.winner,
            "hedges_sent": len(self.attempts),
            "hedge_max_attempts": self.limit,
            "hedge_stopped_by": self.stop,
            "hedges": [a.as_dict(self.origin) for a in self.attempts],
        }


#: :meth:`_Chain._answer` for a strategy whose answer needs a wait: it is not asked.
_UNASKED = object()

#: When every hedge sent failed, by what stopped more (``_Chain.stop``): the ``why`` of
#: ``retry.not_retried``, and the message's words (``{sent}``: the hedges sent).
_NOT_HEDGED = {
    None: ("hedges_exhausted", "all {sent} hedges failed"),
    "throttled": ("throttled", "hedging throttled after the sent hedges failed"),
    "pushback": (
        "pushback",
        "the server's pushback asked for no more hedges and the sent ones failed",
    ),
    "retry_budget": (
        "retry_budget_exhausted",
        "the retry budget{budget} refused more hedges and the sent ones failed",
    ),
}


def _unrun(answer: object) -> bool:
    """Whether a strategy's ``answer`` is an awaitable (an ``async def``'s coroutine),
    which the chain cannot wait for: closed before its first step (no code of it runs,
    no warning that it was never awaited) and True."""
    if not hasattr(answer, "__await__"):
        return False
    close = getattr(answer, "close", None)
    if close is not None:
        close()
    return True


def _text(error: BaseException) -> str:
    """A failure as hedging's events and contexts show it: bounded, and never raising."""
    if isinstance(error, RetryableError):
        text = describe_error(error) or ""
        return text.removeprefix(type(error).__name__ + ": ")
    return describe_error(error) or ""


def _pushback(
    hook: Callable[[RetryableError], float | None], failure: RetryableError
) -> float | None:
    """The pushback hook's answer, checked: None or a real number of seconds."""
    value = hook(failure)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"HedgePolicy.pushback returned {type(value).__name__}, not None or seconds "
            "(a real number; negative: no more hedges)"
        )
    return float(value)


def _timed_out(request: Request, chain: _Chain | None = None, copies_cut: int = 0) -> BaseException:
    """The hedged request's timeout; ``copies_cut``: copies cut in flight (booked)."""
    return _failing.timed_out(
        request,
        request.last_reason,
        "hedge",
        request.clock(),
        copies_cut=copies_cut,
        before=None if chain is None else chain.before_cut(),
    )


def _cancelled_after_answer(request: Request, chain: _Chain) -> BaseException:
    """The error of a request ``Request.cancel()`` ended after a copy answered, before the
    caller resumed: the cancellation, with the hedges' bookkeeping (the losers it cut)."""
    cut = chain.copies_cut()
    error = _failing.already_completed(
        request, request.last_reason, cut=cut > 0, copies=True, before=chain.before_cut()
    )
    _with_extra(error, chain, in_flight=cut > 0)
    return error


def _with_extra(exc: BaseException, chain: _Chain, *, in_flight: bool) -> None:
    if isinstance(exc, CouchbaseException) and exc.context is not None:
        extra = dict(exc.context.extra)
        extra.update(chain.extra())
        exc.context = exc.context.evolve(extra=extra, in_flight=in_flight)


def _is_policy(policy: object) -> bool:
    """Whether ``policy`` is a HedgePolicy, without importing :mod:`sdkcore._hedge_policy`.

    ``import sdkcore`` leaves that module (and :mod:`sdkcore._latency`) to the first use
    of ``sdkcore.HedgePolicy`` or ``sdkcore.LatencyQuantile`` (PEP 562): about a tenth of
    the import, paid only by an application that hedges (bench/README, "`import sdkcore`
    against `import attrs`"). No HedgePolicy can exist before its module was imported, so
    a module not imported yet means a wrong argument.
    """
    module = sys.modules.get(_POLICY_MODULE)
    return module is not None and isinstance(policy, module.HedgePolicy)


_POLICY_MODULE = f"{__package__}._hedge_policy"


def check_hedge(request: Any, send: Any, policy: Any, throttler: Any) -> None:
    """What :func:`run_hedged` refuses before anything is sent or recorded: arguments of
    the wrong kind, a completed request, a request that is not idempotent."""
    if not isinstance(request, Request):
        raise TypeError(
            f"hedge(request, send, policy): request must be an sdkcore.Request, got {request!r}"
        )
    if not callable(send):
        raise TypeError(
            "hedge(request, send, policy): send must be a callable (request, index) -> "
            f"awaitable, got {send!r}"
        )
    if not _is_policy(policy):
        raise TypeError(
            f"hedge(request, send, policy): policy must be an sdkcore.HedgePolicy, got {policy!r}"
        )
    if throttler is not None and not (
        callable(getattr(throttler, "allows_retry", None))
        and callable(getattr(throttler, "record_failure", None))
        and callable(getattr(throttler, "record_success", None))
    ):
        raise TypeError(
            "hedge(..., throttler=...) must have allows_retry(), record_failure() and "
            f"record_success() (e.g. sdkcore.grpc.RetryThrottler), got {throttler!r}"
        )
    if request.state is not RequestState.PENDING:
        raise _failing.already_completed(request, None)
    if request._being_sent():  # another call is sending it
        raise _failing.in_use(request, "hedge(request, send, policy)")
    if not request.idempotent:
        raise InvalidArgumentException(
            f"hedge(): request {request.id} ({request.name!r}) is not idempotent; hedging sends "
            "several copies at once, so only idempotent requests can be hedged "
            "(Request(idempotent=True)). Nothing was sent.",
            context=request.error_context(),
        )


async def run_hedged(
    orchestrator: OrchestratorCore,
    request: Request,
    send: Callable[[Request, int], Awaitable[T]],
    policy: HedgePolicy,
    throttler: HedgeThrottler | None = None,
    *,
    first_elapsed: float | None = None,
    finish: bool = True,
    ask_strategy: bool = True,
) -> T:
    """The body of :meth:`RetryOrchestrator.hedge` (see there and rfc/0004).

    ``first_elapsed``: seconds the first attempt has already been in flight (a
    caller that sent it itself and hands it over once the hedging delay passed,
    as the gRPC channels do); the second hedge is then due that much sooner.
    ``finish=False``: the winning copy's result may not be its final answer (a gRPC
    hedge the call committed to on its response headers, A6): the request is left
    pending for the caller to complete once the answer is in, and the caller reports
    a win by a copy other than the first (``RequestTrace.hedge_won``).
    ``ask_strategy``: a non-fatal failure is hedged past only if the request's strategy
    would retry its reason (:meth:`_Chain._allows`); False for the gRPC channels,
    where A6's ``nonFatalStatusCodes`` alone decide.
    """
    check_hedge(request, send, policy, throttler)
    left = request.deadline - request.clock()
    if left <= 0.0:  # expired before the first attempt: nothing is sent
        raise _timed_out(request)

    rt = _runtime.current()
    orchestrator._deposit(request)  # the first attempt pays into the retry budget
    strategy = (
        _failing.strategy_for(request, orchestrator.default_strategy) if ask_strategy else None
    )
    chain = _Chain(request, send, policy, throttler, rt.now, orchestrator.retry_budget, strategy)
    if first_elapsed is not None:
        chain.first_elapsed = first_elapsed
    chain.deadline = chain.origin + left
    runner = rt.Hedges(chain, chain.deadline)
    previous = request._set_cancel_hook(runner)  # Request.cancel() cuts whatever is in flight
    request._sending = True  # another door's call on it is refused meanwhile (in_use)
    try:
        try:
            await runner.run()
        finally:
            request._set_cancel_hook(previous)
            request._sending = False
    except BaseException as exc:
        # the copies it cut are booked (the chain): say whether any was in flight
        _failing.finish_by(request, exc, cut=chain.copies_cut() > 0, before=chain.before_cut())
        raise

    if chain.winner is not None:
        if not finish:
            if request.state is not RequestState.PENDING:  # Request.cancel(), as below
                raise _cancelled_after_answer(request, chain)
            return chain.result  # type: ignore[no-any-return]
        # _succeeded(): a losing copy booked with its own error for the cut lets go of
        # its traceback, as a retried request's last failure does (a reference cycle else)
        if not request._succeeded():
            # Request.cancel() came after a copy answered, before the caller resumed: a
            # cancelled request never reports success (rfc/0001, "Application cancel").
            raise _cancelled_after_answer(request, chain)
        trace = request._trace
        if trace is not None and chain.winner > 0:
            trace.hedge_won()
        return chain.result  # type: ignore[no-any-return]
    cut = chain.copies_cut()
    if request.cancelled:
        # Request.cancel(), also after a copy's final error arrived but before the caller
        # resumed: the caller gets the cancellation (rfc/0001, "Application cancel").
        error: BaseException = _failing.already_completed(
            request, request.last_reason, cut=cut > 0, copies=True, before=chain.before_cut()
        )
        _with_extra(error, chain, in_flight=cut > 0)
        raise error from _failing.cause(request)
    if chain.fatal is not None:
        fatal = chain.fatal
        if isinstance(fatal, RetryableError) and chain.refusal is not None:
            # The strategy refuses to retry the reason (a terminal error): its exception.
            error = _failing.refused(
                request,
                fatal.reason,
                Verdict.REFUSED,
                chain.refusal,
                _failing.strategy_name(strategy),
                max_requests_in_retry=0,  # named only in a TOO_MANY refusal
                method=chain.asked,
                decided=_copy_of(request, fatal),
            )
            _with_extra(error, chain, in_flight=cut > 0)
            raise error from fatal.__cause__ or fatal
        if isinstance(fatal, RetryableError):
            request._finish(RequestState.CANCELLED, CancellationReason.NO_MORE_RETRIES)
            why = f"{fatal.reason.name} is not a non-fatal reason of the hedging policy"
            decided = _copy_of(request, fatal)
            _failing.log_not_retried(
                request, fatal.reason, "hedge", "fatal_reason", detail=why, **decided
            )
            error = RequestCanceledException(
                f"not hedged further: {why}",
                context=request.error_context(fatal.reason, extra=chain.extra()),
            )
            error.__cause__ = fatal.__cause__ or fatal
            raise error
        if isinstance(fatal, CouchbaseException):
            _failing.give_context(request, fatal)  # as execute's (README, "When things fail")
        request._finish(RequestState.FAILED)
        raise fatal
    if chain.cut:  # the deadline: every hedge still in flight was cut and recorded as such
        error = _timed_out(request, chain, cut)
        _with_extra(error, chain, in_flight=cut > 0)
        raise error from _failing.cause(request)
    # Every copy failed (or no more could be sent and none is outstanding): the last
    # failure to arrive is the answer.
    last = chain.last_failure
    assert last is not None
    request._finish(
        RequestState.CANCELLED,
        CancellationReason.RETRY_BUDGET_EXHAUSTED
        if chain.stop == "retry_budget"
        else CancellationReason.NO_MORE_RETRIES,
    )
    event_why, why = _NOT_HEDGED[chain.stop]
    fields: dict[str, Any] = {}
    extra = chain.extra()
    budget_name = getattr(chain.budget, "name", None) if chain.stop == "retry_budget" else None
    if budget_name is not None:  # which budget, as execute's refusal names it
        fields["budget"] = extra["budget"] = budget_name
    why = why.format(
        sent=len(chain.attempts), budget="" if not budget_name else f" {budget_name!r}"
    )
    _failing.log_not_retried(request, last.reason, "hedge", event_why, detail=why, **fields)
    error = RequestCanceledException(
        f"not hedged further: {why}; the last failure was {last.reason.name}",
        context=request.error_context(last.reason, extra=extra),
    )
    error.__cause__ = last.__cause__ or last
    raise error
