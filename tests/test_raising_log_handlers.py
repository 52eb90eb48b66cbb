"""A log handler (or a structlog processor) that raises as sdkcore logs a retry: the door
raises its error, and the request still ends as any request that raised does, with what
its retry paid given back. Logging is the application's code; its failure must not leave
a request pending for ever (it could neither be completed nor sent again) nor keep a
retry budget's token for a retry that was never sent."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import structlog

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    Request,
    RequestState,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
)

pytestmark = pytest.mark.anyio


def _raising(event: str, error: BaseException) -> Iterator[None]:
    """structlog configured with a processor that raises ``error`` on ``event``."""

    def processor(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        if event_dict.get("event") == event:
            raise error
        raise structlog.DropEvent

    structlog.configure(processors=[processor], cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.reset_defaults()


@pytest.fixture
def raising_on_scheduled(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from _raising("retry.scheduled", request.param)


@pytest.fixture
def raising_on(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from _raising(*request.param)


def budget() -> RetryBudget:
    return RetryBudget(ttl=10, min_retries_per_sec=1, retry_ratio=0.0)  # a reserve of 10


def send_fails(request: Request) -> str:
    raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)  # reached the server: a retry pays


@pytest.mark.parametrize(
    ("raising_on_scheduled", "door", "state"),
    [
        (RuntimeError("the handler broke"), "execute", RequestState.FAILED),
        (RuntimeError("the handler broke"), "execute_sync", RequestState.FAILED),
        (KeyboardInterrupt(), "execute_sync", RequestState.CANCELLED),
    ],
    indirect=["raising_on_scheduled"],
    ids=["execute", "execute_sync", "execute_sync-interrupt"],
)
async def test_the_request_ends_and_the_unsent_retry_is_refunded(
    raising_on_scheduled: None, door: str, state: RequestState
) -> None:
    shared = budget()
    before = shared.balance
    orch = RetryOrchestrator(BestEffortRetryStrategy(), retry_budget=shared)
    request = Request(idempotent=True, timeout=5.0)
    sent = []

    def send(r: Request) -> str:
        sent.append(1)
        return send_fails(r)

    async def send_async(r: Request) -> str:
        return send(r)

    async def run() -> str:
        if door == "execute":
            return await orch.execute(request, send_async)
        return orch.execute_sync(request, send)

    with pytest.raises((RuntimeError, KeyboardInterrupt)):
        await run()
    assert sent == [1]
    assert request.state is state  # was PENDING on the sync door after a RuntimeError
    assert shared.balance == before  # the withdrawal for the retry that never went out
    assert orch.requests_in_retry == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "raising_on", [("breaker.half_open", RuntimeError("the handler broke"))], indirect=True
)
def test_a_breaker_whose_probe_grant_could_not_be_logged_lets_the_next_dispatch_probe(
    raising_on: None,
) -> None:
    """The probe was granted, then its event raised: nothing was sent. Held, the probe cut
    the endpoint off until canary_timeout, then reopened the breaker for a probe that never
    went."""
    clock = Clock()
    breaker = CircuitBreaker(
        volume_threshold=1, sleep_window=5.0, canary_timeout=2.0, clock=clock, name="node1"
    )
    breaker.record_failure(TimeoutError("no answer"))
    assert breaker.state is CircuitState.OPEN
    clock.now += 6.0  # the sleep window is over: the next dispatch is the probe
    with pytest.raises(RuntimeError), breaker.guard():
        pass  # never runs: the grant's event raised
    assert breaker.state is CircuitState.HALF_OPEN
    with breaker.guard() as state:  # not refused "a probe is out"
        assert state is CircuitState.HALF_OPEN
    assert breaker.state is CircuitState.CLOSED


@pytest.mark.parametrize(
    "raising_on", [("budget.recovered", RuntimeError("the handler broke"))], indirect=True
)
def test_a_budget_whose_recovery_could_not_be_logged_keeps_the_retry_it_granted(
    raising_on: None,
) -> None:
    clock = Clock()
    shared = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    assert not shared.try_withdraw()  # empty: an exhaustion episode starts
    shared.deposit()
    clock.now += 2.0  # a quiet second after the refusal: the next grant ends the episode
    with pytest.raises(RuntimeError):
        shared.try_withdraw()  # granted, then its budget.recovered event raised
    assert shared.balance == 1  # the door sends no retry for it: given back
