"""Parsers of untrusted documents raise only their documented error.

``ServiceConfig.from_json`` raises ServiceConfigError and ``ErrorMap.from_json``
raises ErrorMapError for any bad document: never OverflowError, RecursionError,
the int-digits ValueError or anything else. The documents come from a server or
a name resolver, so a hostile or broken one must give a clear error naming the
field, not a crash in the caller's connection code.

Two fuzzers over valid documents: a deterministic one (seeded text and JSON-tree
mutations, a few thousand per parser) and hypothesis (JSON values spliced into
every field). Each run takes a few seconds at most.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdkcore.grpc import ServiceConfig, ServiceConfigError
from sdkcore.mapping import ErrorMap, ErrorMapError

SERVICE_CONFIG: dict[str, Any] = {
    "methodConfig": [
        {
            "name": [{"service": "pkg.Svc", "method": "Get"}, {"service": "pkg.Other"}],
            "timeout": "2.5s",
            "waitForReady": True,
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", 10],
            },
        },
        {
            "name": [{"service": "pkg.Hedged"}],
            "hedgingPolicy": {
                "maxAttempts": 3,
                "hedgingDelay": "0.5s",
                "nonFatalStatusCodes": ["ABORTED"],
            },
        },
        {"name": [{}], "timeout": "10s"},
    ],
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
}

ERROR_MAP: dict[str, Any] = {
    "version": 2,
    "revision": 1,
    "errors": {
        "0": {"name": "SUCCESS", "desc": "Success", "attrs": ["success"]},
        "86": {
            "name": "ETMPFAIL",
            "desc": "Temporary failure",
            "attrs": ["temp", "retry-later"],
            "retry": {
                "strategy": "exponential",
                "interval": 2,
                "after": 10,
                "ceil": 500,
                "max-duration": 1500,
            },
        },
    },
}

HUGE = "9" * 400  # a float() of it overflows
TOO_MANY_DIGITS = "9" * 5000  # over CPython's int max str digits (4300)
DEEP = 100_000


def service_config(text: str | bytes) -> None:
    """Parses, or raises ServiceConfigError listing at least one violation."""
    error: ServiceConfigError | None = None
    try:
        ServiceConfig.from_json(text)
    except ServiceConfigError as exc:
        error = exc
    assert error is None or (error.violations and str(error))


def error_map(text: str | bytes) -> None:
    """Parses, or raises ErrorMapError."""
    error: ErrorMapError | None = None
    try:
        ErrorMap.from_json(text)
    except ErrorMapError as exc:
        error = exc
    assert error is None or str(error)


# -- the cases that used to escape -------------------------------------------------


def _retry_policy(multiplier: str) -> str:
    return (
        '{"methodConfig": [{"name": [{"service": "a"}], "retryPolicy": {"maxAttempts": 2, '
        '"initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": ' + multiplier + ", "
        '"retryableStatusCodes": [14]}}]}'
    )


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (_retry_policy(HUGE), "methodConfig[0].retryPolicy.backoffMultiplier"),
        (_retry_policy("-" + HUGE), "methodConfig[0].retryPolicy.backoffMultiplier"),
        ('{"retryThrottling": {"maxTokens": 10, "tokenRatio": ' + HUGE + "}}", "tokenRatio"),
        (_retry_policy(TOO_MANY_DIGITS), "methodConfig[0].retryPolicy.backoffMultiplier"),
        (
            '{"retryThrottling": {"maxTokens": ' + TOO_MANY_DIGITS + ', "tokenRatio": 1}}',
            "maxTokens",
        ),
        (
            '{"methodConfig": [{"name": [{"service": "a"}], "timeout": "'
            + TOO_MANY_DIGITS
            + 's"}]}',
            "methodConfig[0].timeout",
        ),
        ("[" * DEEP, "(root)"),
        ('{"methodConfig": ' + "[" * DEEP + "]" * DEEP + "}", "(root)"),
        ('{"a": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}", "(root)"),
    ],
)
def test_service_config_raises_only_its_error_naming_the_field(text: str, path: str) -> None:
    with pytest.raises(ServiceConfigError) as info:
        ServiceConfig.from_json(text)
    assert path in str(info.value)
    assert len(str(info.value)) < 2000, "the message does not echo a huge value"


def test_service_config_mapping_input_with_unprintable_values() -> None:
    """A Mapping built in Python may hold what JSON text cannot: the errors still name it."""
    deep: Any = []
    for _ in range(DEEP):
        deep = [deep]
    doc = {
        "retryThrottling": {"maxTokens": 10**5000, "tokenRatio": deep},
        "methodConfig": [{"name": [{"service": "a"}], "timeout": deep}],
    }
    with pytest.raises(ServiceConfigError) as info:
        ServiceConfig.from_json(doc)
    paths = [v.path for v in info.value.violations]
    assert paths == [
        "methodConfig[0].timeout",
        "retryThrottling.maxTokens",
        "retryThrottling.tokenRatio",
    ]
    assert "5001-digit integer" in str(info.value)
    assert len(str(info.value)) < 2000


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("[" * DEEP, "error map"),
        ('{"version": 1, "revision": 0, "errors": ' + "[" * DEEP + "]" * DEEP + "}", "error map"),
        ('{"version": ' + TOO_MANY_DIGITS + ', "revision": 0, "errors": {}}', "version"),
        (
            '{"version": 1, "revision": 0, "errors": {"86": {"name": "x", "desc": "d", '
            '"attrs": [], "retry": {"strategy": "constant", "interval": -'
            + TOO_MANY_DIGITS
            + ', "after": 1}}}}',
            'errors["86"].retry.interval',
        ),
    ],
)
def test_error_map_raises_only_its_error_naming_the_field(text: str, path: str) -> None:
    with pytest.raises(ErrorMapError) as info:
        ErrorMap.from_json(text)
    assert path in str(info.value)
    assert len(str(info.value)) < 2000


def test_error_map_from_dict_with_unprintable_values() -> None:
    doc = {"version": -(10**5000), "revision": 0, "errors": {}}
    with pytest.raises(ErrorMapError) as info:
        ErrorMap.from_dict(doc)
    assert info.value.path == "version"
    assert "5001-digit integer" in str(info.value)


# -- the deterministic fuzzer ----------------------------------------------------------

_ALPHABET = [*list('{}[]":,.-+eE0123456789 \\nulltruefalse'), "é", "\x00", "�"]
_VALUES: list[Callable[[random.Random], Any]] = [
    lambda r: None,
    lambda r: r.choice([True, False]),
    lambda r: r.randint(-(2**70), 2**70),
    lambda r: int(HUGE),
    lambda r: -int(HUGE),
    lambda r: r.choice([0, -1, 1, 2, 3, 1000, 1001, 2**31]),
    lambda r: r.choice([0.0, -0.5, 0.0004, 1e308, 1e-320, 0.1]),
    lambda r: r.choice(["", "0s", "-1s", "1.0000000001s", "1e3s", "999999999999999s", "abc"]),
    lambda r: r.choice(["UNAVAILABLE", "unavailable", "NOPE", "constant", "exponential"]),
    lambda r: [],
    lambda r: {},
    lambda r: [r.randint(-3, 20)],
    lambda r: {"": 1, "x": [None]},
]


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _nodes(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _nodes(value, (*path, i))


def _tree_mutation(doc: Any, r: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(r.randint(1, 3)):
        paths = list(_nodes(doc))[1:]
        if not paths:
            break
        path = r.choice(paths)
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        try:
            action = r.random()
            if action < 0.15 and isinstance(parent, dict):
                del parent[path[-1]]
            elif action < 0.25 and isinstance(parent, dict):
                parent[r.choice(["extra", "retryPolicy", "name", "errors", "ff"])] = r.choice(
                    _VALUES
                )(r)
            else:
                parent[path[-1]] = r.choice(_VALUES)(r)
        except (KeyError, IndexError):
            continue
    return doc


def _text_mutation(text: str, r: random.Random) -> str:
    chars = list(text)
    for _ in range(r.randint(1, 4)):
        i = r.randrange(len(chars) + 1)
        action = r.random()
        if action < 0.3 and chars:
            del chars[min(i, len(chars) - 1)]
        elif action < 0.6:
            chars.insert(i, r.choice(_ALPHABET))
        elif action < 0.75:
            j = min(len(chars), i + r.randint(1, 20))
            chars[i:i] = chars[i:j]
        elif action < 0.85:
            chars.insert(i, r.choice([HUGE, TOO_MANY_DIGITS, "1e999", "-0"]))
        elif action < 0.95:
            n = r.choice([50, 2000, DEEP])
            chars.insert(i, "[" * n + "]" * r.choice([0, n]))
        elif chars:
            chars[min(i, len(chars) - 1)] = r.choice(_ALPHABET)
    return "".join(chars)


def _documents(valid: dict[str, Any], seed: int, count: int) -> Iterator[str | bytes]:
    r = random.Random(seed)
    text = json.dumps(valid)
    for n in range(count):
        if n % 2:
            yield _text_mutation(text, r)
        else:
            mutated = json.dumps(_tree_mutation(valid, r))
            yield mutated if n % 4 else mutated.encode("utf-8", "surrogatepass")


def test_valid_documents_parse() -> None:
    config = ServiceConfig.from_json(json.dumps(SERVICE_CONFIG))
    assert config.retry_throttling is not None
    assert len(ErrorMap.from_json(json.dumps(ERROR_MAP))) == 2


def test_fuzz_service_config_deterministic() -> None:
    for doc in _documents(SERVICE_CONFIG, seed=3, count=2500):
        service_config(doc)


def test_fuzz_service_config_tree_as_mapping() -> None:
    """The same mutations handed over as an already-decoded Mapping."""
    r = random.Random(5)
    for _ in range(1500):
        doc = _tree_mutation(SERVICE_CONFIG, r)
        with contextlib.suppress(ServiceConfigError):
            ServiceConfig.from_json(doc)


def test_fuzz_error_map_deterministic() -> None:
    for doc in _documents(ERROR_MAP, seed=7, count=2500):
        error_map(doc)


def test_fuzz_error_map_tree_as_dict() -> None:
    r = random.Random(11)
    for _ in range(1500):
        doc = _tree_mutation(ERROR_MAP, r)
        with contextlib.suppress(ErrorMapError):
            ErrorMap.from_dict(doc)


# -- hypothesis: arbitrary JSON values spliced into every field --------------------------

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)

_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _splice(valid: dict[str, Any], index: int, value: Any) -> Any:
    doc = copy.deepcopy(valid)
    paths = list(_nodes(doc))[1:]
    path = paths[index % len(paths)]
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return doc


@_FUZZ
@given(index=st.integers(min_value=0, max_value=200), value=_json_values)
def test_hypothesis_service_config(index: int, value: Any) -> None:
    service_config(json.dumps(_splice(SERVICE_CONFIG, index, value)))


@_FUZZ
@given(index=st.integers(min_value=0, max_value=200), value=_json_values)
def test_hypothesis_error_map(index: int, value: Any) -> None:
    error_map(json.dumps(_splice(ERROR_MAP, index, value)))


@_FUZZ
@given(data=st.binary(max_size=200) | st.text(max_size=200))
def test_hypothesis_arbitrary_bytes(data: bytes | str) -> None:
    service_config(data)
    error_map(data)
