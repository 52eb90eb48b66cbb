"""Context-scoped switches read by the runtime (set only through ``sdkcore.testing``).

They are contextvars, so concurrent tests (tasks, threads) do not see each other's.
"""

from __future__ import annotations

from contextvars import ContextVar

__all__ = ["INSTANT_DELAYS"]

#: True inside ``sdkcore.testing.instant_retries()``: every backoff and hedging delay
#: is waited as zero (one checkpoint), while every decision and count stays the same.
INSTANT_DELAYS: ContextVar[bool] = ContextVar("sdkcore_instant_delays", default=False)
