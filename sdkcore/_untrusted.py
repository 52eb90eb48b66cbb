"""Reading untrusted JSON documents (service configs, KV error maps) without surprises.

Pure helpers shared by the parsers: integers too long for CPython are kept as their
length, values shown in error messages are bounded, and text from a file is made safe
for a terminal (:func:`printable`). And :func:`count`, the messages' "1 attempt, 3
attempts".
"""

from __future__ import annotations

import math
import reprlib

__all__ = ["MAX_INT_DIGITS", "LongInt", "count", "parse_int", "printable", "show"]

#: Integers longer than this are kept as text (:class:`LongInt`), never converted:
#: CPython refuses int() of more than ``sys.get_int_max_str_digits()`` (>= 640) digits.
MAX_INT_DIGITS = 600


class LongInt:
    """A JSON integer too long to be any valid value; only its length is kept."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"a {self.digits}-digit integer"


def parse_int(text: str) -> int | LongInt:
    """``json.loads(..., parse_int=parse_int)``: never raises on a long integer."""
    digits = len(text) - (text[:1] == "-")
    if digits > MAX_INT_DIGITS:
        return LongInt(digits)
    return int(text)


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlong = 40


def show(value: object) -> str:
    """A bounded repr for error messages: huge or deeply nested values never escape."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a {int(math.log10(abs(value))) + 1}-digit integer"
    try:
        return _REPR.repr(value)
    except Exception:  # a repr that raises (an int past the str-digits limit in a list, ...)
        return f"a {type(value).__name__}"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``"1 attempt"``, ``"3 attempts"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _escape(c: str) -> str:
    code = ord(c)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on, or not show, escaped.

    For echoing what an untrusted file holds (a key, a value, a method name) to a
    terminal: an escape sequence in a service config must not recolour, retitle or
    rewrite the screen. Escaped are the C0 and C1 controls (ESC ``\\x1b``, BEL,
    CSI ``\\x9b``, newlines, ...), DEL, the invisible format characters (bidi
    overrides, zero-width characters, BOM), line and paragraph separators, and
    unassigned or private code points: whatever ``str.isprintable()`` refuses, except
    the plain space.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else _escape(c) for c in text)
