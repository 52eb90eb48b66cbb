"""Checks of the callables an application hands in, made once, where they are handed in.

A clock, a predicate or a backoff is called synchronously: a coroutine function there
would return a coroutine that is never awaited, and the request would fail later with
an error naming none of it (or, for a predicate, take the coroutine as True). Such a
callable is refused when it is given, naming the field.

An async hook (``sleep``, ``send``) cannot be told from a plain function that returns
an awaitable (``lambda s: trio.sleep(s)``) until it is called, so the doors check what
it returned where they await it, and only when the await fails.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from ._untrusted import show

__all__ = ["clock_reading", "is_async", "slice_of", "sync_callable"]


def is_async(value: Any) -> bool:
    """A coroutine function, a partial of one, or an object whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(value):
        return True
    return (
        callable(value)
        and not inspect.isroutine(value)
        and not isinstance(value, type)
        and inspect.iscoroutinefunction(value.__call__)
    )


def sync_callable(value: object, field: str, shape: str, *, optional: bool = False) -> None:
    """Refuse ``value`` unless it is a plain callable (or None when ``optional``).

    ``field`` names it (``"CircuitBreaker(clock)"``), ``shape`` says what it is called
    with and returns (``"() -> seconds"``).
    """
    if value is None and optional:
        return
    allowed = f"a callable {shape}" + (" or None" if optional else "")
    if not callable(value):
        raise TypeError(f"{field} must be {allowed}, got {show(value)}")
    if is_async(value):
        raise TypeError(
            f"{field} must be {allowed}, called synchronously; got the coroutine function "
            f"{show(value)}, whose calls would return coroutines nobody awaits"
        )


def clock_reading(clock: Any, field: str) -> float:
    """One reading of ``clock``, taken where it is handed in (``field`` names it): a real
    number of seconds. A clock that returns anything else (None, a string, a bool) is
    refused here, naming the field, instead of failing later inside arithmetic with an
    error that names none of it (``unsupported operand type(s) for *: 'NoneType'``)."""
    reading = clock()
    if isinstance(reading, bool) or not isinstance(reading, (int, float)):
        raise TypeError(
            f"{field} must return seconds (a real number, monotonic), got {show(reading)} "
            f"({type(reading).__name__})"
        )
    try:
        seconds = float(reading)
    except OverflowError:  # an int past a float's range: refused as an infinity is
        seconds = math.inf
    if not math.isfinite(seconds):  # NaN or infinite: no time to count windows from
        raise ValueError(f"{field} must return finite seconds (monotonic), got {show(reading)}")
    return seconds


def slice_of(now: float, per_slice: float) -> int | None:
    """The window slice a clock reading falls in (``floor(now * per_slice)``: slice k is
    ``[k, k + 1) / per_slice``, below 0 too, where ``int()`` made one slice of two), or None for
    a reading no window can be counted in: NaN, an infinity, a number past a float's
    range (a clock that broke after its owner's constructor read it). The windowed
    counters (retry budget, adaptive throttle, latency quantile) then record nothing and
    leave their window where it is: never an error inside a request."""
    try:
        return math.floor(now * per_slice)
    except (OverflowError, ValueError):
        return None
