"""What a method gets from the service config: a retry plan or a hedging plan.

Both are built once per method and cached by the controller; a call only reads them.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs

from .._errors import RetryableError
from .._hedge_policy import HedgePolicy
from .._latency import LatencyQuantile
from ._policy import PUSHBACK_DONT_RETRY, PUSHBACK_KEY, A6RetryStrategy, parse_pushback
from ._service_config import MethodConfig
from ._throttle import RetryThrottler

__all__ = ["HedgePlan"]


def _method_name(method: Any) -> str:
    return method.decode() if isinstance(method, bytes) else str(method)


class _Plan:
    """A retried method: its strategy, its name and the method config's call settings."""

    __slots__ = ("name", "strategy", "timeout", "wait_for_ready")

    def __init__(self, strategy: A6RetryStrategy, mc: MethodConfig | None, name: str = "") -> None:
        self.strategy = strategy
        self.name = name
        self.timeout = None if mc is None or mc.timeout is None else mc.timeout.total_seconds()
        self.wait_for_ready = None if mc is None else mc.wait_for_ready


class HedgePlan:
    """What a method with a ``hedgingPolicy`` gets: the core policy and the call settings."""

    __slots__ = (
        "_single",
        "name",
        "non_fatal",
        "policy",
        "throttler",
        "timeout",
        "wait_for_ready",
    )

    def __init__(
        self,
        method_config: Any,
        *,
        max_attempts_cap: int,
        throttler: RetryThrottler | None,
        name: str = "",
        delay: LatencyQuantile | None = None,
    ) -> None:
        hp = method_config.hedging_policy
        self.name = name
        self.non_fatal: frozenset[int] = hp.non_fatal_status_codes
        self.policy = HedgePolicy(
            hp.max_attempts,
            delay=hp.hedging_delay if delay is None else delay,  # sdkcore's hedge_delay option
            pushback=_pushback_seconds,
            max_attempts_cap=max_attempts_cap,
        )
        self.throttler = None if throttler is None else _Gate(throttler)
        timeout = method_config.timeout
        self.timeout = None if timeout is None else timeout.total_seconds()
        self.wait_for_ready = method_config.wait_for_ready
        self._single: HedgePlan | None = None

    def single(self) -> HedgePlan:
        """This plan for a call whose request does not fit the retry buffers: hedge 0
        alone (A6: "New RPCs which do not fit in the available buffer space ... will not
        be retryable"). Made once per plan."""
        if self.policy.max_attempts == 1:
            return self
        single = self._single
        if single is None:
            single = copy.copy(self)
            single.policy = attrs.evolve(self.policy, max_attempts=1)
            # None, not itself: a plan that pointed at itself was a reference cycle, its
            # objects left to the garbage collector when the channel went (a test saw them)
            single._single = None
            self._single = single
        return single


class _Gate:
    """The channel's throttler for the runner: gating and non-fatal failures only.

    A success is recorded once the committed hedge ends OK (a hedge commits on its
    headers, before its status is known).
    """

    __slots__ = ("_t",)

    def __init__(self, throttler: RetryThrottler) -> None:
        self._t = throttler

    def allows_retry(self) -> bool:
        return self._t.allows_retry()

    def record_failure(self) -> bool:
        return self._t.record_failure()

    def record_success(self) -> None:
        return None


def _pushback_ms(err: Any) -> int | None:
    trailing = err.trailing_metadata()
    return parse_pushback(trailing.get_all(PUSHBACK_KEY)) if trailing else None


def _pushback_seconds(failure: RetryableError) -> float | None:
    err = failure.__cause__
    if err is None:
        return None
    ms = _pushback_ms(err)
    if ms is None:
        return None
    return -1.0 if ms == PUSHBACK_DONT_RETRY else ms / 1000.0
