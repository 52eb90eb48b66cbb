"""proto3 JSON durations (``"1.5s"``), as used by the gRPC service config."""

from __future__ import annotations

import re

__all__ = ["MAX_DURATION_SECONDS", "parse_duration"]

#: The proto3 ``google.protobuf.Duration`` range: +-10,000 years in seconds.
MAX_DURATION_SECONDS = 315_576_000_000

_DURATION = re.compile(r"(-)?([0-9]+)(?:\.([0-9]{1,9}))?s")


def parse_duration(value: object) -> int:
    """Nanoseconds from a proto3 JSON duration such as ``"0.1s"`` or ``"-2s"``.

    Raises ``ValueError`` with a message describing the accepted form.
    """
    if not isinstance(value, str):
        raise ValueError(
            f'must be a proto3 JSON duration string like "0.1s", got {value!r} '
            f"({type(value).__name__})"
        )
    m = _DURATION.fullmatch(value)
    if m is None:
        raise ValueError(
            "must be a proto3 JSON duration: decimal seconds with at most 9 fractional digits "
            f'followed by "s" (e.g. "0.1s", "1.5s"), got {value!r}'
        )
    sign, whole, frac = m.groups()
    seconds = int(whole)
    if seconds > MAX_DURATION_SECONDS:
        raise ValueError(
            f"must be at most {MAX_DURATION_SECONDS} seconds (proto3 Duration range), got {value!r}"
        )
    nanos = seconds * 1_000_000_000 + (int(frac.ljust(9, "0")) if frac else 0)
    return -nanos if sign else nanos
