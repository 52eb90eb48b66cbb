"""ErrorMap.from_json: parsing, validation errors that name the path, retry-spec delays."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdkcore.mapping import ErrorMap, ErrorMapError, RetrySpec, RetrySpecStrategy

OK_ENTRY = {"name": "E", "desc": "d", "attrs": []}
SAMPLE: dict[str, Any] = {
    "version": 2,
    "revision": 7,
    "errors": {
        "0": {"name": "SUCCESS", "desc": "Success", "attrs": ["success"]},
        "86": {
            "name": "ETMPFAIL",
            "desc": "Temporary failure",
            "attrs": ["temp", "retry-later"],
            "retry": {"strategy": "exponential", "interval": 2, "after": 10, "ceil": 500},
        },
        "a2": {"name": "SYNC_WRITE_IN_PROGRESS", "desc": "...", "attrs": ["temp", "retry-now"]},
        "7ff0": {
            "name": "DUMMY",
            "desc": "constant",
            "attrs": ["retry-now"],
            "retry": {"strategy": "constant", "interval": 25, "after": 10, "max-duration": 1500},
            "future-field": {"ignored": True},
        },
    },
    "future-top-level": 1,
}


def test_parses_bytes_and_str_alike() -> None:
    raw = json.dumps(SAMPLE)
    for data in (raw, raw.encode()):
        emap = ErrorMap.from_json(data)
        assert (emap.version, emap.revision, len(emap)) == (2, 7, 4)
        tmp = emap.get(0x86)
        assert tmp is not None
        assert tmp.name == "ETMPFAIL"
        assert tmp.attrs == frozenset({"temp", "retry-later"})
        assert tmp.retry == RetrySpec(RetrySpecStrategy.EXPONENTIAL, 2, 10, 500, 0)
        assert emap.retry_statuses == frozenset({0x86, 0xA2, 0x7FF0})
        assert emap.retry_indicated(0xA2)
        assert not emap.retry_indicated(0)
        assert emap.get(0x1234) is None


@pytest.mark.parametrize(
    ("doc", "path", "problem"),
    [
        ([], "", "must be a JSON object, got array"),
        ({"revision": 1, "errors": {}}, "version", "is required"),
        ({"version": "2", "revision": 1, "errors": {}}, "version", "must be an integer"),
        ({"version": 0, "revision": 1, "errors": {}}, "version", "must be >= 1"),
        ({"version": 2, "revision": True, "errors": {}}, "revision", "must be an integer"),
        ({"version": 2, "revision": 1}, "errors", "is required"),
        ({"version": 2, "revision": 1, "errors": []}, "errors", "must be an object"),
        ({"version": 2, "revision": 1, "errors": {"zz": {}}}, 'errors["zz"]', "hex"),
        ({"version": 2, "revision": 1, "errors": {"12345": {}}}, 'errors["12345"]', "hex"),
        ({"version": 2, "revision": 1, "errors": {"86": 3}}, 'errors["86"]', "must be an object"),
        (
            {"version": 2, "revision": 1, "errors": {"86": {"desc": "", "attrs": []}}},
            'errors["86"].name',
            "is required",
        ),
        (
            {
                "version": 2,
                "revision": 1,
                "errors": {"86": {"name": "x", "desc": "", "attrs": "temp"}},
            },
            'errors["86"].attrs',
            "must be an array",
        ),
        (
            {
                "version": 2,
                "revision": 1,
                "errors": {"86": {"name": "x", "desc": "", "attrs": ["a", 3]}},
            },
            'errors["86"].attrs[1]',
            "must be a string",
        ),
        (
            {"version": 2, "revision": 1, "errors": {"a": OK_ENTRY, "0a": OK_ENTRY}},
            'errors["0a"]',
            "duplicates status 0xa",
        ),
    ],
)
def test_malformed_maps_name_the_path(doc: Any, path: str, problem: str) -> None:
    with pytest.raises(ErrorMapError) as info:
        ErrorMap.from_json(json.dumps(doc))
    assert info.value.path == path
    assert problem in str(info.value)
    assert isinstance(info.value, ValueError)


def _with_retry(retry: Any) -> str:
    entry = {"name": "E", "desc": "d", "attrs": ["retry-later"], "retry": retry}
    return json.dumps({"version": 2, "revision": 1, "errors": {"86": entry}})


@pytest.mark.parametrize(
    ("retry", "path", "problem"),
    [
        (
            {"strategy": "foo", "interval": 1, "after": 1},
            'errors["86"].retry.strategy',
            "must be one of constant, linear, exponential, got 'foo'",
        ),
        ({"interval": 1, "after": 1}, 'errors["86"].retry.strategy', "is required"),
        ({"strategy": "linear", "after": 1}, 'errors["86"].retry.interval', "is required"),
        ({"strategy": "linear", "interval": 1}, 'errors["86"].retry.after', "is required"),
        (
            {"strategy": "linear", "interval": 1.5, "after": 1},
            'errors["86"].retry.interval',
            "must be an integer",
        ),
        (
            {"strategy": "linear", "interval": 1, "after": 1, "ceil": -1},
            'errors["86"].retry.ceil',
            "must be >= 0",
        ),
        (
            {"strategy": "linear", "interval": 1, "after": 1, "max-duration": "x"},
            'errors["86"].retry.max-duration',
            "must be an integer",
        ),
        ([1], 'errors["86"].retry', "must be an object"),
    ],
)
def test_malformed_retry_specs_name_the_path(retry: Any, path: str, problem: str) -> None:
    with pytest.raises(ErrorMapError) as info:
        ErrorMap.from_json(_with_retry(retry))
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ")
    assert problem in str(info.value)


def test_strategy_message_is_exactly_as_documented() -> None:
    with pytest.raises(ErrorMapError) as info:
        ErrorMap.from_json(_with_retry({"strategy": "foo", "interval": 1, "after": 1}))
    assert str(info.value) == (
        "errors[\"86\"].retry.strategy: must be one of constant, linear, exponential, got 'foo'"
    )


@pytest.mark.parametrize(
    ("data", "problem"),
    [("{", "not valid JSON"), (b"\xff\xfe", "not valid UTF-8"), ("", "not valid JSON")],
)
def test_undecodable_input(data: str | bytes, problem: str) -> None:
    with pytest.raises(ErrorMapError, match=problem):
        ErrorMap.from_json(data)


@pytest.mark.parametrize(
    ("key", "path", "got"),
    [
        (134, "errors[134]", "int"),
        (None, "errors[None]", "NoneType"),
        (1.5, "errors[1.5]", "float"),
    ],
)
def test_from_dict_non_string_key_names_the_path(key: Any, path: str, got: str) -> None:
    doc = {"version": 2, "revision": 1, "errors": {key: OK_ENTRY}}
    with pytest.raises(ErrorMapError) as info:
        ErrorMap.from_dict(doc)
    assert info.value.path == path
    assert str(info.value) == f"{path}: key must be a lower-case hex string, got {got}"


def test_wrong_argument_type() -> None:
    with pytest.raises(TypeError, match="takes bytes or str"):
        ErrorMap.from_json({"version": 1})  # type: ignore[arg-type]


# -- delays ------------------------------------------------------------------------

C, L, E = RetrySpecStrategy.CONSTANT, RetrySpecStrategy.LINEAR, RetrySpecStrategy.EXPONENTIAL


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (RetrySpec(C, 25, 10), [10, 25, 25, 25, 25]),
        (RetrySpec(L, 10, 5), [5, 10, 20, 30, 40]),
        (RetrySpec(L, 10, 5, ceil_ms=25), [5, 10, 20, 25, 25]),
        (RetrySpec(E, 2, 10), [10, 2, 4, 8, 16]),
        (RetrySpec(E, 3, 0, ceil_ms=20), [0, 3, 9, 20, 20]),
        (RetrySpec(C, 25, 1000, ceil_ms=5), [1000, 5, 5, 5, 5]),  # ceil caps interval, not after
    ],
)
def test_delay_calculation(spec: RetrySpec, expected: list[int]) -> None:
    assert [spec.delay_ms(n) for n in range(5)] == expected
    assert [spec.delay(n) for n in range(5)] == [timedelta(milliseconds=ms) for ms in expected]


def test_delay_rejects_bad_attempts() -> None:
    spec = RetrySpec(C, 1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        spec.delay_ms(-1)
    with pytest.raises(TypeError, match="must be an int"):
        spec.delay_ms(1.0)  # type: ignore[arg-type]


MAX_DELAY_MS = 2**53
# Small values most of the time, and durations far beyond timedelta's range (~8.6e19 ms).
durations = st.integers(0, 10_000) | st.integers(0, 10**30)


@given(st.sampled_from(list(RetrySpecStrategy)), durations, durations, durations, durations)
def test_delays_never_overflow_and_respect_ceil(
    strategy: RetrySpecStrategy, interval: int, after: int, ceil: int, attempt: int
) -> None:
    spec = RetrySpec(strategy, interval, after, ceil)
    delay = spec.delay(attempt)  # never OverflowError, even for interval ** 10**30
    ms = spec.delay_ms(attempt)
    assert 0 <= ms <= MAX_DELAY_MS
    assert delay == timedelta(milliseconds=ms)
    if attempt == 0:
        assert ms == min(after, MAX_DELAY_MS)
    elif ceil > 0:
        assert ms <= ceil


@pytest.mark.parametrize("strategy", list(RetrySpecStrategy))
def test_huge_after_is_clamped_like_the_other_branches(strategy: RetrySpecStrategy) -> None:
    spec = RetrySpec(strategy, 10**20, 10**20)
    assert spec.delay_ms(0) == MAX_DELAY_MS
    assert spec.delay(0) == timedelta(milliseconds=MAX_DELAY_MS)
    assert spec.delay(1) == timedelta(milliseconds=MAX_DELAY_MS)


# -- RetrySpec built directly --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"interval_ms": -1}, ValueError, r"RetrySpec\.interval_ms must be >= 0, got -1"),
        ({"after_ms": -5}, ValueError, r"RetrySpec\.after_ms must be >= 0, got -5"),
        ({"ceil_ms": -1}, ValueError, r"RetrySpec\.ceil_ms must be >= 0, got -1"),
        ({"max_duration_ms": -1}, ValueError, r"RetrySpec\.max_duration_ms must be >= 0, got -1"),
        ({"interval_ms": 1.5}, TypeError, r"RetrySpec\.interval_ms must be an int .*got 1\.5"),
        ({"after_ms": True}, TypeError, r"RetrySpec\.after_ms must be an int .*got True"),
        ({"ceil_ms": "10"}, TypeError, r"RetrySpec\.ceil_ms must be an int .*got '10'"),
        (
            {"strategy": "constant"},
            TypeError,
            r"RetrySpec\.strategy must be a RetrySpecStrategy .*got 'constant'",
        ),
    ],
)
def test_retry_spec_validates_its_fields(kwargs: dict[str, Any], error: type, match: str) -> None:
    fields: dict[str, Any] = {"strategy": C, "interval_ms": 10, "after_ms": 0}
    fields.update(kwargs)
    with pytest.raises(error, match=match):
        RetrySpec(**fields)


def test_retry_spec_accepts_zero_everywhere() -> None:
    spec = RetrySpec(E, 0, 0, 0, 0)
    assert [spec.delay_ms(n) for n in range(3)] == [0, 0, 0]
