"""What a refusal or a timeout tells the operator in its exception, its context and its
event: the strategy's own reason for refusing, the retry budget that refused, and the
strategy that answered (rfc/0001, "Log events")."""

from __future__ import annotations

import pytest

from sdkcore import (
    BestEffortRetryStrategy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryAction,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio

TEMP = RetryReason.KV_TEMPORARY_FAILURE


async def always_fails(_: Request) -> None:
    raise RetryableError(TEMP)


class NoRobots(BestEffortRetryStrategy):
    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.no_retry(why="robots are not retried")


async def test_a_strategys_reason_for_refusing_is_in_the_exception_and_its_context() -> None:
    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator(NoRobots()).execute(Request(idempotent=True), always_fails)
    assert "NoRobots declined to retry after KV_TEMPORARY_FAILURE: robots are not retried" in (
        str(info.value)
    )
    assert info.value.context is not None
    assert info.value.context.extra["detail"] == "robots are not retried"
    (event,) = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["detail"] == "robots are not retried"


async def test_a_budget_refusal_names_the_budget() -> None:
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0.0, name="cluster-a")
    orchestrator = RetryOrchestrator(retry_budget=budget)
    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await orchestrator.execute(Request(idempotent=True), always_fails)
    assert "the retry budget 'cluster-a' is exhausted" in str(info.value)
    assert info.value.context is not None
    assert info.value.context.extra["budget"] == "cluster-a"
    (event,) = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["budget"] == "cluster-a"
    assert event["why"] == "retry_budget_exhausted"


async def test_an_unnamed_budgets_refusal_reads_as_before() -> None:
    orchestrator = RetryOrchestrator(
        retry_budget=RetryBudget(min_retries_per_sec=0, retry_ratio=0.0)
    )
    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await orchestrator.execute(Request(idempotent=True), always_fails)
    assert "not retried: the retry budget is exhausted" in str(info.value)
    (event,) = [e for e in events if e["event"] == "retry.not_retried"]
    assert "budget" not in event


async def test_a_timeouts_context_names_the_strategy() -> None:
    with pytest.raises(UnambiguousTimeoutException) as info:
        await RetryOrchestrator().execute(Request(idempotent=True, timeout=0.02), always_fails)
    assert info.value.context is not None
    assert info.value.context.strategy == "FastFailOnTerminalErrorRetryStrategy"
    assert '"strategy": "FastFailOnTerminalErrorRetryStrategy"' in str(info.value)
