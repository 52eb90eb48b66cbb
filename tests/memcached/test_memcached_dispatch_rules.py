"""The dispatch rules the memcached example shares between its clients (no server needed)."""

from __future__ import annotations

import asyncio

import pytest

from sdkcore import (
    CircuitBreaker,
    DocumentNotFoundException,
    RetryableError,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.examples.memcached import endpoint_down, refuse_if_open
from sdkcore.examples.memcached._endpoint import endpoints_of, parse_address


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_refuse_if_open_is_the_guard() -> None:
    clock = Clock()
    breaker = CircuitBreaker(name="h:1", volume_threshold=1, sleep_window=1.0, clock=clock)
    assert refuse_if_open(breaker) is False  # closed: go, not a probe
    breaker.record_failure(TimeoutError())
    with pytest.raises(RetryableError, match="circuit breaker h:1 is OPEN: nothing") as caught:
        refuse_if_open(breaker)
    assert caught.value.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    clock.now += 1.0
    assert refuse_if_open(breaker) is True  # the probe
    with pytest.raises(RetryableError, match="circuit breaker h:1 is HALF_OPEN: nothing"):
        refuse_if_open(breaker)  # the probe is out: said so, not "open"


@pytest.mark.parametrize(
    ("error", "down"),
    [
        (TimeoutError(), True),
        (asyncio.TimeoutError(), True),
        (UnambiguousTimeoutException(), True),
        (ConnectionRefusedError(), True),
        (ConnectionResetError(), True),
        (DocumentNotFoundException(), False),
        (ValueError("bad frame"), False),
    ],
)
def test_endpoint_down(error: BaseException, down: bool) -> None:
    assert endpoint_down(error) is down


def test_addresses() -> None:
    assert parse_address("127.0.0.1:11211") == ("127.0.0.1", 11211)
    assert parse_address(("::1", 5)) == ("::1", 5)
    assert endpoints_of("a:1") == [("a", 1)]
    for bad in ("nohost", "h:0", "h:port", ":11211"):
        with pytest.raises(ValueError, match="host:port"):
            parse_address(bad)
    with pytest.raises(TypeError):
        parse_address(11211)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        endpoints_of([])
