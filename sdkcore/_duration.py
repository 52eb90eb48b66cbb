"""Conversion of user-supplied durations (timedelta or float seconds)."""

from __future__ import annotations

import math
from datetime import timedelta

from ._untrusted import show

__all__ = ["MAX_SECONDS", "to_seconds"]

#: The longest duration a ``timedelta`` can hold, in seconds (about 2.7 million years).
MAX_SECONDS = float(timedelta.max.days * 86400)


def to_seconds(
    value: object, what: str, *, allow_zero: bool = True, none_hint: str | None = None
) -> float:
    """Seconds as a float from a ``timedelta`` or a real number, else a clear error.

    ``what`` names the field in the message, e.g. ``"Request.timeout"``; ``none_hint``:
    what the field takes None for, told when the value is too long for a timedelta.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    else:
        raise TypeError(
            f"{what} must be a datetime.timedelta or a number of seconds, "
            f"got {show(value)} ({type(value).__name__})"
        )
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{what} must be a finite duration, got {show(value)}")
    if seconds > MAX_SECONDS:
        hint = "" if none_hint is None else f"; {none_hint}"
        raise ValueError(
            f"{what} must be at most {MAX_SECONDS:.0f} seconds (what a timedelta holds), "
            f"got {show(value)}{hint}"
        )
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound} seconds, got {show(value)}")
    return seconds
