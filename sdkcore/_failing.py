"""How a request ends without an answer: the final exception and its log event.

The ending functions (:func:`timed_out`, :func:`past_deadline`, :func:`refused`,
:func:`after_backoff`, :func:`strategy_failed`, :func:`finish_by`) complete the request
through its transitions where it is not complete yet, log the event of rfc/0001 "Log
events" when its level is enabled, and return (or raise) the exception for the door;
:func:`already_completed` reports on a request that has ended already (and logs
``retry.cancelled`` for one ``Request.cancel()`` or the caller's cancellation ended). The helpers
beside them name strategies and build event fields and causes for those endings.
No waiting and no decisions: those are :mod:`sdkcore._decision` and the runtime's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from . import _log
from ._action import RetryAction
from ._context import (
    AttemptEffect,
    CancellationReason,
    ErrorContext,
    client_context_text,
    describe_error,
)
from ._decision import Verdict
from ._errors import (
    AmbiguousTimeoutException,
    CouchbaseException,
    RequestCanceledException,
    RetryableError,
    TimeoutException,
    UnambiguousTimeoutException,
)
from ._reason import RetryReason
from ._request import Request, RequestState
from ._strategy import sync_decide
from ._untrusted import show

__all__ = [
    "after_backoff",
    "already_completed",
    "answered_by",
    "asked",
    "bad_action",
    "cause",
    "event_fields",
    "finish_by",
    "give_context",
    "in_use",
    "inside_send",
    "keep_cause",
    "log_not_retried",
    "past_deadline",
    "raised_for_cut",
    "refused",
    "split_cut",
    "strategy_failed",
    "strategy_failed_on",
    "strategy_for",
    "strategy_name",
    "strategy_of",
    "timed_out",
]

_MAYBE = AttemptEffect.MAYBE_APPLIED


def strategy_name(strategy: object) -> str:
    """A strategy as events and contexts name it: its class name.

    None stands for RFC 0049's controlled backoff (always-retry reasons).
    """
    return "controlled_backoff" if strategy is None else type(strategy).__name__


def asked(strategy: object) -> str:
    """The strategy's method a door called for its answer (:func:`sync_decide`'s rule):
    ``decide`` or ``retry_after``. For error messages only."""
    return "retry_after" if sync_decide(strategy) is None else "decide"


def strategy_for(request: Request, default: Any) -> Any:
    """The strategy that answers for ``request``: its own, else ``default`` (the
    orchestrator's). Not ``or``: a strategy may be falsy (an empty table of reasons)."""
    strategy = request.retry_strategy
    return default if strategy is None else strategy


def strategy_of(request: Request, default: object = None) -> str | None:
    """The name of the strategy that answers for ``request``: its own, else ``default``
    (the orchestrator's); None when it has neither (a gRPC call's own request)."""
    strategy = strategy_for(request, default)
    return None if strategy is None else strategy_name(strategy)


def answered_by(reason: RetryReason, strategy: object) -> str:
    """What decided a retry for ``reason``: the controlled backoff for an always-retry
    reason (its strategy is not consulted), else ``strategy``, by :func:`strategy_name`."""
    return strategy_name(None if reason.always_retry else strategy)


def event_fields(
    request: Request, reason: RetryReason | None, strategy: str | None
) -> dict[str, Any]:
    """The fields every retry.* event carries (built only when the level is enabled).

    ``attempt`` is the 1-based number of the attempt the event is about: the one
    that failed (scheduled, not_retried, strategy_failed) or the last one sent
    (timed_out; 0 if none was). ``client_context`` is there when the request has one
    (bounded text, sdkcore's own keys left out: :func:`client_context_text`).
    """
    attempts = request.failed_attempts
    fields: dict[str, Any] = {
        "request_id": request.id,
        "request_name": request.name,
        "reason": None if reason is None else reason.name,
        "attempt": attempts,
        "idempotent": request.idempotent,
        "strategy": strategy,
        "caused_by": describe_error(request.last_error) if attempts else None,
    }
    if request.client_context:  # what the application attached (a key, an endpoint)
        shown = client_context_text(request.client_context)
        if shown:
            fields["client_context"] = dict(shown)
    outer = request._deadline_from
    if outer is not None:  # made inside another request's send, bounded by its deadline
        fields["deadline_from"] = outer[0]  # that request's id: the two joined without traces
    trace = request._trace
    if trace is not None:  # telemetry on: the event joins the request's trace
        ids = trace.ids()
        if ids is not None:
            fields["trace_id"], fields["span_id"] = ids
    return fields


def raised_for_cut(error: BaseException) -> BaseException | None:
    """The cancellation a RetryableError was raised while handling (its ``__context__``):
    a ``send`` that turned a cancellation into a retryable failure. Else None."""
    if not isinstance(error, RetryableError):
        return None
    cut = error.__context__
    return None if cut is None or isinstance(cut, Exception) else cut


def split_cut(cut: BaseException) -> tuple[BaseException, BaseException] | None:
    """``(errors, cancellation)`` of a group holding a cancellation beside the errors a
    ``send`` running a nursery or task group raised for its cut ("connection reset"):
    trio's ``BaseExceptionGroup([Cancelled, ...])``. None for anything else."""
    split = None if isinstance(cut, Exception) else getattr(cut, "split", None)
    if split is None:  # not a group (3.10: the backport's groups have split too)
        return None
    errors, cancellation = split(Exception)
    if errors is None or cancellation is None:
        return None
    return errors, cancellation


def cause(request: Request) -> BaseException | None:
    """The ``__cause__`` of a final exception: the last attempt's failure, never a cancellation."""
    error = request.last_error
    return error if isinstance(error, Exception) else None


def past_deadline(
    request: Request, reason: RetryReason, default: object, now: float
) -> TimeoutException:
    """The timeout of a request whose attempt failed with a retryable ``reason`` at or past
    its deadline (``now``): no time is left for a retry, so the strategy is not asked and
    no retry is booked or logged, on every door. The attempt is booked already with what
    it said of itself (a NOT_SENT one leaves the timeout unambiguous). Raise it from
    :func:`cause`."""
    return timed_out(request, reason, strategy_of(request, default), now)


def after_backoff(
    request: Request, verdict: Verdict, reason: RetryReason, strategy: object
) -> None:
    """After a booked retry's backoff, raise what ends the request instead of sending it
    again: ``Request.cancel()`` during the backoff, or a backoff capped at the deadline
    (TIME_OUT, RFC 0049 "Capping the Retry Duration"). Returns when it is to be sent."""
    if request.state is not RequestState.PENDING:
        raise already_completed(request, request.last_reason) from cause(request)
    if verdict is Verdict.TIME_OUT:
        raise timed_out(
            request, request.last_reason, answered_by(reason, strategy), request.clock()
        ) from cause(request)


def already_completed(
    request: Request,
    reason: RetryReason | None,
    *,
    cut: bool = False,
    answered: bool = False,
    copies: bool = False,
    before: Before | None = None,
) -> BaseException:
    """The error for a door asked to go on with a completed (e.g. cancelled) request.

    For a request ended by ``Request.cancel()``: ``cut``, the cancellation cut the
    attempt in flight; ``answered``, the attempt in flight answered after it and its
    answer is dropped. Either way that attempt is booked as maybe applied, and the
    message says whether the request may have been applied. ``copies``: what was cut is
    a hedge's copies, booked by its chain (``cut`` says whether any was in flight), and
    ``before`` the failure before them (the chain's: a cut copy may be booked with an
    error or a reason of its own). Logs ``retry.cancelled``.
    """
    if request.state is not RequestState.CANCELLED:
        return RuntimeError(
            f"request {request.id} ({request.name!r}) has already {request.state.value}; "
            f"it cannot be sent again. Context: {request.error_context(reason)}"
        )
    if request.cancellation_reason is CancellationReason.TIMEOUT:
        # Asked again after its timeout (a loop whose `except TimeoutError` caught
        # sdkcore's own): the timeout again, never "cancelled", with what it may have done.
        ambiguous = request._ambiguous
        cls = AmbiguousTimeoutException if ambiguous else UnambiguousTimeoutException
        return cls(
            f"request timed out already {_history(request, False)}; {_applied(request)}",
            context=request.error_context(reason),
        )
    via_context = request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    text = "request was cancelled"
    previous: _Previous | None = None
    if via_context:
        if copies and cut:
            # A hedge's copies, booked by its chain: the event is about them, as below.
            previous = (*(before or _NOTHING_BEFORE), _COPIES)
            reason = None
        if (cut or answered) and request.in_flight:
            # The attempt the cancellation cut (or whose answer it dropped) is what the
            # event and the context report, not the failure before it (previous_*).
            previous = (request.last_reason, request.last_error, _ANSWERED if answered else _CUT)
            reason = None
            request._attempt_failed(None, _MAYBE, None, request.clock())
            number = request.failed_attempts
            text += (
                f" with attempt {number} in flight"
                if cut
                else f" as attempt {number} answered; its answer was dropped"
            )
        text += f"; {_applied(request)}"
        _log_cancelled(request, reason, cut, CancellationReason.CANCELLED_VIA_CONTEXT, previous)
    return RequestCanceledException(text, context=request.error_context(reason, in_flight=cut))


def in_use(request: Request, door: str) -> RuntimeError:
    """The refusal of a door handed a request another call is already sending: a request
    is one operation, and two loops over it would send it twice (a write too)."""
    attempts = request.failed_attempts + (1 if request.in_flight else 0)
    if request._sending:
        by = "another call"
    elif request._in_block:
        by = "an attempt() block still open (not left yet)"
    else:
        by = "a hand-wired loop (attempt(), maybe_retry()), which sent it already"
    return RuntimeError(
        f"{door}: request {request.id} ({request.name!r}) is already being sent by {by} "
        f"({attempts} attempt(s) so far); one door sends a Request: build one per operation"
    )


def inside_send(request: Request) -> RuntimeError:
    """The refusal of ``maybe_retry`` called inside the ``send`` of ``execute`` or
    ``hedge``: their loop books the failure, and would book a second retry for it."""
    return RuntimeError(
        f"maybe_retry(request, reason): request {request.id} ({request.name!r}) is being "
        "sent by execute or hedge, whose loop books its failures: raise a RetryableError "
        "from send instead (the door decides and retries it)"
    )


def finish_by(
    request: Request, exc: BaseException, cut: bool | None = None, before: Before | None = None
) -> None:
    """``request`` ends with ``exc``, what its caller gets: FAILED for an error. The
    caller's own cancellation (its task's, a cancel scope's; a KeyboardInterrupt) ends it
    CANCELLED (TASK_CANCELLED): an attempt it cut in flight is booked maybe applied, as
    ``Request.cancel()`` books one, and ``retry.cancelled`` is logged (info when a request
    that is not idempotent may have been applied, or when the cancellation came at the
    deadline it inherited: :func:`_log_cancelled`). Nothing happens to a request that has
    already ended (a timeout, ``Request.cancel()``). ``cut``: a door that booked what it
    cut itself (a hedge's copies) says whether it cut any in flight, and ``before`` the
    failure before them."""
    if request.state is not RequestState.PENDING:
        # Request.cancel() came first, then the caller's own cancellation: reported here
        # (booked and logged) when it cut an attempt in flight (a thread's interrupt), or
        # for a hedge, which books its copies itself (``cut`` given: a gRPC hedged call's
        # cancel() does both; the chain's end, which also logs, is not reached).
        if (
            not isinstance(exc, Exception)
            and request.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
            and (cut is not None or request.in_flight)
        ):
            already_completed(
                request,
                request.last_reason,
                cut=True if cut is None else cut,
                copies=cut is not None,
                before=before,
            )
        return
    if isinstance(exc, Exception):
        request._finish_by(exc)
        return
    previous: _Previous | None = None
    reason = request.last_reason
    if cut is None:
        cut = request.in_flight
        if cut:
            previous = (reason, request.last_error, _CUT)
            reason = None  # the cut attempt's: it raised nothing of its own
            request._attempt_failed(None, _MAYBE, None, request.clock())
    elif cut:  # a hedge's copies, booked by its chain: the event is about them
        previous = (*(before or _NOTHING_BEFORE), _COPIES)
        reason = None
    request._finish_by(exc)
    if request.cancellation_reason is CancellationReason.TASK_CANCELLED:
        _log_cancelled(request, reason, cut, CancellationReason.TASK_CANCELLED, previous)


def _applied(request: Request) -> str:
    """What a request that ended without an answer may have done on the server."""
    if request._ambiguous:
        return "it may have been applied on the server (ambiguous)"
    if request.maybe_applied:  # idempotent: applying it again changes nothing
        return (
            "it may have reached the server, but it is idempotent, so it is safe to retry "
            "(unambiguous)"
        )
    return "it was not applied on the server (unambiguous)"


#: How close to its inherited deadline a request's cancellation counts as that deadline's
#: cut (seconds: the outer request's timer and this request's clock are read apart).
_AT_DEADLINE = 0.001

#: The failure before what a cancellation cut: (its reason, its error, what was cut:
#: ``_CUT`` an attempt in flight, ``_ANSWERED`` one whose answer came after and was
#: dropped, ``_COPIES`` a hedge's copies in flight).
_Previous = tuple[RetryReason | None, BaseException | None, str]
_CUT = "cut"
_ANSWERED = "answered"
_COPIES = "copies"


#: The failure before a hedge's copies cut in flight, as its chain knows it (reason, error;
#: ``_Chain.before_cut``): not the request's last booking (a cut copy may be booked with
#: an error, or a reason, of its own).
Before = tuple[RetryReason | None, BaseException | None]
_NOTHING_BEFORE: Before = (None, None)


def _log_cancelled(
    request: Request,
    reason: RetryReason | None,
    cut: bool,
    why: CancellationReason,
    previous: _Previous | None = None,
) -> None:
    """``retry.cancelled``: info when a request that is not idempotent may have been
    applied (the operator must know), else debug (the application asked for it). ``why``:
    ``Request.cancel()`` (CANCELLED_VIA_CONTEXT) or the caller's own (TASK_CANCELLED).
    ``previous``: the attempt in flight was cut (or answered after it): ``caused_by``
    says so, and the failure before it is ``previous_reason``/``previous_error``, as
    ``retry.timed_out`` reports an attempt its deadline cut."""
    ambiguous = request._ambiguous
    # The caller's cancellation at the deadline this request inherited is the outer
    # request's deadline cutting it: its timeout in all but name, and the outer's own
    # event names only "attempt N was cut in flight". Info, so the failures that used the
    # time (reason, caused_by) reach an operator's log (an operator's review).
    reached = (
        why is CancellationReason.TASK_CANCELLED
        and request._deadline_from is not None
        and request.deadline - request.clock() <= _AT_DEADLINE
    )
    log = _log.enabled(_log.INFO if ambiguous or reached else _log.DEBUG)
    if log is None:
        return
    # the strategy that decided its retries: its own, or the orchestrator's a door resolved
    # at its first failure (Request._resolved_by); none asked yet: null
    memo = request._memo
    fields = event_fields(request, reason, strategy_of(request, None if memo is None else memo[1]))
    if reached:
        fields["deadline_reached"] = True
    if previous is not None:
        before, error, what = previous
        number = request.failed_attempts
        if what is _ANSWERED:
            cause = (
                f"attempt {number} answered after the request was cancelled; its answer was dropped"
            )
        elif what is _COPIES:
            cause = "the hedge's copies in flight were cut by the cancellation"
        else:
            cause = f"attempt {number} was cut in flight by the cancellation"
        fields["caused_by"] = cause
        fields["previous_reason"] = None if before is None else before.name
        fields["previous_error"] = None if error is None else describe_error(error)
    (log.info if ambiguous or reached else log.debug)(
        _log.EVENT_CANCELLED,
        **fields,
        cancellation_reason=why.name,
        in_flight=cut,
        **_outcome_fields(request),
    )


def _outcome_fields(request: Request) -> dict[str, Any]:
    """What the events of a request that ended without an answer (``retry.timed_out``,
    ``retry.cancelled``, ``retry.not_retried``) say of its effect on the server and its time."""
    effect = request.last_effect
    timeout = request.timeout
    return {
        "ambiguous": request._ambiguous,
        "maybe_applied": request.maybe_applied,
        "effect": None if effect is None else effect.name,
        "timeout_ms": None if timeout is None else round(timeout.total_seconds() * 1000.0, 3),
        "elapsed_ms": round(request.elapsed.total_seconds() * 1000.0, 3),
    }


def give_context(request: Request, error: CouchbaseException) -> None:
    """The request's error context on ``error``, a ``CouchbaseException`` that ``send``
    raised as the request's final answer (README, "When things fail"): none yet, or one a
    mapper built for this request (its ``extra`` kept), becomes the request's, with every
    attempt. A context made for another request (an inner request's error) stays."""
    old = error.context
    if old is None or old.request_id == request.id:
        error.context = request.error_context(
            request.last_reason, extra=None if old is None else old.extra
        )


def log_not_retried(
    request: Request, reason: RetryReason, strategy: str, why: str, **fields: Any
) -> None:
    """``retry.not_retried`` (info) for a request that has just ended not retried, with
    ``why`` and ``fields`` (``detail``, ``budget``) beside the common ones."""
    log = _log.enabled(_log.INFO)
    if log is not None:
        cancellation = request.cancellation_reason
        payload = event_fields(request, reason, strategy)
        payload["why"] = why
        payload["cancellation_reason"] = None if cancellation is None else cancellation.name
        payload.update(_outcome_fields(request))
        payload.update(fields)  # a hedge names the copy that decided (attempt, effect, caused_by)
        log.info(_log.EVENT_NOT_RETRIED, **payload)


def timed_out(
    request: Request,
    reason: RetryReason | None,
    strategy: str | None,
    now: float,
    *,
    in_flight: bool = False,
    error: BaseException | None = None,
    hint: tuple[float, float] | None = None,
    copies_cut: int = 0,
    before: Before | None = None,
) -> TimeoutException:
    """Complete ``request`` as timed out; the exception to raise.

    ``in_flight``: an attempt was cut at the deadline (recorded as maybe applied;
    ``error`` is what it raised, unless that was the cancellation itself). The cut
    attempt is what the event, the context and the message report: its reason is
    ``error``'s when that is a :class:`RetryableError`, else None, and its cause
    ``error`` or the cut itself. ``reason`` (the doors pass ``request.last_reason``, an
    earlier attempt's) is not blamed for it: the event keeps the earlier failure as
    ``previous_reason`` and ``previous_error``.
    ``hint``: (the server's retry-after, the seconds left) when the request times
    out at once because the server asked for a wait past its deadline.
    ``copies_cut``: a hedged request's copies cut in flight at the deadline, booked
    already by the hedge runner (each maybe applied): reported as in flight.
    """
    request._time_out()
    log = _log.enabled(_log.INFO)
    previous: tuple[RetryReason | None, str | None] | None = None
    if copies_cut:
        # The copies cut are what the event and the context report (booked already by
        # the hedge runner), the failure before them as previous_* (as for retry.cancelled).
        in_flight = True
        if log is not None:
            reason_before, error_before = before or _NOTHING_BEFORE
            previous = (reason_before, describe_error(error_before))
        reason = None
    elif in_flight:
        if log is not None:  # the failure before the cut, read before the cut is booked
            previous = (request.last_reason, describe_error(request.last_error))
        reason = error.reason if isinstance(error, RetryableError) else None
        request._attempt_failed(reason, _MAYBE, error, now)
    ambiguous = request._ambiguous
    if log is not None:
        fields = event_fields(request, reason, strategy)  # caused_by: the last failure
        if copies_cut:
            fields["caused_by"] = f"{copies_cut} hedge(s) were cut in flight at the deadline"
        elif in_flight:  # the cut attempt's: what it raised, or the cut itself
            fields["caused_by"] = (
                f"attempt {request.failed_attempts} was cut in flight at the deadline"
                if error is None
                else describe_error(error)
            )
        if hint is not None:
            fields["retry_after_ms"] = round(hint[0] * 1000.0, 3)
            who = None if reason is None else _HINTED_BY.get(reason)
            fields["hinted_by"] = "server" if who is None else who[1]
        fields["in_flight"] = in_flight
        fields.update(_outcome_fields(request))
        if previous is not None:
            fields["previous_reason"] = None if previous[0] is None else previous[0].name
            fields["previous_error"] = previous[1]
        log.info(_log.EVENT_TIMED_OUT, **fields)
    context = request.error_context(reason, strategy=strategy, in_flight=in_flight)
    cls = AmbiguousTimeoutException if ambiguous else UnambiguousTimeoutException
    what = _applied(request)
    history = _history(request, in_flight, copies_cut)
    if hint is not None:
        wait, left = hint
        return cls(
            f"request timed out {history}: the next attempt may go only in {wait:.3f} s "
            f"(retry_after from {_hint_source(request, reason)}), past the deadline "
            f"({max(left, 0.0):.3f} s left), so it was not retried; {what}",
            context=context,
        )
    # the classes' own messages ("request timed out; <what>"), with the history
    return cls(f"request timed out {history}; {what}", context=context)


def _history(request: Request, in_flight: bool, copies_cut: int = 0) -> str:
    """``after 9 retries (last: AUTHENTICATION_ERROR)``, and the attempt (or a hedged
    request's copies) cut in flight."""
    retries = request.retry_attempts
    text = f"after {retries} {'retry' if retries == 1 else 'retries'}"
    last = request.last_reason
    if last is not None:
        if request._has_unsent_retry():  # RFC 0049 counts a retry when it is booked
            text += f" (last: {last.name}; the last retry was due past the deadline, not sent)"
        else:
            text += f" (last: {last.name})"
    if copies_cut:
        # "retries" here are the hedge's copies after the first (RFC 0049's count), which
        # the metrics count apart (sdkcore.hedges, not sdkcore.request.retries): said so
        text += (
            f", {copies_cut} hedge(s) in flight at the deadline (each copy after the first "
            "counts as a retry)"
        )
    elif in_flight:
        text += f", attempt {request.failed_attempts} in flight at the deadline"
    return text


def _hint_source(request: Request, reason: RetryReason | None) -> str:
    """Who asked for the wait: a circuit breaker (quoting its refusal, which names it) or
    the server."""
    hinted = None if reason is None else _HINTED_BY.get(reason)
    if hinted is not None:
        who = hinted[0]
        error = request.last_error
        if isinstance(error, RetryableError):
            said = error._message
        else:
            said = error.args[0] if error is not None and error.args else ""
        return f"the {who}: {said!r}" if said else f"a {who}"
    return "the server"


#: The local refusals whose retry_after is the client's own, not the server's.
#: (in a message, as ``retry.timed_out``'s ``hinted_by`` field: ``server`` for the others)
_HINTED_BY = {
    RetryReason.CIRCUIT_BREAKER_OPEN: ("circuit breaker", "circuit_breaker"),
    RetryReason.CONCURRENCY_LIMITED: ("concurrency limiter", "concurrency_limiter"),
    RetryReason.CLIENT_THROTTLED: ("client-side throttle", "client_throttle"),
}


def refused(
    request: Request,
    reason: RetryReason,
    verdict: Verdict,
    action: RetryAction | None,
    strategy: str,
    max_requests_in_retry: int,
    budget: Any = None,
    method: str = "retry_after",
    decided: dict[str, Any] | None = None,
) -> BaseException:
    """Complete ``request`` as not retried (REFUSED, NOT_IDEMPOTENT, TOO_MANY, BUDGET_EXHAUSTED).

    ``method``: the strategy's method that answered (:func:`asked`), named when the
    exception factory of its refusal fails. ``decided``: ``attempt``, ``effect`` and
    ``caused_by`` of the attempt that decided, when it is not the one booked last (a
    hedge's copy)."""
    if verdict is Verdict.TOO_MANY:
        why = CancellationReason.TOO_MANY_REQUESTS_IN_RETRY
    elif verdict is Verdict.BUDGET_EXHAUSTED:
        why = CancellationReason.RETRY_BUDGET_EXHAUSTED
    else:
        why = CancellationReason.NO_MORE_RETRIES
    if not request._finish(RequestState.CANCELLED, why):
        # Request.cancel() from another thread since the door's last look: the
        # cancellation is the answer, reported (and logged) as every other door's is.
        return already_completed(request, reason)
    budget_name = getattr(budget, "name", None) if verdict is Verdict.BUDGET_EXHAUSTED else None
    log_not_retried(
        request,
        reason,
        strategy,
        verdict.value,
        detail=None if action is None else action.why,
        **({} if budget_name is None else {"budget": budget_name}),
        **({} if decided is None else decided),
        **({"max_requests_in_retry": max_requests_in_retry} if verdict is Verdict.TOO_MANY else {}),
    )
    extra: dict[str, Any] | None = None
    if action is not None and action.why is not None:
        extra = {"detail": action.why}  # the strategy's own reason for refusing
    if budget_name is not None:
        extra = {**(extra or {}), "budget": budget_name}
    context = request.error_context(reason, strategy=strategy, extra=extra)
    if verdict is Verdict.TOO_MANY:
        return RequestCanceledException(
            f"not retried: the orchestrator's limit of {max_requests_in_retry} requests "
            f"waiting in retry at once is reached (max_requests_in_retry; after "
            f"{reason.name})",
            context=context,
        )
    if verdict is Verdict.BUDGET_EXHAUSTED:
        balance = getattr(budget, "balance", None)
        which = "" if budget_name is None else f" {budget_name!r}"
        return RequestCanceledException(
            f"not retried: the retry budget{which} is exhausted (balance {balance}) after "
            f"{reason.name}; too many requests are failing at once to retry them all",
            context=context,
        )
    if action is not None and action.exception is not None:
        built = _built(action.exception, context, f"{strategy}.{method}", reason)
        if verdict is Verdict.NOT_IDEMPOTENT and request.maybe_applied:
            # The strategy's own exception wins (RFC 0049), but its message may say the
            # opposite ("document locked"): its reader learns the write may be there.
            _note(
                built, f"sdkcore: {_not_idempotent(request, reason, None)}", "sdkcore: not retried"
            )
        return built
    if verdict is Verdict.NOT_IDEMPOTENT:
        return RequestCanceledException(_not_idempotent(request, reason, action), context=context)
    detail = "" if action is None or action.why is None else f": {action.why}"
    return RequestCanceledException(
        f"not retried: {strategy} declined to retry after {reason.name}{detail}",
        context=context,
    )


def _built(
    factory: Callable[[ErrorContext], object],
    context: ErrorContext,
    answered: str,
    reason: RetryReason,
) -> BaseException:
    """What a refusal's exception factory built: an exception instance, or a TypeError
    naming the strategy's method that ``answered`` (``Name.decide``) and the factory
    (``raise`` would say only "exceptions must derive from BaseException")."""
    name = getattr(factory, "__qualname__", None) or repr(factory)
    try:
        built = factory(context)
    except Exception as exc:  # (a CouchbaseException subclass whose __init__ takes no context=)
        error = TypeError(
            f"{answered}(request, {reason!r}) refused with "
            f"RetryAction.no_retry(exception={name}), and calling it with the request's "
            f"ErrorContext raised {type(exc).__name__}: {show(exc)}; the factory must return an "
            "exception instance, e.g. lambda context: MyException(context=context)"
        )
        error.__cause__ = exc
        return error
    if isinstance(built, BaseException):
        return built
    return TypeError(
        f"{answered}(request, {reason!r}) refused with "
        f"RetryAction.no_retry(exception={name}), and that factory returned {show(built)} "
        f"({type(built).__name__}) instead of an exception; the factory is called with the "
        "request's ErrorContext and must return an exception instance, e.g. "
        "lambda context: MyException(context=context); or pass a CouchbaseException "
        "subclass itself: RetryAction.no_retry(exception=MyException)"
    )


def _not_idempotent(request: Request, reason: RetryReason, action: RetryAction | None) -> str:
    """Why a non-idempotent request is not sent again: its effect, or its reason's flag."""
    effect = request.last_effect
    asked = (
        "; the strategy asked for a retry, which could apply it twice"
        if action is not None and action.seconds is not None
        else "; sending it again could apply it twice"
    )
    if request.maybe_applied:
        return (
            f"not retried: the request is not idempotent and may have been applied on the "
            f"server (reason {reason.name}, effect "
            f"{'MAYBE_APPLIED' if effect is None else effect.name}){asked}"
        )
    if effect is AttemptEffect.NOT_SENT or effect is AttemptEffect.NOT_APPLIED:
        # Known not applied: the reason's RFC flag refuses alone (rfc/0001, "Which wins").
        # Said so, or an operator reconciles a write that never happened.
        return (
            f"not retried: the request is not idempotent, and reason {reason.name} does not "
            f"allow retrying a non-idempotent request (RFC 0049); its last attempt was "
            f"recorded {effect.name}, so it was not applied; mark the request idempotent=True "
            "if sending it again is safe"
        )
    return (
        f"not retried: the request is not idempotent and may have reached the server "
        f"(reason {reason.name} does not allow retrying a non-idempotent request){asked}"
    )


_NOTE = "sdkcore: raised by the retry strategy"


def strategy_failed(
    request: Request,
    reason: RetryReason,
    strategy: str,
    error: BaseException,
    *,
    raised: bool = True,
) -> None:
    """The strategy raised ``error`` (``raised``), or answered with something that is not
    a RetryAction (``error``: sdkcore's TypeError saying so, :func:`bad_action`).

    The error propagates to the caller unchanged; on Python 3.11+ one the strategy raised
    carries a note (``add_note``, shown under its traceback) naming the strategy and the
    request, so that a ``ZeroDivisionError`` out of ``execute`` says where it came from.
    """
    request._finish(RequestState.FAILED)
    if raised:
        note = f"{_NOTE} {strategy} deciding on {strategy_failed_on(request, reason)}"
        _note(error, note, _NOTE)  # one exception object raised again: its latest request only
    log = _log.enabled(_log.WARNING)
    if log is not None:
        log.warning(
            _log.EVENT_STRATEGY_FAILED,
            **event_fields(request, reason, strategy),
            error=describe_error(error),
            **_outcome_fields(request),  # a write that may have been applied says so here too
        )


def strategy_failed_on(request: Request, reason: RetryReason) -> str:
    """The request a strategy failed on, and what that did to it (for its error's text)."""
    applied = (
        " (not idempotent, and an attempt may have been applied)" if request._ambiguous else ""
    )
    who = f"request {request.id} ({request.name!r})"
    return f"{who} after {reason.name}; the request failed{applied}"


def _note(error: BaseException, note: str, kind: str) -> None:
    """``error.add_note(note)`` on Python 3.11+ (before: nothing; an exception class whose
    notes cannot be set: nothing). An exception object raised again (a factory that returns
    one shared instance) keeps one note of a ``kind`` (its start), the latest."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        with contextlib.suppress(Exception):
            notes = getattr(error, "__notes__", None)
            if isinstance(notes, list) and notes and str(notes[-1]).startswith(kind):
                notes[-1] = note
            else:
                add_note(note)


def bad_action(strategy: str, reason: RetryReason, action: object, method: str) -> TypeError:
    """A strategy's answer that is not a RetryAction; ``method``: :func:`asked`."""
    return TypeError(
        f"{strategy}.{method}(request, {reason!r}) returned {action!r} "
        f"({type(action).__name__}); a RetryStrategy must return a RetryAction: "
        "RetryAction.with_duration(delay) or RetryAction.no_retry()"
    )


def keep_cause(exc: BaseException, failure: BaseException | None) -> None:
    """A final exception without a cause gets the attempt's failure as its ``__cause__``
    (also one a strategy's exception factory built: rfc/0001, "Final exception's cause")."""
    if exc.__cause__ is None and failure is not None and exc is not failure:
        exc.__cause__ = failure
