"""RetryThrottler: the arithmetic of grpc's retry_throttle_test.cc, in milli-tokens."""

from __future__ import annotations

import pytest

from sdkcore.grpc import RetryThrottler, throttler_for_target
from sdkcore.grpc._policy import PUSHBACK_DONT_RETRY, costs_token


def test_basic_sequence() -> None:
    # max 4 (threshold 2), +1.6 per success.
    t = RetryThrottler(4, 1.6)
    assert t.tokens == 4
    assert t.record_failure() is True  # 3
    t.record_success()  # 4 (capped)
    assert t.tokens == 4
    assert t.record_failure() is True  # 3
    assert t.record_failure() is False  # 2: at the threshold
    assert t.record_failure() is False  # 1
    assert t.record_failure() is False  # 0
    assert t.record_failure() is False  # 0: not below zero
    assert t.tokens == 0
    t.record_success()  # 1.6
    t.record_success()  # 3.2
    assert t.milli_tokens == 3200
    assert t.record_failure() is True  # 2.2
    assert t.record_failure() is False  # 1.2
    t.record_success()  # 2.8
    assert t.record_failure() is False  # 1.8
    t.record_success()  # 3.4
    assert t.record_failure() is True  # 2.4
    assert t.milli_tokens == 2400


def test_replacement_keeps_fill_fraction_and_old_forwards() -> None:
    old = RetryThrottler(4, 1)
    assert old.record_failure() is True  # 3 of 4
    new = RetryThrottler(10, 3, replaces=old)
    assert new.tokens == 7.5
    assert old.record_failure() is True  # 6.5, via the new bucket
    assert old.record_failure() is True  # 5.5
    assert old.record_failure() is False  # 4.5
    assert new.record_failure() is False  # 3.5
    new.record_success()  # 6.5
    assert old.record_failure() is True  # 5.5
    assert new.record_failure() is False  # 4.5
    assert old.tokens == new.tokens == 4.5


def test_map_replacement_per_target() -> None:
    target = "throttle-test.invalid:1"
    old = throttler_for_target(target, 4, 1)
    assert throttler_for_target(target, 4, 1) is old  # same settings: shared
    assert old.record_failure() is True
    new = throttler_for_target(target, 10, 3)
    assert new is not old
    assert new.tokens == 7.5
    assert old.record_failure() is True
    assert new.tokens == 6.5
    assert throttler_for_target("other.invalid:1", 4, 1) is not new


def test_token_ratio_uses_three_decimals() -> None:
    t = RetryThrottler(10, 0.5466)
    assert t.token_ratio == 0.546
    for _ in range(10):
        t.record_failure()
    t.record_success()
    assert t.milli_tokens == 546


@pytest.mark.parametrize(
    ("max_tokens", "ratio", "match"),
    [
        (0, 0.1, "max_tokens"),
        (1001, 0.1, "max_tokens"),
        (10, 0, "token_ratio"),
        (10, 0.0004, "token_ratio"),
    ],
)
def test_bad_arguments(max_tokens: float, ratio: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetryThrottler(max_tokens, ratio)


@pytest.mark.parametrize(
    ("status", "pushback", "costs"),
    [
        (14, None, True),  # UNAVAILABLE, retried by the policy
        (14, 100, True),  # a pushback delay does not change a retried status
        (5, None, False),  # NOT_FOUND: an ordinary answer, a success for the throttler
        (5, 100, False),  # a pushback delay alone costs nothing
        (5, -1, True),  # "don't retry" pushback costs a token whatever the status (A6)
        (14, -1, True),
    ],
)
def test_costs_token_is_a6s_rule(status: int, pushback: int | None, costs: bool) -> None:
    assert PUSHBACK_DONT_RETRY == -1
    assert costs_token(status, frozenset({14}), pushback) is costs
