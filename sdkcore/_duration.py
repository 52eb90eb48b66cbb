"""Conversion of user-supplied durations (timedelta or float seconds)."""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = ["to_seconds"]


def to_seconds(value: object, what: str, *, allow_zero: bool = True) -> float:
    """Seconds as a float from a ``timedelta`` or a real number, else a clear error.

    ``what`` names the field in the message, e.g. ``"Request.timeout"``.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{what} must be a datetime.timedelta or a number of seconds, "
            f"got {value!r} ({type(value).__name__})"
        )
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{what} must be a finite duration, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be {bound} seconds, got {value!r}")
    return seconds
