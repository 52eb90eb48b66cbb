"""Regression tests for the reporter bugs tests/test_reporters_fuzz.py found (rfc/0008:
record() refuses a bad argument with a TypeError or ValueError naming the field, and
records nothing then; tests/bad_numbers.py: never OverflowError)."""

from __future__ import annotations

from typing import Any

import pytest
from bad_numbers import judge

from sdkcore._orphans import OrphanReporter
from sdkcore._threshold import ThresholdReporter


@pytest.mark.parametrize(
    ("args", "error", "field"),
    [
        (("kv", "get", -1.0), ValueError, "duration"),
        (("kv", "get", -1), ValueError, "duration"),
        (("kv", "get", False), TypeError, "duration"),
        ((7, "get", 0.1), TypeError, "service"),
    ],
)
def test_threshold_fast_path_refuses_bad_duration_and_service(
    args: tuple[Any, ...], error: type[Exception], field: str
) -> None:
    """_threshold.py:117-124: a duration under the threshold returns before any check, so
    a negative duration, False or a non-str service is silently taken as a fast request
    (the same values over the threshold are refused)."""
    r = ThresholdReporter()
    with pytest.raises(error, match=rf"record\({field}\)"):
        r.record(*args)


@pytest.mark.parametrize("make", [ThresholdReporter, OrphanReporter])
@pytest.mark.parametrize("value", [1e303, 10**400], ids=["1e303", "10**400"])
@pytest.mark.parametrize("keyword", ["duration", "timeout", "last_dispatch_duration"])
def test_a_huge_duration_is_not_an_overflow_error(make: Any, value: Any, keyword: str) -> None:
    """_sample.py:84-87: float(10**400) and round(1e303 * 1e6) raise OverflowError (not a
    ValueError naming the field)."""
    r = make()

    def record(v: Any) -> object:
        if keyword == "duration":
            r.record("kv", "get", v)
        else:
            r.record("kv", "get", 1.0, **{keyword: v})
        return r

    judge(record, value, f"record({keyword})")
