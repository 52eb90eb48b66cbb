"""Hedged requests: the generic runner behind ``RetryOrchestrator.hedge`` (rfc/0004).

A hedge is a copy of an idempotent request sent while earlier copies are still
in flight. The first attempt goes out at once; every ``delay`` without a final
answer sends the next one, up to ``max_attempts`` (capped). The first success
wins and cancels the others. Scheduling follows gRPC A6 "Hedging Policy"; it
runs on anyio (asyncio and trio) and needs no gRPC.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import attrs

from . import _failing, _log
from ._cancel import outer_cancel_pending
from ._context import AttemptEffect, CancellationReason, describe_error
from ._duration import to_seconds
from ._errors import (
    CouchbaseException,
    InvalidArgumentException,
    RequestCanceledException,
    RetryableError,
)
from ._hooks import INSTANT_DELAYS
from ._reason import RetryReason
from ._request import Request, RequestState

if TYPE_CHECKING:
    from ._orchestrator import RetryOrchestrator

__all__ = [
    "DEFAULT_HEDGE_ATTEMPTS_CAP",
    "EVENT_HEDGE_CANCELLED",
    "EVENT_HEDGE_FAILED",
    "EVENT_HEDGE_SENT",
    "EVENT_HEDGE_WON",
    "HedgePolicy",
    "HedgeThrottler",
    "run_hedged",
]

T = TypeVar("T")

#: A6 "Limits on Retries and Hedges": the client-side cap on max_attempts.
DEFAULT_HEDGE_ATTEMPTS_CAP = 5

#: debug: hedge ``hedge`` was sent (``trigger``: first, delay, non_fatal, pushback).
EVENT_HEDGE_SENT = "hedge.sent"
#: debug: hedge ``hedge`` returned the answer; the others are cancelled.
EVENT_HEDGE_WON = "hedge.won"
#: debug: hedge ``hedge`` was cancelled (another won, a fatal failure, the deadline, the app).
EVENT_HEDGE_CANCELLED = "hedge.cancelled"
#: debug for a non-fatal failure, info for the failure that ends the chain.
EVENT_HEDGE_FAILED = "hedge.failed"


class HedgeThrottler(Protocol):
    """What the runner needs from a throttler (``sdkcore.grpc.RetryThrottler`` is one)."""

    def allows_retry(self) -> bool: ...

    def record_failure(self) -> bool: ...

    def record_success(self) -> None: ...


def _delay(value: Any) -> timedelta:
    if value is None:
        return timedelta(0)
    if isinstance(value, timedelta):
        to_seconds(value, "HedgePolicy.delay")
        return value
    return timedelta(seconds=to_seconds(value, "HedgePolicy.delay"))


def _check_attempts(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HedgePolicy.{attribute.name} must be an integer >= 1, got {value!r}")


def _non_fatal(value: Any) -> frozenset[RetryReason] | None:
    if value is None:
        return None
    if isinstance(value, RetryReason):
        raise TypeError(
            "HedgePolicy.non_fatal must be a collection of RetryReason (or None for every "
            f"reason), got the single reason {value!r}; wrap it: {{{value!r}}}"
        )
    try:
        reasons = frozenset(value)
    except TypeError:
        raise TypeError(
            f"HedgePolicy.non_fatal must be a collection of RetryReason or None, got {value!r}"
        ) from None
    bad = [r for r in reasons if type(r) is not RetryReason]
    if bad:
        raise TypeError(f"HedgePolicy.non_fatal must hold RetryReason members only, got {bad[0]!r}")
    return reasons


def _check_pushback(_: Any, __: Any, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(
            "HedgePolicy.pushback must be None or a callable (RetryableError) -> seconds | None, "
            f"got {value!r}"
        )


@attrs.frozen(slots=True)
class HedgePolicy:
    """How :meth:`RetryOrchestrator.hedge` hedges a request (A6 ``hedgingPolicy`` in core terms).

    * ``max_attempts``: copies sent at most, the first included (>= 1), capped by
      ``max_attempts_cap`` (A6 default 5).
    * ``delay``: ``timedelta`` or seconds between hedges; ``None`` or 0 sends every
      copy at once.
    * ``non_fatal``: the :class:`RetryReason` s a failed copy may report (by raising
      ``RetryableError``) without ending the chain; ``None`` (default) means every
      reason. Any other exception from ``send`` is fatal.
    * ``pushback``: optional ``(RetryableError) -> seconds | None`` reading server
      pushback from a non-fatal failure: ``None`` no pushback (the next hedge goes
      at once), ``n >= 0`` the next hedge goes after ``n`` seconds, negative: no
      more hedges (those in flight keep running).
    """

    max_attempts: int = attrs.field(validator=_check_attempts)
    delay: timedelta = attrs.field(default=None, converter=_delay)
    non_fatal: frozenset[RetryReason] | None = attrs.field(default=None, converter=_non_fatal)
    pushback: Callable[[RetryableError], float | None] | None = attrs.field(
        default=None, validator=_check_pushback, eq=False
    )
    max_attempts_cap: int = attrs.field(
        default=DEFAULT_HEDGE_ATTEMPTS_CAP, validator=_check_attempts
    )

    @property
    def effective_max_attempts(self) -> int:
        """``min(max_attempts, max_attempts_cap)``."""
        return min(self.max_attempts, self.max_attempts_cap)


# Per-attempt outcomes, as they appear in error contexts.
_IN_FLIGHT = "in_flight"
_WON = "won"
_FAILED = "failed"
_FATAL = "fatal"
_CANCELLED = "cancelled"
_DROPPED = "dropped"


class _Attempt:
    __slots__ = ("error", "index", "outcome", "reason", "started", "trigger")

    def __init__(self, index: int, trigger: str, started: float) -> None:
        self.index = index
        self.trigger = trigger
        self.started = started
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
    """One hedged request: scheduling state shared by the scheduler and the attempts."""

    __slots__ = (
        "attempts",
        "clock",
        "delay",
        "fatal",
        "first_elapsed",
        "first_scope",
        "group",
        "last_failure",
        "limit",
        "next_at",
        "next_trigger",
        "origin",
        "outstanding",
        "policy",
        "request",
        "result",
        "send",
        "stop",
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
    ) -> None:
        self.request = request
        self.clock = clock  # the backend's clock: the loop's time on asyncio
        self.send = send
        self.policy = policy
        self.throttler = throttler
        self.limit = policy.effective_max_attempts
        self.delay = 0.0 if INSTANT_DELAYS.get() else policy.delay.total_seconds()
        self.attempts: list[_Attempt] = []
        self.outstanding = 0
        self.first_elapsed = 0.0
        self.origin = clock()
        self.next_at = self.origin
        self.next_trigger = "first"
        self.stop: str | None = None  # why no more hedges are sent
        self.winner: int | None = None
        self.result: Any = None
        self.fatal: BaseException | None = None
        self.last_failure: RetryableError | None = None
        self.wake: anyio.Event | None = None  # set by every attempt that ends
        self.first_scope: anyio.CancelScope | None = None  # hedge 0 run by the caller itself
        self.group: anyio.CancelScope | None = None  # the task group's scope, once made

    def cancel(self) -> None:
        """``Request.cancel()``: cut every attempt in flight (the request is marked first)."""
        if self.first_scope is not None:
            self.first_scope.cancel()
        if self.group is not None:
            self.group.cancel()

    def cut(self) -> bool:
        """Whether the deadline or ``Request.cancel()`` cut the chain (read after winner/fatal)."""
        return (self.first_scope is not None and self.first_scope.cancel_called) or (
            self.group is not None and self.group.cancel_called
        )

    # -- scheduling ----------------------------------------------------------------
    async def schedule(self, tg: Any) -> None:
        while True:
            if self.winner is not None or self.fatal is not None:
                if self.outstanding:  # the others are cancelled now
                    tg.cancel_scope.cancel()
                    first = self.first_scope
                    if first is not None and self.attempts[0].outcome == _IN_FLIGHT:
                        first.cancel()  # hedge 0, in the caller's own task
                return
            sent = len(self.attempts)
            can_send = self.stop is None and sent < self.limit
            now = self.clock()
            if can_send and now >= self.next_at:
                throttler = self.throttler
                if sent > 0 and throttler is not None:
                    try:
                        allowed = throttler.allows_retry()
                    except Exception as exc:  # a broken throttler ends the chain with its error
                        self._end_with(exc)
                        continue
                    if not allowed:
                        # A6: the hedge is cancelled; no more hedges while throttled.
                        self.stop = "throttled"
                        continue
                self._start(tg, sent, now)
                continue
            if not can_send and self.outstanding == 0:
                return
            self.wake = anyio.Event()
            if can_send:
                with anyio.move_on_after(self.next_at - now):
                    await self.wake.wait()
            else:
                await self.wake.wait()

    def _start(self, tg: Any, index: int, now: float) -> None:
        # Hedges started at the same instant may take their first step in any order.
        tg.start_soon(self._run, self._begin(index, now))

    def _begin(self, index: int, now: float) -> _Attempt:
        """Book hedge ``index`` as sent at ``now`` (its send starts right after)."""
        attempt = _Attempt(index, self.next_trigger, now)
        self.attempts.append(attempt)
        self.outstanding += 1
        request = self.request
        if index > 0:
            request._hedge_sent()
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

    async def _run(self, attempt: _Attempt) -> None:
        try:
            result = await self.send(self.request, attempt.index)
        except RetryableError as failure:
            self.outstanding -= 1
            non_fatal = self.policy.non_fatal
            if non_fatal is None or failure.reason in non_fatal:
                self._failed(attempt, failure)
            else:
                self._fatal(attempt, failure)
        except Exception as exc:
            self.outstanding -= 1
            self._fatal(attempt, exc)
        except BaseException:
            self.outstanding -= 1
            attempt.outcome = _CANCELLED
            # cut in flight: it may have reached the server
            self._book(attempt, None, AttemptEffect.MAYBE_APPLIED, None)
            self._log_cancelled(attempt)
            raise
        else:
            self.outstanding -= 1
            self._won(attempt, result)
        finally:
            wake = self.wake
            if wake is not None:
                wake.set()

    # -- outcomes --------------------------------------------------------------------
    def _book(
        self,
        attempt: _Attempt,
        reason: RetryReason | None,
        effect: AttemptEffect,
        error: BaseException | None,
    ) -> None:
        self.request._attempt_failed(reason, effect, error, self.clock(), started=attempt.started)

    def _over(self) -> bool:
        return self.winner is not None or self.fatal is not None

    def _won(self, attempt: _Attempt, result: Any) -> None:
        if self._over():  # finished in the same step as the winner: dropped
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
                elapsed_ms=round((self.clock() - self.origin) * 1000.0, 3),
            )

    def _failed(self, attempt: _Attempt, failure: RetryableError) -> None:
        reason = failure.reason
        attempt.outcome = _FAILED
        attempt.reason = reason
        attempt.error = _text(failure)
        request = self.request
        effect = failure.effect or AttemptEffect.for_reason(reason)
        self._book(attempt, reason, effect, failure.__cause__ or failure)
        if self._over():
            return
        request._reason_seen(reason)
        self.last_failure = failure
        pushback = None
        hook = self.policy.pushback
        try:
            if self.throttler is not None:
                self.throttler.record_failure()
            if hook is not None:
                pushback = _pushback(hook, failure)
        except Exception as exc:  # a broken throttler or hook ends the chain with its error
            self._end_with(exc)
            return
        now = self.clock()
        if pushback is None:
            # A6: a non-fatal status sends the next hedge at once; later ones resume
            # at the delay.
            if now < self.next_at:
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

    def _fatal(self, attempt: _Attempt, error: BaseException) -> None:
        attempt.outcome = _FATAL
        attempt.error = _text(error)
        effect = AttemptEffect.MAYBE_APPLIED
        cause: BaseException = error
        if isinstance(error, RetryableError):
            attempt.reason = error.reason
            effect = error.effect or AttemptEffect.for_reason(error.reason)
            cause = error.__cause__ or error
        self._book(attempt, attempt.reason, effect, cause)
        if self._over():
            return
        self.fatal = error
        log = _log.enabled(_log.INFO)
        if log is not None:
            log.info(
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
        if not self._over():
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


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop when this code runs in an asyncio task, else None (trio)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop if asyncio.current_task(loop) is not None else None


async def _in_group(chain: _Chain, left: float) -> None:
    """Schedule hedges in a task group until the chain is over (A6 "Hedging Policy")."""
    async with anyio.create_task_group() as tg:
        scope = chain.group = tg.cancel_scope  # the deadline, Request.cancel(), the winner
        if left != math.inf:
            scope.deadline = chain.origin + left
        if chain.request.cancelled:  # cancelled before the group existed
            scope.cancel()
        await chain.schedule(tg)


async def _reap(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it has ended (and booked what it cut).

    A cancellation of the caller that arrives meanwhile is raised once the task
    has ended, so nothing outlives the call.
    """
    task.cancel()
    caught: BaseException | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            caught = exc
    if caught is not None:
        raise caught


async def _join(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` to end; a cancelled caller cancels it and waits for that."""
    try:
        await asyncio.wait((task,))
    except BaseException:
        await _reap(task)
        raise
    task.result()  # the helper's own failure, if any


async def _first_inline(
    chain: _Chain, loop: asyncio.AbstractEventLoop, left: float
) -> asyncio.Task[None] | None:
    """asyncio: the caller's task runs hedge 0 itself; a timer starts the hedging.

    Most requests end here: hedge 0 answers within the hedging delay, and the
    call costs one cancel scope and one timer, with no task, task group or extra
    loop iteration (bench/README, "Hedging cost"). When the delay passes with
    hedge 0 in flight, the timer starts a helper task that schedules the other
    hedges in a task group and cancels hedge 0 if another wins. Returns that
    helper (None if the delay never passed); hedge 0's outcome is in ``chain``.
    """
    helper: list[asyncio.Task[None]] = []
    scope = chain.first_scope = anyio.CancelScope()
    hedges_due = chain.limit > 1 and chain.delay < left

    def on_timer() -> None:
        if not hedges_due:  # the deadline, with hedge 0 alone in flight
            scope.cancel()
            return
        # The delay passed with hedge 0 in flight: from now on the deadline cuts it
        # too, and a helper task schedules the other hedges.
        if left != math.inf:
            scope.deadline = chain.origin + left
        helper.append(loop.create_task(_in_group(chain, left)))

    # One timer per call: the hedging delay, or the deadline when no hedge is due.
    due = chain.delay if hedges_due else left
    timer = None if due == math.inf else loop.call_at(chain.origin + due, on_timer)
    attempt = chain._begin(0, chain.origin)
    try:
        with scope:
            await chain._run(attempt)
    except BaseException as exc:
        # grpc.aio (like other libraries running calls in their own tasks) answers our
        # cut with a fresh cancellation that the scope does not take for its own.
        ours = scope.cancel_called and isinstance(exc, asyncio.CancelledError)
        if not ours or outer_cancel_pending():  # the caller was cancelled
            if timer is not None:
                timer.cancel()
            if helper:
                await _reap(helper[0])
            raise
    if timer is not None:
        timer.cancel()
    return helper[0] if helper else None


def _with_extra(exc: BaseException, chain: _Chain, *, in_flight: bool) -> None:
    if isinstance(exc, CouchbaseException) and exc.context is not None:
        extra = dict(exc.context.extra)
        extra.update(chain.extra())
        exc.context = exc.context.evolve(extra=extra, in_flight=in_flight)


async def run_hedged(
    orchestrator: RetryOrchestrator,
    request: Request,
    send: Callable[[Request, int], Awaitable[T]],
    policy: HedgePolicy,
    throttler: HedgeThrottler | None = None,
    *,
    first_elapsed: float | None = None,
) -> T:
    """The body of :meth:`RetryOrchestrator.hedge` (see there and rfc/0004).

    ``first_elapsed``: seconds the first attempt has already been in flight (a
    caller that sent it itself and hands it over once the hedging delay passed,
    as the gRPC channels do); the second hedge is then due that much sooner.
    """
    if type(request) is not Request and not isinstance(request, Request):
        raise TypeError(
            f"hedge(request, send, policy): request must be an sdkcore.Request, got {request!r}"
        )
    if not callable(send):
        raise TypeError(
            "hedge(request, send, policy): send must be a callable (request, index) -> "
            f"awaitable, got {send!r}"
        )
    if not isinstance(policy, HedgePolicy):
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
    if not request.idempotent:
        raise InvalidArgumentException(
            f"hedge(): request {request.id} ({request.name!r}) is not idempotent; hedging sends "
            "several copies at once, so only idempotent requests can be hedged "
            "(Request(idempotent=True)). Nothing was sent.",
            context=request.error_context(),
        )
    name = _failing.strategy_name(request.retry_strategy or orchestrator.default_strategy)
    left = request.deadline - request.clock()
    if left <= 0.0:  # expired before the first attempt: nothing is sent
        raise _failing.timed_out(request, request.last_reason, name, request.clock())

    loop = _asyncio_loop()
    chain = _Chain(
        request, send, policy, throttler, anyio.current_time if loop is None else loop.time
    )
    request._set_cancel_hook(chain)  # Request.cancel() cuts whatever is in flight
    try:
        try:
            helper = None
            if first_elapsed is not None:
                chain.first_elapsed = first_elapsed
            elif loop is not None and (chain.delay > 0.0 or chain.limit == 1):
                helper = await _first_inline(chain, loop, left)
                if helper is None and chain.winner is not None:  # the common case
                    request._finish(RequestState.SUCCEEDED)
                    return chain.result  # type: ignore[no-any-return]
            if helper is not None:
                await _join(helper)
            elif not (chain._over() or chain.cut() or request.cancelled):
                await _in_group(chain, left)
        finally:
            request._set_cancel_hook(None)
    except BaseException as exc:
        request._finish_by(exc)
        raise

    if chain.winner is not None:
        request._finish(RequestState.SUCCEEDED)
        return chain.result  # type: ignore[no-any-return]
    if chain.fatal is not None:
        fatal = chain.fatal
        if isinstance(fatal, RetryableError):
            request._finish(RequestState.CANCELLED, CancellationReason.NO_MORE_RETRIES)
            error: BaseException = RequestCanceledException(
                f"not hedged further: {fatal.reason.name} is not a non-fatal reason of the "
                "hedging policy",
                context=request.error_context(fatal.reason, extra=chain.extra()),
            )
            error.__cause__ = fatal.__cause__ or fatal
            raise error
        request._finish(RequestState.FAILED)
        raise fatal
    if chain.cut() or request.cancelled:  # the deadline or Request.cancel()
        if request.cancelled:  # Request.cancel()
            error = _failing.already_completed(request, request.last_reason)
        else:  # every hedge still in flight was cut and recorded as such
            error = _failing.timed_out(request, request.last_reason, name, request.clock())
        _with_extra(error, chain, in_flight=any(a.outcome == _CANCELLED for a in chain.attempts))
        raise error from _failing.cause(request)
    # Every copy failed (or no more could be sent and none is outstanding): the last
    # failure to arrive is the answer.
    last = chain.last_failure
    assert last is not None
    request._finish(RequestState.CANCELLED, CancellationReason.NO_MORE_RETRIES)
    why = {
        None: f"all {len(chain.attempts)} hedges failed",
        "throttled": "hedging throttled after the sent hedges failed",
        "pushback": "the server's pushback asked for no more hedges and the sent ones failed",
    }[chain.stop]
    error = RequestCanceledException(
        f"not hedged further: {why}; the last failure was {last.reason.name}",
        context=request.error_context(last.reason, extra=chain.extra()),
    )
    error.__cause__ = last.__cause__ or last
    raise error
