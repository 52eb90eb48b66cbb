"""The retry budget on a real outage: attempts stay near first attempts plus the reserve."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from fault_proxy import FaultProxy
from memcached_server import Memcached

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CouchbaseException,
    RequestCanceledException,
    RetryBudget,
    RetryOrchestrator,
)
from sdkcore.examples.memcached import MemcachedClient, SyncMemcachedClient, endpoint_down

pytestmark = pytest.mark.anyio

REQUESTS = 100
RESERVE = 10  # min_retries_per_sec=1 over ttl=10 s
PERCENT = 0.2


def no_breaker(name: str) -> CircuitBreaker:
    """A breaker that never trips, so that only the budget limits the retries."""
    return CircuitBreaker(name=name, is_failure=endpoint_down, volume_threshold=10**9)


def orchestrator(budget: RetryBudget | None) -> RetryOrchestrator:
    kwargs: dict[str, Any] = {} if budget is None else {"retry_budget": budget}
    return RetryOrchestrator(BestEffortRetryStrategy(), **kwargs)


async def outage_attempts(
    memcached: Memcached, proxy: FaultProxy, budget: RetryBudget | None
) -> tuple[int, list[CouchbaseException]]:
    failures: list[CouchbaseException] = []
    memcached.kill()
    proxy.reset_counts()
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=orchestrator(budget),
        timeout=1.0,  # room for many retries on a loaded machine (0.3 s gave too few)
        breaker=no_breaker,
    ) as client:

        async def one(i: int) -> None:
            try:
                await client.get(f"k{i}")
            except CouchbaseException as exc:
                failures.append(exc)

        with anyio.fail_after(30):  # a safety net
            async with anyio.create_task_group() as tg:
                for i in range(REQUESTS):
                    tg.start_soon(one, i)
    _, _, requests = proxy.counts()
    return sum(requests.values()), failures  # pipelined: frames, not connections


async def test_total_outage_attempts_stay_within_the_budget(
    memcached: Memcached, proxy: FaultProxy
) -> None:
    budget = RetryBudget(ttl=10, min_retries_per_sec=1, retry_ratio=PERCENT)
    attempts, failures = await outage_attempts(memcached, proxy, budget)
    assert len(failures) == REQUESTS
    assert attempts <= REQUESTS * (1 + PERCENT) + RESERVE + 1
    exhausted = [
        f
        for f in failures
        if isinstance(f, RequestCanceledException)
        and f.context is not None
        and getattr(f.context.cancellation_reason, "name", "") == "RETRY_BUDGET_EXHAUSTED"
    ]
    assert exhausted, "refused withdrawals end requests with RETRY_BUDGET_EXHAUSTED"
    assert all(f.context is not None and f.context.last_error for f in exhausted)


async def test_without_the_budget_retries_multiply(memcached: Memcached, proxy: FaultProxy) -> None:
    attempts, _ = await outage_attempts(memcached, proxy, None)
    assert attempts > REQUESTS * (1 + PERCENT) + RESERVE + 1


async def test_breaker_refusals_do_not_withdraw(memcached: Memcached, proxy: FaultProxy) -> None:
    budget = RetryBudget(ttl=10, min_retries_per_sec=1, retry_ratio=0)
    breaker: Callable[[str], CircuitBreaker] = lambda name: CircuitBreaker(  # noqa: E731
        name=name, is_failure=endpoint_down, volume_threshold=1, sleep_window=60
    )
    memcached.kill()
    async with MemcachedClient(
        f"127.0.0.1:{proxy.port}", orchestrator=orchestrator(budget), timeout=0.3, breaker=breaker
    ) as client:
        with pytest.raises(CouchbaseException):
            await client.get("k")  # trips the breaker; refusals follow until the deadline
    assert budget.balance >= RESERVE - 1  # at most the one re-send after the trip


def test_sync_door_outage_within_the_budget(memcached: Memcached, proxy: FaultProxy) -> None:
    budget = RetryBudget(ttl=10, min_retries_per_sec=1, retry_ratio=PERCENT)
    memcached.kill()
    proxy.reset_counts()
    with SyncMemcachedClient(
        f"127.0.0.1:{proxy.port}",
        orchestrator=orchestrator(budget),
        timeout=0.2,
        breaker=no_breaker,
    ) as client:
        for i in range(30):
            with pytest.raises(CouchbaseException):
                client.get(f"k{i}")
    _, _, requests = proxy.counts()
    assert sum(requests.values()) <= 30 * (1 + PERCENT) + RESERVE + 1
