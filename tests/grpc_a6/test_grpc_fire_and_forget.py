"""What a grpcio user finds when switching: sdkcore unary calls behave as grpc.aio's.

On a real grpc.aio server on 127.0.0.1 (a grpcio veteran's side-by-side review).
A unary call nobody reads (fire and forget) that fails logs nothing: its retry loop (or
hedge runner) ran in a task whose exception nobody retrieved, and asyncio logged "Task
exception was never retrieved" at ERROR when the task was collected, for every such call
on a method with a retryPolicy, a hedgingPolicy or retryThrottling. A unary call
cancelled in its backoff reads empty metadata (it read None).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    Server,
    abort,
    cancel_while_waiting_to_retry,
    retry_config,
    wait_until,
)

from sdkcore.grpc import insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio

CONFIGS = {
    "retryPolicy": retry_config(),
    "hedgingPolicy": json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": "test.Svc"}],
                    "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "0.01s"},
                }
            ]
        }
    ),
    "retryThrottling": json.dumps(
        {
            "methodConfig": [{"name": [{"service": "test.Svc"}]}],
            "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
        }
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
async def test_a_failed_call_nobody_reads_logs_nothing(server: Server, config: str) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT)
        return b""

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=CONFIGS[config]) as ch:
            call = ch.unary_unary(method)(b"x", timeout=5)  # never awaited nor read
            # (not call.done(): a reader, which reads the exception)
            await wait_until(lambda: call._driver is not None and call._driver.done())
            driver = call._driver  # the task that ran the call's retry loop or hedges
            await asyncio.sleep(0)  # its done callbacks ran
    assert server.count("M") >= 1
    # What asyncio's Task checks when it is collected: True, its exception was never read,
    # and it logs "Task exception was never retrieved" at ERROR (the loop's handler).
    assert driver._log_traceback is False
    assert isinstance(driver.exception(), grpc.aio.AioRpcError)  # (read here: after the check)


@pytest.mark.parametrize("how", ["call.cancel()", "channel.close()"])
async def test_a_unary_call_cancelled_in_its_backoff_reads_empty_metadata(
    server: Server, how: str
) -> None:
    """As a cancelled grpc.aio unary call's readers: empty Metadata, not None (code that
    does ``dict(await call.trailing_metadata())`` raised TypeError)."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, grpc.StatusCode.UNAVAILABLE)
        return b""

    method = server.unary_unary("M", fn)
    call = await cancel_while_waiting_to_retry(server, method, how)
    with anyio.fail_after(TEST_TIMEOUT):
        assert await call.code() == grpc.StatusCode.CANCELLED
        assert await call.initial_metadata() == grpc.aio.Metadata()
        assert await call.trailing_metadata() == grpc.aio.Metadata()
