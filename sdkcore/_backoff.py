"""Backoff calculators: RFC 0049 "Controlled Backoff" and the best-effort default."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from ._duration import to_seconds
from ._untrusted import show

__all__ = [
    "CONTROLLED_STEPS",
    "Backoff",
    "best_effort_backoff",
    "controlled_backoff",
    "exponential_backoff",
]

#: A backoff calculator: retry attempt count (0-based) -> delay.
Backoff = Callable[[int], "timedelta | float"]

_CONTROLLED = tuple(timedelta(milliseconds=ms) for ms in (1, 10, 50, 100, 500))
_CONTROLLED_MAX = timedelta(milliseconds=1000)
#: The smallest ``lower`` of :func:`exponential_backoff`: a timedelta's resolution. With
#: it (and ``factor`` <= 1e6) ``factor ** n`` stays in range until the delay passes any
#: ``upper`` a timedelta holds, and past that an overflow can only mean the cap.
_MIN_LOWER = timedelta.resolution.total_seconds()
#: How many controlled delays come before the maximum, which repeats from then on: the
#: one length every user of the table reads (add a step above, and they all follow).
CONTROLLED_STEPS = len(_CONTROLLED)


def controlled_backoff(attempt: int) -> timedelta:
    """The always-retry backoff: 1, 10, 50, 100, 500 ms, then 1000 ms for every later attempt."""
    if isinstance(attempt, bool) or not isinstance(attempt, int):
        raise TypeError(f"controlled_backoff(attempt) must be an int >= 0, got {show(attempt)}")
    if attempt < 0:
        raise ValueError(f"controlled_backoff(attempt) must be >= 0, got {show(attempt)}")
    return _CONTROLLED[attempt] if attempt < CONTROLLED_STEPS else _CONTROLLED_MAX


def exponential_backoff(
    lower: timedelta | float = 0.001, upper: timedelta | float = 0.5, factor: float = 2.0
) -> Callable[[int], timedelta]:
    """A calculator returning ``min(lower * factor**attempt, upper)`` (no jitter).

    ``lower``: at least 1 microsecond (a timedelta's resolution); ``upper`` >= ``lower``;
    ``factor``: from 1 to 1e6. The default (1 ms doubling up to 500 ms) is
    :func:`best_effort_backoff`.
    """
    lo = to_seconds(lower, "exponential_backoff(lower)", allow_zero=False)
    if lo < _MIN_LOWER:
        # Its delays would be timedelta(0) (a timedelta holds microseconds), not the > 0
        # the lower bound promises; and a subnormal one overflowed ``factor ** n`` below
        # before the product came back into range (1e-310 x 1e6**52).
        raise ValueError(
            "exponential_backoff(lower) must be at least 1 microsecond (1e-06 s, the "
            f"resolution of the timedelta delays it returns), got {show(lower)}"
        )
    hi = to_seconds(upper, "exponential_backoff(upper)", allow_zero=False)
    if hi < lo:
        raise ValueError(f"exponential_backoff(upper) must be >= lower ({lo} s), got {hi} s")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"exponential_backoff(factor) must be a number >= 1, got {show(factor)}")
    if not 1.0 <= factor <= 1e6:  # NaN, inf and ints too large for a float fail here too
        raise ValueError(
            f"exponential_backoff(factor) must be >= 1 (and at most 1e6), got {show(factor)}"
        )
    factor = float(factor)
    table: list[timedelta] = []  # the first delays, precomputed (up to 64 of them)
    while len(table) < 64 and (d := lo * factor ** len(table)) < hi:
        table.append(timedelta(seconds=d))
    cap = timedelta(seconds=hi)
    frozen = tuple(table)
    n = len(frozen)

    def backoff(attempt: int) -> timedelta:
        if type(attempt) is not int and (isinstance(attempt, bool) or not isinstance(attempt, int)):
            raise TypeError(
                f"backoff(attempt) must be an int >= 0 (the retries so far), got {show(attempt)}"
            )
        if 0 <= attempt < n:
            return frozen[attempt]
        if attempt < 0:
            raise ValueError(f"backoff(attempt) must be >= 0, got {attempt}")
        try:
            d = lo * factor**attempt
        except OverflowError:
            return cap
        return cap if d >= hi else timedelta(seconds=d)

    backoff.__doc__ = (
        f"The delay before retry ``attempt`` (0 for the first): min({lo:g} s x "
        f"{factor:g}**attempt, {hi:g} s). Made by exponential_backoff({lo:g}, {hi:g}, {factor:g})."
    )
    return backoff


#: The BestEffortRetryStrategy default: 1, 2, 4, ..., 256, 500, 500, ... ms.
best_effort_backoff = exponential_backoff(0.001, 0.5, 2.0)
