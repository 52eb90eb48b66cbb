"""Public constructors of the core with bad numbers: a TypeError or ValueError naming the field.

Never OverflowError, never a message from CPython's own conversions, and whatever is
accepted has a repr and str that do not raise. (sdkcore.mapping and sdkcore.testing:
tests/test_bad_numbers.py; sdkcore.grpc: tests/grpc_a6/.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from bad_numbers import judge

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    HedgePolicy,
    Request,
    RetryableError,
    RetryAction,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    controlled_backoff,
    exponential_backoff,
)

BAD_NUMBERS: list[Any] = [
    float("inf"),
    float("-inf"),
    float("nan"),
    10**400,
    -(10**400),
    10**5000,
    True,
    -1,
    "3",
]
IDS = ["inf", "-inf", "nan", "1e400", "-1e400", "1e5000", "True", "-1", "str"]

FIELDS: list[tuple[str, Callable[[Any], object]]] = [
    ("Request.timeout", lambda v: Request(timeout=v)),
    ("RetryAction.with_duration(duration)", lambda v: RetryAction.with_duration(v)),
    ("RetryableError.retry_after", lambda v: RetryableError(RetryReason.KV_LOCKED, retry_after=v)),
    ("max_requests_in_retry", lambda v: RetryOrchestrator(max_requests_in_retry=v)),
    ("HedgePolicy.max_attempts", lambda v: HedgePolicy(v)),
    ("HedgePolicy.delay", lambda v: HedgePolicy(2, delay=v)),
    ("HedgePolicy.max_attempts_cap", lambda v: HedgePolicy(2, max_attempts_cap=v)),
    ("exponential_backoff(lower)", lambda v: exponential_backoff(lower=v)),
    ("exponential_backoff(upper)", lambda v: exponential_backoff(upper=v)),
    ("exponential_backoff(factor)", lambda v: exponential_backoff(factor=v)(3)),
    ("controlled_backoff(attempt)", lambda v: controlled_backoff(v)),
    ("CircuitBreaker(volume_threshold)", lambda v: CircuitBreaker(volume_threshold=v)),
    ("CircuitBreaker(sleep_window)", lambda v: CircuitBreaker(sleep_window=v)),
    ("CircuitBreaker(canary_timeout)", lambda v: CircuitBreaker(canary_timeout=v)),
    ("RetryBudget(ttl)", lambda v: RetryBudget(ttl=v)),
    ("RetryBudget(min_retries_per_sec)", lambda v: RetryBudget(min_retries_per_sec=v)),
    ("RetryBudget(retry_ratio)", lambda v: RetryBudget(retry_ratio=v)),
    ("BestEffortRetryStrategy", lambda v: _backoff_returning(v)),
]


def _backoff_returning(value: Any) -> object:
    strategy = BestEffortRetryStrategy(backoff=lambda attempt: value)
    return strategy.decide(Request(idempotent=True), RetryReason.KV_LOCKED)


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=IDS)
@pytest.mark.parametrize(("field", "build"), FIELDS, ids=[f for f, _ in FIELDS])
def test_bad_number_is_rejected_naming_the_field_or_accepted_with_a_safe_repr(
    field: str, build: Callable[[Any], object], value: Any
) -> None:
    judge(build, value, named=field.split("(")[0].split(".")[0])
