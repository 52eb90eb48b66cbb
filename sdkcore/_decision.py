"""The one retry rule: what happens after a failed attempt (RFC 0049, "Retry Orchestration").

:func:`decide` is pure: it reads the request's state, the reason, the strategy's
action and the time, and returns a :class:`Decision`. It does no I/O, no logging and
no waiting; the doors (``execute``, ``execute_sync``, ``maybe_retry``, the gRPC
channels) carry it out. Every rule of the RFC's orchestration lives here, checked in
this order (the first that applies decides):

1. The effect: a request that is not idempotent is never sent again once an attempt
   may have been applied (``maybe_applied``: the attempt's effect, what actually
   happened), whatever the reason's flags, always-retry included (rfc/0001, "Which
   wins: the effect or the flag").
2. Always-retry reasons (RFC "RetryReason", ``always_retry``) retry with the
   controlled backoff; the strategy is not consulted, and rules 3 and 4 are skipped.
3. The flag: a request that is not idempotent is never sent again after a reason
   that does not allow retrying it (RFC "Network Time"), whatever the strategy said.
4. A strategy's refusal ends the request (its exception, or NO_MORE_RETRIES).
5. Backpressure: at ``max_requests_in_retry`` requests waiting, no more retries.
6. Server hints: the wait is at least what the server asked for
   (``RetryableError(retry_after=...)``, HTTP Retry-After, gRPC pushback); while time
   is left, a hint that ends at or past the deadline times the request out at once,
   naming the hint (rfc/0007). With no time left, rule 7 decides.
7. Capping (RFC "Capping the Retry Duration"): a wait that reaches the deadline
   waits only until the deadline, and the request then times out (at once when no
   time is left).

The retry budget is the one rule with state, and :func:`spends_budget` its one test
(a retry costs the budget only when it puts load on the server): the retry doors
withdraw only when :func:`decide` says RETRY and the failed attempt before it
:func:`spends_budget`; ``hedge`` withdraws for each copy after the first when it goes
out, and refunds a copy whose own effect does not :func:`spends_budget` (rfc/0004).
"""

from __future__ import annotations

import enum

from ._action import RetryAction
from ._backoff import CONTROLLED_STEPS, controlled_backoff
from ._context import AttemptEffect
from ._reason import RetryReason

__all__ = ["CONTROLLED_SECONDS", "Decision", "Verdict", "decide", "spends_budget"]

#: RFC 0049 "Controlled Backoff" in seconds, by retry count (the last one repeats).
CONTROLLED_SECONDS = tuple(
    controlled_backoff(n).total_seconds() for n in range(CONTROLLED_STEPS + 1)
)


class Verdict(enum.Enum):
    """What the door does with a failed attempt."""

    #: Wait the delay, then send again.
    RETRY = "retry"
    #: The backoff reaches the deadline: wait until the deadline, then time out.
    TIME_OUT = "time_out"
    #: The server asked for a wait (``RetryableError(retry_after=...)``) that ends past
    #: the deadline: time out at once, naming the hint, instead of sleeping until then.
    #: Only while time is left: past the deadline it is TIME_OUT, whatever the hint.
    HINT_PAST_DEADLINE = "hint_past_deadline"
    #: The strategy declined: fail with its exception, or NO_MORE_RETRIES.
    REFUSED = "strategy_declined"
    #: Not idempotent, and an attempt may have been applied (its effect) or the reason
    #: does not allow a retry (its RFC flag): never sent again.
    NOT_IDEMPOTENT = "not_idempotent"
    #: ``max_requests_in_retry`` requests are already waiting in retry.
    TOO_MANY = "too_many_requests_in_retry"
    #: The retry budget refused the withdrawal (see :func:`spends_budget`).
    BUDGET_EXHAUSTED = "retry_budget_exhausted"


#: A decision: the verdict and the seconds to wait first (RETRY, TIME_OUT; else 0).
Decision = tuple[Verdict, float]

_RETRY = Verdict.RETRY


def decide(
    reason: RetryReason,
    action: RetryAction | None,
    retry_attempts: int,
    idempotent: bool,
    time_left: float,
    requests_in_retry: int,
    max_requests_in_retry: int,
    hint: float | None = None,
    maybe_applied: bool = False,
) -> Decision:
    """Decide what follows an attempt that failed for ``reason``.

    ``action``: the strategy's answer (None for an always-retry reason, whose
    strategy is not consulted). ``retry_attempts``: the retries before this one;
    ``time_left``: seconds until the request's deadline (``math.inf`` for none);
    ``requests_in_retry``: how many requests wait in retry now; ``hint``: the
    seconds the server asked to wait at least (``RetryableError.retry_after``);
    ``maybe_applied``: some attempt of the request may have been applied on the
    server (:attr:`AttemptEffect.MAYBE_APPLIED`, the request's ``maybe_applied``).

    A plain tuple, not an object: this runs once per retry, and building a frozen
    attrs instance cost 0.3 us of the 2 us a retry costs (bench/README, "bench_doors.py").
    """
    if maybe_applied and not idempotent:
        # What happened wins over what the reason usually means: sending it again
        # could apply it twice (an UNAVAILABLE answered by a server, a cut write).
        return Verdict.NOT_IDEMPOTENT, 0.0
    if reason.always_retry:
        last = CONTROLLED_STEPS  # the index of the delay that repeats
        delay = CONTROLLED_SECONDS[retry_attempts if retry_attempts < last else last]
    else:
        assert action is not None
        if not (idempotent or reason.allows_non_idempotent_retry):
            # Whatever the strategy said, a retry could apply the request twice.
            return Verdict.NOT_IDEMPOTENT, 0.0
        seconds = action.seconds
        if seconds is None:
            return Verdict.REFUSED, 0.0
        delay = seconds
    if requests_in_retry >= max_requests_in_retry:
        return Verdict.TOO_MANY, 0.0
    if hint is not None:
        # The hint is blamed only when it is what pushes past the deadline: with no time
        # left (a hint of 0 included) the request simply timed out (TIME_OUT, below).
        if time_left > 0.0 and hint >= time_left:
            return Verdict.HINT_PAST_DEADLINE, 0.0
        if hint > delay:
            delay = hint
    if delay >= time_left:
        return Verdict.TIME_OUT, time_left if time_left > 0.0 else 0.0
    return _RETRY, delay


def spends_budget(effect: AttemptEffect | None) -> bool:
    """Whether a retry after an attempt with ``effect`` withdraws from a retry budget.

    Only a retry after an attempt that reached the server spends: a breaker that
    refused the dispatch, a socket or node not available, never sent anything, so
    retrying it adds no load to the server (rfc/0007). The effect, not the reason,
    decides: gRPC UNAVAILABLE answered by a server maps to SERVICE_NOT_AVAILABLE but
    reached the server (``AttemptEffect.MAYBE_APPLIED``).
    """
    return effect is not AttemptEffect.NOT_SENT
