"""HTTP ``Retry-After`` (RFC 9110 section 10.2.3): how long the server asked us to wait.

Pure and bounded: no OverflowError, no exception for any input string; what
cannot be read as a wait gives None. See rfc/0007 "Server hints".
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime

from .._duration import MAX_SECONDS

__all__ = ["MAX_RETRY_AFTER", "parse_retry_after"]

#: The longest wait :func:`parse_retry_after` returns: one day. A longer hint is
#: capped to it (a request deadline is far shorter anyway).
MAX_RETRY_AFTER = timedelta(days=1)

_DELTA = re.compile(r"[0-9]+")
_MAX_DIGITS = 12  # more digits than this is longer than MAX_RETRY_AFTER anyway
_MAX_HEADER = 100  # a longer value is no Retry-After a server sends


def parse_retry_after(value: str | bytes | None, now: datetime | None = None) -> timedelta | None:
    """The wait a ``Retry-After`` value asks for, or None.

    * delta-seconds (``"120"``): that many seconds;
    * HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``, and the obsolete RFC 850 and
      asctime forms): the time from ``now`` (default: the current UTC time) to it.

    Garbage, a negative or fractional number, a date in the past (or now), and an
    empty value give None. A wait longer than :data:`MAX_RETRY_AFTER` is capped to
    it. ``value`` may be bytes (latin-1, as HTTP header values are). ``now`` must
    be timezone-aware if given.
    """
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("latin-1")
    if not isinstance(value, str):
        raise TypeError(
            f"parse_retry_after(value) must be a str, bytes or None, got {value!r} "
            f"({type(value).__name__})"
        )
    if now is not None and (not isinstance(now, datetime) or now.utcoffset() is None):
        raise TypeError(
            f"parse_retry_after(now) must be a timezone-aware datetime or None, got {now!r}"
        )
    text = value.strip()
    if not text or len(text) > _MAX_HEADER:
        return None
    if _DELTA.fullmatch(text):
        digits = text.lstrip("0") or "0"
        if len(digits) > _MAX_DIGITS:
            return MAX_RETRY_AFTER
        seconds = int(digits)
        if seconds == 0:
            return timedelta(0)
        return min(timedelta(seconds=min(seconds, int(MAX_SECONDS))), MAX_RETRY_AFTER)
    if text[0] in "+-" or text[0].isdigit():
        return None  # "-5", "1.5", "10s": not delta-seconds, and no HTTP-date starts so
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:  # some Python versions return None for unparsable dates
        return None  # pragma: no cover
    if when.tzinfo is None:  # "-0000" or no zone: HTTP-dates are GMT
        when = when.replace(tzinfo=timezone.utc)
    if now is None:
        now = datetime.now(timezone.utc)
    try:
        wait = when - now
    except OverflowError:  # pragma: no cover - both are valid datetimes
        return None
    if wait <= timedelta(0):
        return None
    return min(wait, MAX_RETRY_AFTER)
