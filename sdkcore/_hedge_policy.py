"""What a hedged request is allowed to do: :class:`HedgePolicy` and the throttler it may use.

Plain values, checked when built (rfc/0004). The runner that follows them is
:mod:`sdkcore._hedge`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import attrs

from ._callables import sync_callable
from ._duration import to_seconds
from ._errors import RetryableError
from ._latency import LatencyQuantile
from ._reason import RetryReason
from ._untrusted import show

__all__ = ["DEFAULT_HEDGE_ATTEMPTS_CAP", "HedgePolicy", "HedgeThrottler"]

#: A6 "Limits on Retries and Hedges": the client-side cap on max_attempts, of hedges here
#: and of an sdkcore gRPC channel's retries and hedges (``sdkcore.grpc`` imports it).
DEFAULT_HEDGE_ATTEMPTS_CAP = 5


class HedgeThrottler(Protocol):
    """What the runner needs from a throttler (``sdkcore.grpc.RetryThrottler`` is one)."""

    def allows_retry(self) -> bool: ...

    def record_failure(self) -> bool: ...

    def record_success(self) -> None: ...


def _delay(value: Any) -> timedelta | LatencyQuantile:
    if value is None:
        return timedelta(0)
    if isinstance(value, LatencyQuantile):
        return value
    if isinstance(value, timedelta):
        to_seconds(value, "HedgePolicy.delay")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            "HedgePolicy.delay must be a datetime.timedelta, a number of seconds, a "
            f"LatencyQuantile or None, got {show(value)} ({type(value).__name__})"
        )
    return timedelta(seconds=to_seconds(value, "HedgePolicy.delay"))


def _check_attempts(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):  # a wrong type (rfc/0005)
        raise TypeError(
            f"HedgePolicy.{attribute.name} must be an integer >= 1 (at most {2**31 - 1}), "
            f"got {show(value)} ({type(value).__name__})"
        )
    if not 1 <= value <= 2**31 - 1:
        raise ValueError(
            f"HedgePolicy.{attribute.name} must be an integer >= 1 (at most {2**31 - 1}), "
            f"got {show(value)}"
        )


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
            f"HedgePolicy.non_fatal must be a collection of RetryReason or None, got {show(value)}"
        ) from None
    bad = [r for r in reasons if type(r) is not RetryReason]
    if bad:
        raise TypeError(f"HedgePolicy.non_fatal must hold RetryReason members only, got {bad[0]!r}")
    return reasons


def _check_pushback(_: Any, __: Any, value: Any) -> None:
    sync_callable(
        value, "HedgePolicy.pushback", "(RetryableError) -> seconds | None", optional=True
    )


@attrs.frozen(slots=True)
class HedgePolicy:
    """How :meth:`RetryOrchestrator.hedge` hedges a request (A6 ``hedgingPolicy`` in core terms).

    * ``max_attempts``: copies sent at most, the first included (>= 1), capped by
      ``max_attempts_cap`` (A6 default 5).
    * ``delay``: ``timedelta`` or seconds between hedges; ``None`` or 0 sends every
      copy at once. A :class:`LatencyQuantile` learns it: the next copy goes out at its
      ``current_delay`` (the recent p(1 - max_extra_load) latency), none is sent for
      latency before it has ``min_samples``, and each copy's latency is recorded into it
      (rfc/0009).
    * ``non_fatal``: the :class:`RetryReason` s a failed copy may report (by raising
      ``RetryableError``) without ending the chain; ``None`` (default) means every
      reason. Any other exception from ``send`` is fatal.
    * ``pushback``: optional ``(RetryableError) -> seconds | None`` reading server
      pushback from a non-fatal failure: ``None`` no pushback (the next hedge goes
      at once), ``n >= 0`` the next hedge goes after ``n`` seconds, negative: no
      more hedges (those in flight keep running).
    """

    max_attempts: int = attrs.field(validator=_check_attempts)
    delay: timedelta | LatencyQuantile = attrs.field(default=None, converter=_delay)
    non_fatal: frozenset[RetryReason] | None = attrs.field(default=None, converter=_non_fatal)
    pushback: Callable[[RetryableError], float | None] | None = attrs.field(
        default=None, validator=_check_pushback, eq=False
    )
    max_attempts_cap: int = attrs.field(
        default=DEFAULT_HEDGE_ATTEMPTS_CAP, validator=_check_attempts
    )
    #: The :class:`LatencyQuantile` the delay is learned from, or None for a fixed delay
    #: (set from ``delay``: a hedged request reads it once, without a type check).
    latency: LatencyQuantile | None = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        delay = self.delay
        learned = delay if isinstance(delay, LatencyQuantile) else None
        object.__setattr__(self, "latency", learned)  # frozen: attrs' documented way

    @property
    def effective_max_attempts(self) -> int:
        """``min(max_attempts, max_attempts_cap)``."""
        return min(self.max_attempts, self.max_attempts_cap)
