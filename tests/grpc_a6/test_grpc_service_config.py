"""ServiceConfig.from_json: every A6 validation rule, one test per error."""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from typing import Any

import pytest

from sdkcore.grpc import (
    RetryPolicy,
    ServiceConfig,
    ServiceConfigError,
    parse_duration,
)

RETRY: dict[str, Any] = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
HEDGE: dict[str, Any] = {"maxAttempts": 3, "hedgingDelay": "0.5s", "nonFatalStatusCodes": [14]}


def with_retry(**changes: Any) -> dict[str, Any]:
    policy = copy.deepcopy(RETRY)
    for key, value in changes.items():
        if value is _DELETE:
            del policy[key]
        else:
            policy[key] = value
    return {"methodConfig": [{"name": [{"service": "s"}], "retryPolicy": policy}]}


def with_hedge(**changes: Any) -> dict[str, Any]:
    policy = copy.deepcopy(HEDGE)
    for key, value in changes.items():
        if value is _DELETE:
            del policy[key]
        else:
            policy[key] = value
    return {"methodConfig": [{"name": [{"service": "s"}], "hedgingPolicy": policy}]}


_DELETE = object()
RP = "methodConfig[0].retryPolicy"
HP = "methodConfig[0].hedgingPolicy"
#: What maxAttempts must be (retryPolicy and hedgingPolicy alike).
ATTEMPTS_RULE = (
    "must be an integer >= 2 and <= 2147483647 (an int32), written as a JSON integer (no "
    'fraction) or a string of one (3 or "3")'
)
TOKENS_RULE = (
    "must be an integer in (0, 1000], written as a JSON integer (no fraction) or a string of one "
    '(10 or "10")'
)
MULTIPLIER_RULE = (
    'must be a finite number > 0, written as a JSON number or a string of one (2 or "2")'
)
RATIO_RULE = (
    'must be a finite number > 0, written as a JSON number or a string of one (0.1 or "0.1")'
)


def violations(config: Any) -> list[str]:
    with pytest.raises(ServiceConfigError) as info:
        ServiceConfig.from_json(config)
    return [str(v) for v in info.value.violations]


def test_valid_retry_policy_parses() -> None:
    cfg = ServiceConfig.from_json(json.dumps(with_retry()))
    mc = cfg.method_config("/s/m")
    assert mc is not None
    assert mc.retry_policy == RetryPolicy(
        4, timedelta(seconds=0.1), timedelta(seconds=1), 2.0, frozenset({14})
    )


def test_example_message_format() -> None:
    assert violations(with_retry(maxAttempts=1)) == [f"{RP}.maxAttempts: {ATTEMPTS_RULE}, got 1"]


# -- maxAttempts ---------------------------------------------------------------------


def test_max_attempts_required() -> None:
    assert violations(with_retry(maxAttempts=_DELETE)) == [
        f"{RP}.maxAttempts: is required: an integer >= 2"
    ]


@pytest.mark.parametrize(
    "value",
    [
        *(1, 0, -3, 2.5, 2.0, True, None, [3], {"n": 3}),
        *("1", "2.0", "3e10", "abc", "", " ", "1_0", "0x10", "٣"),
        *(2**31, "2147483648", "99999999999999999999999"),
    ],
)
def test_max_attempts_must_be_an_int32_at_least_2(value: Any) -> None:
    """What no int32 holds is refused here, naming the field; grpc's JSON loader refuses it
    too (absl::SimpleAtoi into an int32). 2**31 used to be accepted."""
    assert violations(with_retry(maxAttempts=value)) == [
        f"{RP}.maxAttempts: {ATTEMPTS_RULE}, got {value!r}"
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("3", 3),
        (" 4\n", 4),
        ("+5", 5),
        ("007", 7),
        ("2147483647", 2**31 - 1),
        (2**31 - 1, 2**31 - 1),
    ],
)
def test_max_attempts_may_be_written_as_a_string_as_proto3_json_allows(
    value: Any, expected: int
) -> None:
    """proto3 JSON writes an int32 as a number or a string; grpcio takes both."""
    for config in (with_retry(maxAttempts=value), with_hedge(maxAttempts=value)):
        for given in (config, json.dumps(config)):
            mc = ServiceConfig.from_json(given).method_config("/s/m")
            assert mc is not None
            policy = mc.retry_policy or mc.hedging_policy
            assert policy is not None
            assert policy.max_attempts == expected
            assert type(policy.max_attempts) is int


@pytest.mark.parametrize("build", [with_retry, with_hedge])
def test_an_integer_too_large_for_any_policy_is_a_service_config_error(build: Any) -> None:
    """A Mapping may hold any Python int: before, 10**20000 escaped as a bare ValueError
    from the policy's constructor ("got one too large"), with no field path."""
    path = RP if build is with_retry else HP
    for value in (10**20000, -(10**20000), "1" * 5000):
        (msg,) = violations(build(maxAttempts=value))
        assert msg.startswith(f"{path}.maxAttempts: {ATTEMPTS_RULE}, got ")


def test_max_attempts_above_cap_is_not_an_error_and_is_clamped() -> None:
    cfg = ServiceConfig.from_json(with_retry(maxAttempts=10))
    mc = cfg.method_config("/s/m")
    assert mc is not None
    assert mc.retry_policy is not None
    assert mc.retry_policy.max_attempts == 10
    assert mc.retry_policy.effective_max_attempts() == 5
    assert mc.retry_policy.effective_max_attempts(8) == 8


# -- backoffs ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["initialBackoff", "maxBackoff"])
def test_backoff_required(key: str) -> None:
    msgs = violations(with_retry(**{key: _DELETE}))
    assert msgs == [f'{RP}.{key}: is required: a proto3 JSON duration > 0, e.g. "0.1s"']


@pytest.mark.parametrize("key", ["initialBackoff", "maxBackoff"])
@pytest.mark.parametrize("value", ["0s", "0.000000000s", "-1s"])
def test_backoff_must_be_positive(key: str, value: str) -> None:
    assert violations(with_retry(**{key: value})) == [
        f"{RP}.{key}: must be a duration > 0, got {value!r}"
    ]


@pytest.mark.parametrize("key", ["initialBackoff", "maxBackoff"])
@pytest.mark.parametrize("value", ["1", "1.5", "1ms", ".5s", "1.s", "0.1234567891s", "1e2s", " 1s"])
def test_backoff_must_be_proto3_duration(key: str, value: str) -> None:
    (msg,) = violations(with_retry(**{key: value}))
    assert msg.startswith(f"{RP}.{key}: must be a proto3 JSON duration")
    assert repr(value) in msg


@pytest.mark.parametrize("key", ["initialBackoff", "maxBackoff"])
def test_backoff_must_be_string(key: str) -> None:
    (msg,) = violations(with_retry(**{key: 0.1}))
    assert msg.startswith(f'{RP}.{key}: must be a proto3 JSON duration string like "0.1s"')


def test_duration_parsing() -> None:
    assert parse_duration("1.5s") == 1_500_000_000
    assert parse_duration("0.000000001s") == 1
    assert parse_duration("-2s") == -2_000_000_000
    assert parse_duration("0.123456789s") == 123_456_789
    with pytest.raises(ValueError, match="at most 315576000000 seconds"):
        parse_duration("315576000001s")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("0.0000004s", timedelta(microseconds=1)),  # > 0 stays > 0: rounded up, not to 0
        ("0.000000001s", timedelta(microseconds=1)),
        ("0.0000015s", timedelta(microseconds=2)),
        ("0.000002s", timedelta(microseconds=2)),
        ("1.5s", timedelta(seconds=1.5)),
    ],
)
def test_durations_round_up_to_whole_microseconds(raw: str, expected: timedelta) -> None:
    config = ServiceConfig.from_json(
        {
            "methodConfig": [
                {
                    "name": [{"service": "s"}],
                    "timeout": raw,
                    "retryPolicy": dict(RETRY, initialBackoff=raw, maxBackoff=raw),
                }
            ]
        }
    )
    mc = config.method_config("/s/m")
    assert mc is not None
    assert mc.retry_policy is not None
    assert mc.retry_policy.initial_backoff == expected
    assert mc.retry_policy.max_backoff == expected
    assert mc.timeout == expected


# -- backoffMultiplier ----------------------------------------------------------------


def test_multiplier_required() -> None:
    assert violations(with_retry(backoffMultiplier=_DELETE)) == [
        f"{RP}.backoffMultiplier: is required: a number > 0"
    ]


@pytest.mark.parametrize(
    "value",
    [0, -1, -0.5, True, None, "0", "-2", "NaN", "Infinity", "2x", "", "1e-400", "1e400", "1_0"],
)
def test_multiplier_must_be_positive_number(value: Any) -> None:
    assert violations(with_retry(backoffMultiplier=value)) == [
        f"{RP}.backoffMultiplier: {MULTIPLIER_RULE}, got {value!r}"
    ]


@pytest.mark.parametrize(("value", "expected"), [("2", 2.0), (" 1.5 ", 1.5), ("2e0", 2.0)])
def test_multiplier_may_be_written_as_a_string(value: str, expected: float) -> None:
    """proto3 JSON writes a double as a number or a string; grpcio takes both."""
    mc = ServiceConfig.from_json(json.dumps(with_retry(backoffMultiplier=value))).method_config(
        "/s/m"
    )
    assert mc is not None
    assert mc.retry_policy is not None
    assert mc.retry_policy.backoff_multiplier == expected


def test_multiplier_may_be_fractional() -> None:
    mc = ServiceConfig.from_json(with_retry(backoffMultiplier=1.5)).method_config("/s/m")
    assert mc is not None
    assert mc.retry_policy is not None
    assert mc.retry_policy.backoff_multiplier == 1.5


# -- retryableStatusCodes -------------------------------------------------------------


def test_codes_required() -> None:
    (msg,) = violations(with_retry(retryableStatusCodes=_DELETE))
    assert msg.startswith(f"{RP}.retryableStatusCodes: is required: a non-empty array")


def test_codes_must_not_be_empty() -> None:
    (msg,) = violations(with_retry(retryableStatusCodes=[]))
    assert msg.startswith(f"{RP}.retryableStatusCodes: must not be empty")


def test_codes_must_be_array() -> None:
    (msg,) = violations(with_retry(retryableStatusCodes="UNAVAILABLE"))
    assert msg.startswith(f"{RP}.retryableStatusCodes: must be an array of status codes")


@pytest.mark.parametrize(
    "bad",
    [
        "NOPE",
        17,
        -1,
        14.0,
        None,
        "14",
        "\u0131nternal",
        "data_lo\u017f\u017f",
        "\u0131nvalid_argument",
    ],
)
def test_codes_must_be_valid(bad: Any) -> None:
    (msg,) = violations(with_retry(retryableStatusCodes=["ABORTED", bad]))
    assert msg.startswith(f"{RP}.retryableStatusCodes[1]: must be a valid status code")
    assert msg.endswith(f"got {bad!r}")


def test_codes_integer_and_case_insensitive_names() -> None:
    cfg = ServiceConfig.from_json(with_retry(retryableStatusCodes=[14, "aborted", "Internal"]))
    mc = cfg.method_config("/s/m")
    assert mc is not None
    assert mc.retry_policy is not None
    assert mc.retry_policy.retryable_status_codes == frozenset({14, 10, 13})


# -- hedgingPolicy ------------------------------------------------------------------------


def test_valid_hedging_policy_parses_and_delay_is_optional() -> None:
    mc = ServiceConfig.from_json(with_hedge(hedgingDelay=_DELETE)).method_config("/s/x")
    assert mc is not None
    assert mc.hedging_policy is not None
    assert mc.hedging_policy.hedging_delay == timedelta(0)
    assert mc.hedging_policy.non_fatal_status_codes == frozenset({14})
    assert mc.retry_policy is None


def test_hedging_max_attempts_rule() -> None:
    assert violations(with_hedge(maxAttempts=1)) == [f"{HP}.maxAttempts: {ATTEMPTS_RULE}, got 1"]
    assert violations(with_hedge(maxAttempts="3e10")) == [
        f"{HP}.maxAttempts: {ATTEMPTS_RULE}, got '3e10'"
    ]


def test_hedging_delay_must_be_duration() -> None:
    (msg,) = violations(with_hedge(hedgingDelay="0.5"))
    assert msg.startswith(f"{HP}.hedgingDelay: must be a proto3 JSON duration")


def test_hedging_non_fatal_codes_optional_but_valid() -> None:
    mc = ServiceConfig.from_json(with_hedge(nonFatalStatusCodes=_DELETE)).method_config("/s/x")
    assert mc is not None
    assert mc.hedging_policy is not None
    (msg,) = violations(with_hedge(nonFatalStatusCodes=["BOGUS"]))
    assert msg.startswith(f"{HP}.nonFatalStatusCodes[0]: must be a valid status code")


def test_method_may_not_have_both_policies() -> None:
    cfg = {"methodConfig": [{"name": [{}], "retryPolicy": RETRY, "hedgingPolicy": HEDGE}]}
    assert violations(cfg) == [
        "methodConfig[0]: may set retryPolicy or hedgingPolicy, not both "
        "(A6: one policy per method)"
    ]


# -- retryThrottling ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", [0, -1, 1001, 1.5, True, "0", "1001", "1.5", "abc", "3e10", 2**31, 10**200]
)
def test_max_tokens_range(value: Any) -> None:
    (msg,) = violations({"retryThrottling": {"maxTokens": value, "tokenRatio": 0.1}})
    assert msg.startswith(f"retryThrottling.maxTokens: {TOKENS_RULE}, got ")


@pytest.mark.parametrize(("value", "expected"), [("10", 10), (" 1000 ", 1000), ("+1", 1)])
def test_max_tokens_may_be_written_as_a_string(value: str, expected: int) -> None:
    text = json.dumps({"retryThrottling": {"maxTokens": value, "tokenRatio": "0.5466"}})
    throttling = ServiceConfig.from_json(text).retry_throttling
    assert throttling is not None
    assert (throttling.max_tokens, throttling.token_ratio) == (expected, 0.546)


def test_max_tokens_required_and_1000_allowed() -> None:
    assert violations({"retryThrottling": {"tokenRatio": 0.1}}) == [
        "retryThrottling.maxTokens: is required: an integer in (0, 1000]"
    ]
    cfg = ServiceConfig.from_json({"retryThrottling": {"maxTokens": 1000, "tokenRatio": 1}})
    assert cfg.retry_throttling is not None
    assert cfg.retry_throttling.max_tokens == 1000


@pytest.mark.parametrize("value", [0, -0.1, None, "-0.1", "NaN", "Infinity", "0.1x", ""])
def test_token_ratio_must_be_positive(value: Any) -> None:
    assert violations({"retryThrottling": {"maxTokens": 10, "tokenRatio": value}}) == [
        f"retryThrottling.tokenRatio: {RATIO_RULE}, got {value!r}"
    ]


def test_token_ratio_written_as_a_string_keeps_its_bounds() -> None:
    (msg,) = violations({"retryThrottling": {"maxTokens": 10, "tokenRatio": "1e999999999"}})
    assert msg == "retryThrottling.tokenRatio: must be at most 1000000, got '1e999999999'"
    (msg,) = violations({"retryThrottling": {"maxTokens": 10, "tokenRatio": "1e-999999999"}})
    assert msg.startswith("retryThrottling.tokenRatio: must be at least 0.001")


def test_token_ratio_required() -> None:
    (msg,) = violations({"retryThrottling": {"maxTokens": 10}})
    assert msg.startswith("retryThrottling.tokenRatio: is required")


@pytest.mark.parametrize(
    ("value", "expected"), [(0.5466, 0.546), (1.001, 1.001), (0.1, 0.1), (3, 3.0)]
)
def test_token_ratio_truncated_to_three_decimals(value: float, expected: float) -> None:
    cfg = ServiceConfig.from_json({"retryThrottling": {"maxTokens": 10, "tokenRatio": value}})
    assert cfg.retry_throttling is not None
    assert cfg.retry_throttling.token_ratio == expected


def test_token_ratio_truncating_to_zero_is_an_error() -> None:
    (msg,) = violations({"retryThrottling": {"maxTokens": 10, "tokenRatio": 0.0009}})
    assert msg.startswith("retryThrottling.tokenRatio: must be at least 0.001")


def test_throttling_must_be_object() -> None:
    (msg,) = violations({"retryThrottling": [1]})
    assert msg.startswith("retryThrottling: must be an object")


# -- structure, names, every violation at once ---------------------------------------


def test_every_violation_is_listed_with_its_path() -> None:
    cfg = {
        "methodConfig": [
            {"name": [{"service": "a"}], "retryPolicy": {"maxAttempts": 1}},
            {"name": [{"service": "b"}], "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": 1}},
        ],
        "retryThrottling": {"maxTokens": 0, "tokenRatio": 0},
    }
    with pytest.raises(ServiceConfigError) as info:
        ServiceConfig.from_json(cfg)
    paths = [v.path for v in info.value.violations]
    assert paths == [
        f"{RP}.maxAttempts",
        f"{RP}.initialBackoff",
        f"{RP}.maxBackoff",
        f"{RP}.backoffMultiplier",
        f"{RP}.retryableStatusCodes",
        "methodConfig[1].hedgingPolicy.hedgingDelay",
        "retryThrottling.maxTokens",
        "retryThrottling.tokenRatio",
    ]
    assert "8 problems" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_not_json_and_not_object() -> None:
    (msg,) = violations("{nope")
    assert msg.startswith("(root): must be a JSON object; the text is not JSON")
    assert violations("[1]") == ["(root): must be a JSON object, got an array"]
    with pytest.raises(TypeError, match="takes a JSON str/bytes or a Mapping"):
        ServiceConfig.from_json(42)  # type: ignore[arg-type]


def test_method_config_must_be_array() -> None:
    assert violations({"methodConfig": {}}) == [
        "methodConfig: must be an array of objects, got an object"
    ]


def test_duplicate_names_rejected() -> None:
    cfg = {"methodConfig": [{"name": [{"service": "s"}]}, {"name": [{"service": "s"}]}]}
    (msg,) = violations(cfg)
    assert msg.startswith("methodConfig[1].name[0]: duplicate method name 's'/''")


def test_method_without_service_rejected() -> None:
    (msg,) = violations({"methodConfig": [{"name": [{"method": "m"}]}]})
    assert msg.startswith("methodConfig[0].name[0]: method 'm' needs a service")


def test_timeout_and_wait_for_ready_validated() -> None:
    cfg = {"methodConfig": [{"name": [{}], "timeout": "1", "waitForReady": "yes"}]}
    msgs = violations(cfg)
    assert msgs[0].startswith("methodConfig[0].timeout: must be a proto3 JSON duration")
    assert msgs[1] == "methodConfig[0].waitForReady: must be true or false, got 'yes'"


def test_name_matching_exact_then_service_then_default() -> None:
    cfg = ServiceConfig.from_json(
        {
            "methodConfig": [
                {"name": [{}], "timeout": "3s"},
                {"name": [{"service": "pkg.S"}], "timeout": "2s"},
                {"name": [{"service": "pkg.S", "method": "M"}], "timeout": "1s"},
            ]
        }
    )

    def timeout_of(method: str) -> float | None:
        mc = cfg.method_config(method)
        return None if mc is None or mc.timeout is None else mc.timeout.total_seconds()

    assert timeout_of("/pkg.S/M") == 1.0
    assert timeout_of("/pkg.S/Other") == 2.0
    assert timeout_of("/pkg.T/M") == 3.0
    no_default = ServiceConfig.from_json({"methodConfig": [{"name": [{"service": "pkg.S"}]}]})
    assert no_default.method_config("/pkg.T/M") is None


def test_unknown_fields_are_ignored_and_bytes_accepted() -> None:
    cfg = ServiceConfig.from_json(b'{"loadBalancingPolicy": "round_robin", "methodConfig": []}')
    assert cfg.method_configs == ()
    assert cfg.retry_throttling is None
