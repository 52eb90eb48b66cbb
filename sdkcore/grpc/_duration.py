"""proto3 JSON durations (``"1.5s"``), as used by the gRPC service config."""

from __future__ import annotations

import re
import reprlib

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 80
_REPR.maxother = 80


def _show(value: object) -> str:
    """A bounded repr for error messages."""
    try:
        return _REPR.repr(value)
    except Exception:  # e.g. an int past CPython's str-digits limit
        return f"a {type(value).__name__}"


__all__ = ["MAX_DURATION_SECONDS", "parse_duration"]

#: The proto3 ``google.protobuf.Duration`` range: +-10,000 years in seconds.
MAX_DURATION_SECONDS = 315_576_000_000

_MAX_SECONDS_DIGITS = len(str(MAX_DURATION_SECONDS))

_DURATION = re.compile(r"(-)?([0-9]+)(?:\.([0-9]{1,9}))?s")


def parse_duration(value: object) -> int:
    """Nanoseconds from a proto3 JSON duration such as ``"0.1s"`` or ``"-2s"``.

    Raises ``ValueError`` with a message describing the accepted form.
    """
    if not isinstance(value, str):
        raise ValueError(
            f'must be a proto3 JSON duration string like "0.1s", got {_show(value)} '
            f"({type(value).__name__})"
        )
    m = _DURATION.fullmatch(value)
    if m is None:
        raise ValueError(
            "must be a proto3 JSON duration: decimal seconds with at most 9 fractional digits "
            f'followed by "s" (e.g. "0.1s", "1.5s"), got {_show(value)}'
        )
    sign, whole, frac = m.groups()
    # Decided on the digits first: int() of a very long text is refused by CPython.
    whole = whole.lstrip("0") or "0"
    if len(whole) > _MAX_SECONDS_DIGITS or int(whole) > MAX_DURATION_SECONDS:
        raise ValueError(
            f"must be at most {MAX_DURATION_SECONDS} seconds (proto3 Duration range), "
            f"got {_show(value)}"
        )
    seconds = int(whole)
    nanos = seconds * 1_000_000_000 + (int(frac.ljust(9, "0")) if frac else 0)
    return -nanos if sign else nanos
