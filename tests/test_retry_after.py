"""parse_retry_after: HTTP Retry-After in delta-seconds or HTTP-date form, bounded."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdkcore.mapping import parse_retry_after
from sdkcore.mapping._retry_after import MAX_RETRY_AFTER

NOW = datetime(2015, 10, 21, 7, 28, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("120", timedelta(seconds=120)),
        ("  7 ", timedelta(seconds=7)),
        ("0", timedelta(0)),
        ("000042", timedelta(seconds=42)),
        (b"3", timedelta(seconds=3)),
        ("86400", timedelta(days=1)),
        ("86401", MAX_RETRY_AFTER),
        ("9" * 40, MAX_RETRY_AFTER),
    ],
)
def test_delta_seconds(value: str | bytes, expected: timedelta) -> None:
    assert parse_retry_after(value, now=NOW) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("Wed, 21 Oct 2015 07:28:30 GMT", timedelta(seconds=30)),  # IMF-fixdate
        ("Wednesday, 21-Oct-15 07:30:00 GMT", timedelta(minutes=2)),  # RFC 850
        ("Wed Oct 21 07:29:00 2015", timedelta(minutes=1)),  # asctime
        ("Wed, 21 Oct 2015 09:28:05 +0200", timedelta(seconds=5)),  # a zone other than GMT
        ("Thu, 22 Oct 2015 07:28:00 GMT", timedelta(days=1)),
        ("Fri, 21 Oct 2016 07:28:00 GMT", MAX_RETRY_AFTER),
    ],
)
def test_http_date(value: str, expected: timedelta) -> None:
    assert parse_retry_after(value, now=NOW) == expected


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "   ",
        "-5",
        "+5",
        "1.5",
        "10s",
        "soon",
        "Wed, 21 Oct 2015 07:28:00 GMT",  # now: nothing to wait for
        "Wed, 21 Oct 2015 07:27:59 GMT",  # the past
        "Mon, 01 Jan 1900 00:00:00 GMT",
        "Wed, 32 Oct 2015 07:28:00 GMT",
        "Wed, 21 Foo 2015 07:28:00 GMT",
        "Wed, 21 Oct 99999 07:28:00 GMT",
        "1 2",
        "x" * 10_000,
    ],
)
def test_garbage_negative_and_past_give_none(value: str | None) -> None:
    assert parse_retry_after(value, now=NOW) is None


def test_now_defaults_to_the_current_utc_time() -> None:
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    header = later.strftime("%a, %d %b %Y %H:%M:%S GMT")
    wait = parse_retry_after(header)
    assert wait is not None
    assert timedelta(minutes=59) < wait <= timedelta(hours=1)
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None


def test_bad_arguments_raise_naming_them() -> None:
    with pytest.raises(TypeError, match=r"parse_retry_after\(value\)"):
        parse_retry_after(120)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parse_retry_after\(now\) must be a timezone-aware"):
        parse_retry_after("5", now=datetime(2015, 1, 1))


@given(st.text(max_size=60))
def test_any_text_gives_none_or_a_bounded_wait(value: str) -> None:
    wait = parse_retry_after(value, now=NOW)
    assert wait is None or timedelta(0) <= wait <= MAX_RETRY_AFTER


@given(st.datetimes(min_value=datetime(1900, 1, 1), timezones=st.just(timezone.utc)))
def test_any_date_in_imf_form(when: datetime) -> None:
    # (years below 100 are read as two-digit years by the email date parser)
    header = when.strftime("%a, %d %b ") + f"{when.year:04d}" + when.strftime(" %H:%M:%S GMT")
    wait = parse_retry_after(header, now=NOW)
    if when.replace(microsecond=0) <= NOW:
        assert wait is None
    else:
        assert wait == min(when.replace(microsecond=0) - NOW, MAX_RETRY_AFTER)
