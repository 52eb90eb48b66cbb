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
from ._request import Request

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
    (None for an always-retry reason). ``strategy``: who decided, for logs and
    contexts (``"controlled_backoff"`` for an always-retry reason).
    """

    verdict: Verdict
    delay: float
    action: RetryAction | None
    strategy: str

    @property
    def retries(self) -> bool:
        """True when the door waits: RETRY, or TIME_OUT after waiting until the deadline."""
        return self.verdict is Verdict.RETRY or self.verdict is Verdict.TIME_OUT


def decide(
    request: Request,
    reason: RetryReason,
    action: RetryAction | None,
    strategy: str,
    *,
    now: float,
    requests_in_retry: int,
    max_requests_in_retry: int,
) -> Decision:
    """Decide what follows a failed attempt of ``request`` that failed for ``reason``.

    ``action`` is the strategy's answer (ignored for an always-retry reason),
    ``strategy`` its name, ``now`` the time on the request's clock. The failed
    attempt is already recorded on the request; :meth:`Request.retry_attempts` is
    the number of retries before this one.
    """
    if reason.always_retry:
        attempt = request.retry_attempts
        delay = CONTROLLED_SECONDS[attempt if attempt < 5 else 5]
        action = None
        strategy = "controlled_backoff"
    else:
        assert action is not None
        seconds = action.seconds
        if not (request.idempotent or reason.allows_non_idempotent_retry):
            # Whatever the strategy said, a retry could apply the request twice.
            return Decision(Verdict.NOT_IDEMPOTENT, 0.0, action, strategy)
        if seconds is None:
            return Decision(Verdict.REFUSED, 0.0, action, strategy)
        delay = seconds
    if requests_in_retry >= max_requests_in_retry:
        return Decision(Verdict.TOO_MANY, 0.0, action, strategy)
    left = request.deadline - now
    if delay >= left:
        return Decision(Verdict.TIME_OUT, left if left > 0.0 else 0.0, action, strategy)
    return Decision(Verdict.RETRY, delay, action, strategy)
