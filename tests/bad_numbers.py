"""The rule both bad-number tests apply (test_bad_numbers.py, test_bad_numbers_core.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def judge(build: Callable[[Any], object], value: Any, named: str) -> None:
    """``build(value)`` accepts the value, and the result's repr and str do not raise; or
    it refuses it with a TypeError or ValueError whose short message names ``named``:
    never OverflowError, never CPython's own "Exceeds the limit" conversion message.
    Any other exception fails the test.
    """
    error: TypeError | ValueError | None = None
    try:
        built = build(value)
    except (TypeError, ValueError) as exc:  # judged below; anything else fails the test
        error = exc
    if error is None:
        repr(built)
        str(built)
        return
    assert not isinstance(error, OverflowError), repr(error)
    message = str(error)
    assert named in message, message
    assert "Exceeds the limit" not in message
    assert len(message) < 1000
