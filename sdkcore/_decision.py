"""The one retry rule: what happens after a failed attempt (RFC 0049, "Retry Orchestration").

:func:`decide` is pure: it reads the request's state, the reason, the strategy's
action and the time, and returns a :class:`Decision`. It does no I/O, no logging and
no waiting; the doors (``execute``, ``execute_sync``, ``maybe_retry``, the gRPC
channels) carry it out. Every rule of the RFC's orchestration lives here, in order:

1. Always-retry reasons (RFC "RetryReason", ``always_retry``) retry with the
   controlled backoff; the strategy is not consulted.
2. A strategy's refusal ends the request (its exception, or NO_MORE_RETRIES).
3. A request that is not idempotent, failed for a reason that does not allow
   retrying it (it may have reached the server), is never retried, whatever the
   strategy said (RFC "Network Time").
4. Backpressure: at ``max_requests_in_retry`` requests waiting, no more retries.
5. Capping (RFC "Capping the Retry Duration"): a backoff that reaches the deadline
   waits only until the deadline, and the request then times out.
"""

from __future__ import annotations

import enum

import attrs

from ._action import RetryAction
from ._backoff import controlled_backoff
from ._reason import RetryReason

__all__ = ["CONTROLLED_SECONDS", "Decision", "Verdict", "decide"]

#: RFC 0049 "Controlled Backoff" in seconds, by retry count (the last one repeats).
CONTROLLED_SECONDS = tuple(controlled_backoff(n).total_seconds() for n in range(6))


class Verdict(enum.Enum):
    """What the door does with a failed attempt."""

    #: Wait ``delay`` seconds, then send again.
    RETRY = "retry"
    #: The backoff reaches the deadline: wait ``delay`` (until the deadline), then time out.
    TIME_OUT = "time_out"
    #: The strategy declined: fail with its exception (``action``) or NO_MORE_RETRIES.
    REFUSED = "strategy_declined"
    #: Not idempotent and may have reached the server: never retried.
    NOT_IDEMPOTENT = "not_idempotent"
    #: ``max_requests_in_retry`` requests are already waiting in retry.
    TOO_MANY = "too_many_requests_in_retry"


@attrs.frozen(slots=True)
class Decision:
    """The outcome of :func:`decide`.

    ``delay``: seconds to wait (RETRY, TIME_OUT). ``action``: the strategy's action
    (None for an always-retry reason).
    """

    verdict: Verdict
    delay: float
    action: RetryAction | None


def decide(
    reason: RetryReason,
    action: RetryAction | None,
    retry_attempts: int,
    idempotent: bool,
    time_left: float,
    requests_in_retry: int,
    max_requests_in_retry: int,
) -> Decision:
    """Decide what follows an attempt that failed for ``reason``.

    ``action``: the strategy's answer (None for an always-retry reason, whose
    strategy is not consulted). ``retry_attempts``: the retries before this one;
    ``time_left``: seconds until the request's deadline (``math.inf`` for none);
    ``requests_in_retry``: how many requests wait in retry now.
    """
    if reason.always_retry:
        delay = CONTROLLED_SECONDS[retry_attempts if retry_attempts < 5 else 5]
        action = None
    else:
        assert action is not None
        if not (idempotent or reason.allows_non_idempotent_retry):
            # Whatever the strategy said, a retry could apply the request twice.
            return Decision(Verdict.NOT_IDEMPOTENT, 0.0, action)
        seconds = action.seconds
        if seconds is None:
            return Decision(Verdict.REFUSED, 0.0, action)
        delay = seconds
    if requests_in_retry >= max_requests_in_retry:
        return Decision(Verdict.TOO_MANY, 0.0, action)
    if delay >= time_left:
        return Decision(Verdict.TIME_OUT, time_left if time_left > 0.0 else 0.0, action)
    return Decision(Verdict.RETRY, delay, action)
