"""gRPC channels and endpoint protection: a shared retry budget, and pushback as the retry hint."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402

from sdkcore import (  # noqa: E402
    CancellationReason,
    RequestCanceledException,
    RetryBudget,
    RetryOrchestrator,
)
from sdkcore.grpc import call_context, insecure_channel  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def always_unavailable(trailing: tuple[tuple[str, str], ...] = ()) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, UNAVAILABLE, trailing=trailing)
        return b""

    return fn


async def test_a_channel_shares_a_retry_budget(server: Server) -> None:
    method = server.unary_unary("M", always_unavailable())
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=5), retry_budget=budget
        ) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    # the call's first attempt paid for one retry; the second retry was refused
    assert server.count("M") == 2
    assert info.value.code() is UNAVAILABLE  # grpc's own error, sdkcore's context under it
    cause = info.value.__cause__
    assert isinstance(cause, RequestCanceledException)
    context = call_context(info.value)
    assert context is not None
    assert context.cancellation_reason is CancellationReason.RETRY_BUDGET_EXHAUSTED
    assert budget.balance == 0


async def test_successful_calls_earn_retries(server: Server) -> None:
    ok = server.unary_unary("Ok", lambda request, context, attempt: _ok())
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=0.5)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), retry_budget=budget
        ) as ch:
            for _ in range(4):
                assert await ch.unary_unary(ok)(b"x") == b"ok"
    assert budget.balance == 2  # four first attempts at 0.5 retries each


async def _ok() -> bytes:
    return b"ok"


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_one_budget_for_the_channel_and_its_orchestrator() -> None:
    budget = RetryBudget()
    with pytest.raises(ValueError, match="retry budget"):
        insecure_channel(
            "127.0.0.1:1",
            orchestrator=RetryOrchestrator(retry_budget=RetryBudget()),
            retry_budget=budget,
        )
    with pytest.raises(TypeError, match="retry_budget"):
        insecure_channel("127.0.0.1:1", retry_budget=object())  # type: ignore[arg-type]


async def test_pushback_reaches_the_orchestrator_as_the_retry_hint(server: Server) -> None:
    method = server.unary_unary("P", always_unavailable((("grpc-retry-pushback-ms", "60000"),)))
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=2.0)
    # a pushback of 60 s ends past the 2 s deadline: the call ends at once, not in 2 s
    assert server.count("P") == 1
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    (timed_out,) = [e for e in events if e["event"] == "retry.timed_out"]
    assert timed_out["retry_after_ms"] == 60000.0
