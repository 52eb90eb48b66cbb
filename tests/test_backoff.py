"""controlled_backoff (RFC 0049 "Controlled Backoff for Always Retry") and best-effort backoff."""

from __future__ import annotations

from datetime import timedelta

import pytest

from sdkcore import best_effort_backoff, controlled_backoff, exponential_backoff


def ms(n: float) -> timedelta:
    return timedelta(milliseconds=n)


@pytest.mark.parametrize(
    ("attempt", "expected_ms"),
    [
        (0, 1),
        (1, 10),
        (2, 50),
        (3, 100),
        (4, 500),
        (5, 1000),
        (6, 1000),
        (10, 1000),
        (10_000, 1000),
    ],
)
def test_controlled_backoff_table(attempt: int, expected_ms: int) -> None:
    delay = controlled_backoff(attempt)
    assert isinstance(delay, timedelta)
    assert delay == ms(expected_ms)


@pytest.mark.parametrize("attempt", [-1, -100])
def test_controlled_backoff_rejects_negative_attempt(attempt: int) -> None:
    with pytest.raises(ValueError, match=r"attempt.*>= 0"):
        controlled_backoff(attempt)


def test_best_effort_default_sequence() -> None:
    got = [best_effort_backoff(n) for n in range(12)]
    expected = [ms(x) for x in (1, 2, 4, 8, 16, 32, 64, 128, 256, 500, 500, 500)]
    assert got == expected
    assert best_effort_backoff(1_000_000) == ms(500)


def test_exponential_backoff_custom_bounds() -> None:
    calc = exponential_backoff(0.01, 0.05, 3.0)
    assert [calc(n) for n in range(5)] == [ms(10), ms(30), ms(50), ms(50), ms(50)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lower": 0}, r"lower.*> 0"),
        ({"upper": -1}, r"upper"),
        ({"lower": 1.0, "upper": 0.5}, r"upper.*>= lower"),
        ({"factor": 0.5}, r"factor.*>= 1"),
    ],
)
def test_exponential_backoff_rejects_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        exponential_backoff(**kwargs)


@pytest.mark.parametrize("lower", [1e-310, 5e-324, 1e-9, 4e-7, 9.99e-7])
def test_exponential_backoff_refuses_a_lower_below_a_microsecond(lower: float) -> None:
    """A lower bound below 1 us (a timedelta's resolution) is refused, naming the argument:
    its delays would round to 0 (the lower bound must be > 0), and a subnormal one raised a
    raw OverflowError from the table's ``factor ** n`` (1e-310 x 1e6**52)."""
    with pytest.raises(ValueError, match=r"exponential_backoff\(lower\) must be at least 1 mic"):
        exponential_backoff(lower, 1.0, 1e6)


def test_exponential_backoff_takes_a_microsecond_with_the_largest_factor() -> None:
    """The smallest lower and the largest factor together: no overflow, the formula's delays."""
    calc = exponential_backoff(timedelta(microseconds=1), 1000.0, 1e6)
    assert [calc(n) for n in range(4)] == [
        timedelta(microseconds=1),
        timedelta(seconds=1),
        timedelta(seconds=1000),
        timedelta(seconds=1000),
    ]
    assert calc(10**6) == timedelta(seconds=1000)
