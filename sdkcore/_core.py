"""What every door of the orchestrator shares: its settings and the step after a failure.

A failed attempt goes through the same three steps on every door (``execute``,
``execute_sync``, ``maybe_retry``, the gRPC channels):

1. :meth:`OrchestratorCore._ask`: the strategy's action (none for an always-retry
   reason); an async strategy's answer is awaited by the async doors;
2. :func:`sdkcore._decision.decide`: the pure rule;
3. :meth:`OrchestratorCore._settle`: book the retry on the request, count it as
   waiting in retry and log it, or complete the request and raise the final error
   (:mod:`sdkcore._failing`).

The door then waits (the runtime layer), calls :meth:`_leave_backoff`, and sends again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import _failing, _log
from ._action import RetryAction
from ._decision import Decision, Verdict, decide, spends_budget
from ._reason import RetryReason
from ._request import Request, RequestState
from ._strategy import FastFailOnTerminalErrorRetryStrategy, RetryStrategy, sync_decide
from ._untrusted import show

if TYPE_CHECKING:  # imported by the constructor, only when given a telemetry
    from ._telemetry import Telemetry

__all__ = ["DEFAULT_MAX_REQUESTS_IN_RETRY", "OrchestratorCore", "RetryBudgetLike"]

#: Per-orchestrator limit of requests waiting in retry (the Java SDK's default).
DEFAULT_MAX_REQUESTS_IN_RETRY = 32768

_MAX_COUNT = 2**31 - 1  # a limit beyond any process's memory: bigger ones are typos


class RetryBudgetLike(Protocol):
    """What the orchestrator needs of a retry budget (``sdkcore.RetryBudget`` is one).

    A budget may also have ``refund()``: called once for a withdrawal whose retry sent
    nothing (a hedge cut before it began; a backoff cut by ``Request.cancel()`` or the
    caller's cancellation; a request cancelled, or past its deadline, before the retry's
    attempt began; an attempt booked ``NOT_SENT``, an OPEN breaker's refusal).
    """

    def deposit(self) -> None: ...

    def try_withdraw(self) -> bool: ...


_RETRY = Verdict.RETRY
_TIME_OUT = Verdict.TIME_OUT


def _requested(action: Any, hint: float | None) -> dict[str, Any]:
    """What a capped retry asked for (``retry.scheduled``'s ``requested_delay_ms``): the
    strategy's delay, or the server's hint when it was longer; None for the controlled
    backoff. Built only when the event is logged."""
    seconds = action.seconds if isinstance(action, RetryAction) else None
    if hint is not None and (seconds is None or hint > seconds):
        seconds = hint
    return {"requested_delay_ms": None if seconds is None else round(seconds * 1000.0, 3)}


class OrchestratorCore:
    """The orchestrator's settings, backpressure count and per-failure step."""

    __slots__ = (
        "_budget",
        "_default",
        "_in_retry",
        "_in_retry_sync",
        "_lock",
        "_max_in_retry",
        "_sleep",
        "_sleep_clock",
        "_telemetry",
    )

    def __init__(
        self,
        default_strategy: RetryStrategy | None = None,
        *,
        max_requests_in_retry: int = DEFAULT_MAX_REQUESTS_IN_RETRY,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
        retry_budget: RetryBudgetLike | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        if default_strategy is None:
            default_strategy = FastFailOnTerminalErrorRetryStrategy()
        elif isinstance(default_strategy, type) or not callable(
            getattr(default_strategy, "retry_after", None)
        ):
            raise TypeError(
                "RetryOrchestrator(default_strategy=...) must be a RetryStrategy instance (an "
                f"object with a retry_after(request, reason) method), got {default_strategy!r}"
            )
        if not isinstance(max_requests_in_retry, int) or isinstance(max_requests_in_retry, bool):
            raise TypeError(
                "RetryOrchestrator(max_requests_in_retry=...) must be an integer >= 1 (at most "
                f"{_MAX_COUNT}), got {show(max_requests_in_retry)} "
                f"({type(max_requests_in_retry).__name__})"
            )
        if not 1 <= max_requests_in_retry <= _MAX_COUNT:
            raise ValueError(
                "RetryOrchestrator(max_requests_in_retry=...) must be an integer >= 1 (at most "
                f"{_MAX_COUNT}), got {show(max_requests_in_retry)}"
            )
        if sleep is not None and not callable(sleep):
            raise TypeError(
                f"RetryOrchestrator(sleep=...) must be an async callable (seconds), got {sleep!r}"
            )
        if retry_budget is not None and (
            isinstance(retry_budget, type)
            or not callable(getattr(retry_budget, "deposit", None))
            or not callable(getattr(retry_budget, "try_withdraw", None))
        ):
            raise TypeError(
                "RetryOrchestrator(retry_budget=...) must be an sdkcore.RetryBudget (an object "
                f"with deposit() and try_withdraw() -> bool), got {retry_budget!r}"
            )
        if telemetry is not None:
            # Here, not at import: a request never needs these modules unless the
            # application made a Telemetry (then they are loaded already).
            from ._budget import RetryBudget
            from ._telemetry import Telemetry

            if not isinstance(telemetry, Telemetry):
                raise TypeError(
                    "RetryOrchestrator(telemetry=...) must be an sdkcore.Telemetry or None, "
                    f"got {telemetry!r}"
                )
            if isinstance(retry_budget, RetryBudget):
                telemetry.watch(retry_budget)  # the budget it serves reports through it
        self._telemetry = telemetry
        self._budget = retry_budget
        self._default: RetryStrategy = default_strategy
        self._max_in_retry = max_requests_in_retry
        # Requests waiting in backoff. The async doors count on the event loop's thread
        # (no lock: 0.3 us a retry, bench/README "bench_doors.py"); execute_sync's threads count
        # under the lock, which is never held while user code runs.
        self._in_retry = 0
        self._in_retry_sync = 0
        self._lock = threading.Lock()
        self._sleep = sleep
        # A virtual clock's sleep (an object with .clock() and .sleep()): requests must
        # run on that clock, or their deadlines and the waits disagree.
        owner = getattr(sleep, "__self__", None)
        clock = getattr(owner, "clock", None)
        self._sleep_clock: Any = clock if callable(clock) else None

    @property
    def default_strategy(self) -> RetryStrategy:
        return self._default

    @property
    def telemetry(self) -> Telemetry | None:
        """The telemetry every request of this orchestrator reports to (rfc/0008)."""
        return self._telemetry

    @property
    def retry_budget(self) -> RetryBudgetLike | None:
        """The retry budget every request of this orchestrator shares (None: no budget)."""
        return self._budget

    @property
    def max_requests_in_retry(self) -> int:
        return self._max_in_retry

    @property
    def requests_in_retry(self) -> int:
        """How many requests are waiting in retry backoff right now."""
        return self._in_retry + self._in_retry_sync

    def __repr__(self) -> str:
        return (
            f"<RetryOrchestrator default_strategy={self._default!r} "
            f"requests_in_retry={self.requests_in_retry}/{self._max_in_retry}>"
        )

    # -- the step after a failed attempt -----------------------------------------------
    def _resolve(self, request: Request) -> tuple[Any, Any, Any]:
        """What the doors ask once per request (:meth:`Request._resolved_by`).

        The request's strategy; its synchronous ``decide`` when its ``retry_after``
        is a built-in's (no coroutine per retry), else None (asked through
        ``retry_after``); and the log gate (:func:`sdkcore._log.gate`): ``at(level)``
        gives the logger or None, per retry.
        """
        strategy = _failing.strategy_for(request, self._default)
        return strategy, sync_decide(strategy), _log.gate()

    def _ask(self, request: Request, reason: RetryReason, strategy: Any, decides: Any) -> Any:
        """The strategy's answer: a RetryAction, or an awaitable of one for an async strategy.

        None for an always-retry reason (the strategy is not consulted). ``strategy``
        and ``decides`` come from :meth:`_resolve`.
        """
        if reason.always_retry:
            return None
        try:
            if decides is not None:
                return decides(request, reason)
            return strategy.retry_after(request, reason)
        except Exception as exc:
            _failing.strategy_failed(request, reason, _failing.strategy_name(strategy), exc)
            raise

    def _settle(
        self,
        request: Request,
        reason: RetryReason,
        action: Any,
        strategy: Any,
        log: Any,
        failure: BaseException | None,
        hint: float | None,
        now: float,
        threads: bool = False,
    ) -> Decision:
        """Decide, then book the retry (returned) or complete the request and raise.

        ``action``: the strategy's answer (:meth:`_ask`, awaited); ``log``: the debug
        logger or None (asked once per request, :meth:`_resolve`); ``failure``: the
        attempt's failure, the ``__cause__`` of the final exception; ``hint``: the
        seconds the server asked to wait; ``now``: the request's clock when the attempt
        failed. A retry (RETRY or TIME_OUT) is counted as waiting in retry: the door
        gives it back with :meth:`_leave_backoff` once the wait is over (``threads``:
        execute_sync's count, under the lock).
        """
        if not reason.always_retry and not isinstance(action, RetryAction):
            name = _failing.strategy_name(strategy)
            error = _failing.bad_action(name, reason, action, _failing.asked(strategy))
            _failing.strategy_failed(request, reason, name, error, raised=False)
            raise error
        left = request.deadline - now
        if threads:
            verdict, delay = self._decide_on_threads(request, reason, action, left, hint)
        else:
            # The async doors' count has one writer, the loop's thread: no lock (0.3 us a
            # retry).
            verdict, delay = self._decide(request, reason, action, left, hint)
            if verdict is _RETRY or verdict is _TIME_OUT:
                self._in_retry += 1
        budget = self._budget
        if verdict is _RETRY and budget is not None and spends_budget(request.last_effect):
            try:
                # it will send again: the budget pays first (bool() here: an answer whose
                # truth raises is a broken budget too, not a count left behind)
                granted = bool(budget.try_withdraw())
            except BaseException:  # a broken budget fails the request, uncounted
                self._leave_backoff(request, threads)
                request._finish(RequestState.FAILED)
                raise
            if not granted:
                self._leave_backoff(request, threads)
                verdict = Verdict.BUDGET_EXHAUSTED
            elif hasattr(budget, "refund"):
                # Paid for the attempt this retry sends: one that comes back NOT_SENT (an
                # OPEN breaker's refusal) is refunded when booked (RetryState._attempt_failed).
                request._paid = budget
        if verdict is not _RETRY and verdict is not _TIME_OUT:
            if request.state is not RequestState.PENDING:
                # Request.cancel() (from another thread) while the strategy decided: the
                # cancellation is the answer, not the strategy's refusal.
                raise _failing.already_completed(request, reason) from _failing.cause(request)
            raise self._refusal(request, reason, verdict, action, strategy, failure, hint, left)
        request._retry_booked(reason, delay)
        trace = request._trace
        try:
            if trace is not None:
                trace.retry(reason, delay)
            if log is not None:
                log.debug(
                    _log.EVENT_SCHEDULED,
                    **_failing.event_fields(
                        request, reason, _failing.answered_by(reason, strategy)
                    ),
                    delay_ms=round(delay * 1000.0, 3),
                    capped=verdict is _TIME_OUT,
                    **({} if verdict is not _TIME_OUT else _requested(action, hint)),
                )
        except BaseException:  # an interrupt in a log handler or an instrument: not sent
            self._leave_backoff(request, threads)
            self._refund_unsent(request)
            raise
        return verdict, delay

    def _decide_on_threads(
        self,
        request: Request,
        reason: RetryReason,
        action: Any,
        left: float,
        hint: float | None,
    ) -> Decision:
        """:func:`decide` for ``execute_sync``: the capacity check and the count of requests
        in retry move together under the lock, which is never held while user code runs.
        ``with``: an interrupt between an ``acquire()`` and its ``try`` left it held. The
        same call as :meth:`_settle`'s for the loop's thread, which takes no lock."""
        with self._lock:
            verdict, delay = self._decide(request, reason, action, left, hint)
            if verdict is _RETRY or verdict is _TIME_OUT:
                self._in_retry_sync += 1
                request._counted = True  # with the count: _leave_backoff gives it back once
        return verdict, delay

    def _decide(
        self,
        request: Request,
        reason: RetryReason,
        action: Any,
        left: float,
        hint: float | None,
    ) -> Decision:
        """:func:`decide` on this request and this orchestrator's count of requests in retry."""
        return decide(
            reason,
            action,
            request.retry_attempts,
            request.idempotent,
            left,
            self._in_retry + self._in_retry_sync,
            self._max_in_retry,
            hint,
            request.maybe_applied,
        )

    def _refund_unsent(self, request: Request) -> None:
        """A retry that :meth:`_settle` booked is not sent (its backoff was cut, or the
        request completed meanwhile): the retry budget gets back what it paid for it.
        Once: what was paid is ``request._paid`` until its attempt is booked, answers, or
        is refunded; an attempt begun (in flight, not booked) went out: not refunded."""
        paid = request._paid
        if paid is not None and not request._in_flight:
            request._paid = None  # refunded here: its attempt never comes
            paid.refund()

    def _refusal(
        self,
        request: Request,
        reason: RetryReason,
        verdict: Verdict,
        action: Any,
        strategy: Any,
        failure: BaseException | None,
        hint: float | None,
        left: float,
    ) -> BaseException:
        """The final exception for a verdict that ends the request (the request completes)."""
        name = _failing.answered_by(reason, strategy)
        exc: BaseException
        if verdict is Verdict.HINT_PAST_DEADLINE:
            assert hint is not None
            exc = _failing.timed_out(request, reason, name, request.clock(), hint=(hint, left))
        else:
            exc = _failing.refused(
                request,
                reason,
                verdict,
                action,
                name,
                self._max_in_retry,
                self._budget,
                _failing.asked(strategy),
            )
        _failing.keep_cause(exc, failure)
        return exc

    def _deposit(self, request: Request) -> None:
        """A request's first attempt pays into the retry budget (once per request).

        A budget whose ``deposit`` raises fails the request (FAILED) with its error,
        before anything was sent or armed.
        """
        if self._budget is not None and request._first_dispatch():
            try:
                self._budget.deposit()
            except BaseException:
                request._finish(RequestState.FAILED)
                raise

    def _leave_backoff(self, request: Request, threads: bool = False) -> None:
        """``request``, counted by :meth:`_settle`, stopped waiting in retry (``threads``:
        in execute_sync's count, given back once: ``request._counted``)."""
        if threads:
            with self._lock:
                if request._counted:
                    request._counted = False
                    self._in_retry_sync -= 1
        else:
            self._in_retry -= 1

    def _check_clock(self, request: Request) -> None:
        """The backoff and the request's deadline must run on one clock, or the deadline is
        never met (a real wait for a virtual deadline: retried until the end of real time)
        or met at once (a virtual wait for a real one). Refused, naming both, and the
        request fails. Only a clock marked ``sdkcore_virtual`` (a ``VirtualClock``) counts
        as virtual; an inherited deadline is not checked (rfc/0005, "VirtualClock")."""
        if request._timeout_s == math.inf:
            return
        if self._sleep_clock is not None:
            if request.clock is not time.monotonic:
                return
            request._finish(RequestState.FAILED)
            raise ValueError(
                f"RetryOrchestrator(sleep={self._sleep!r}) waits on a virtual clock, but "
                f"request {request.id} ({request.name!r}) runs on {request.clock!r}: build "
                "the request with Request(clock=<the same clock>.clock) so its deadline "
                "follows the waits"
            )
        owner = getattr(request.clock, "__self__", None)
        if self._sleep is None and getattr(owner, "sdkcore_virtual", False) is True:
            request._finish(RequestState.FAILED)
            raise ValueError(
                f"request {request.id} ({request.name!r}) runs on the virtual clock "
                f"{request.clock!r}, but RetryOrchestrator() waits on the event loop's clock, "
                "which never moves it: pass the clock's sleep, "
                "RetryOrchestrator(sleep=<the clock>.sleep)"
            )
