"""Edges a review of the gRPC channel found, each on a real grpc.aio server on 127.0.0.1.

* A unary call cancelled before anyone awaited it gives its replay buffer back.
* A call whose awaiting task is cancelled in the backoff is cancelled: its readers
  say CANCELLED instead of raising CancelledError in tasks nobody cancelled.
* A hedged call that ends on a fatal status after hedges went out carries sdkcore's
  context of every hedge (``call_context``).
* A deadline reached while waiting to retry says how many attempts the channel sent.
* A call committed by its replay buffer says so, not "response headers received".
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402
from hedge_server import hedging_config  # noqa: E402

from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    call_context,
    insecure_channel,
    retry_controller,
)

pytestmark = pytest.mark.asyncio
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def slow_ok(request: bytes, context: Any, attempt: int) -> bytes:
    await asyncio.sleep(5)
    return b"ok"


async def always_unavailable(request: bytes, context: Any, attempt: int) -> bytes:
    await abort(context, UNAVAILABLE)
    return b""  # pragma: no cover - abort raises


async def test_a_call_cancelled_before_anyone_awaits_it_gives_its_buffer_back(
    server: Server,
) -> None:
    method = server.unary_unary("M", slow_ok)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            controller = retry_controller(ch)
            call = ch.unary_unary(method)(b"x" * 1000)
            await asyncio.sleep(0.1)
            assert controller.buffered_bytes == 1000
            call.cancel()
            assert await call.code() is grpc.StatusCode.CANCELLED
            await asyncio.sleep(0.05)  # the first attempt's done callbacks run
            assert controller.buffered_bytes == 0
            # cancelled before its first step, too
            other = ch.unary_unary(method)(b"y" * 500)
            other.cancel()
            await asyncio.sleep(0.1)
            assert controller.buffered_bytes == 0


async def test_a_call_whose_awaiting_task_is_cancelled_in_the_backoff_is_cancelled(
    server: Server,
) -> None:
    method = server.unary_unary("U", always_unavailable)
    cfg = retry_config(max_attempts=5, initial="3s", maximum="3s", multiplier=1)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(  # a backoff of 2.4-3.6 s: the task is cut inside it
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            call = ch.unary_unary(method)(b"x")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(call, 0.3)  # cancels the awaiting task in the backoff
            assert call.done()
            assert call.cancelled()
            # read from a task nobody cancelled: answers, never raises CancelledError
            assert await call.code() is grpc.StatusCode.CANCELLED
            assert await call.details()
            assert retry_controller(ch).buffered_bytes == 0
    assert server.count("U") == 1


async def test_a_fatal_status_after_hedges_carries_the_context_of_every_hedge(
    server: Server,
) -> None:
    seen: list[int] = []

    async def first_hangs_second_fatal(request: bytes, context: Any, attempt: int) -> bytes:
        seen.append(attempt)
        if attempt == 1:
            await asyncio.sleep(5)
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT)
        return b""  # pragma: no cover

    method = server.unary_unary("H", first_hangs_second_fatal)
    cfg = hedging_config(max_attempts=3, delay="0.05s", non_fatal=("UNAVAILABLE",))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    context = call_context(info.value)
    assert context is not None, "a fatal status after hedges has sdkcore's context"
    assert context.extra["grpc_status"] == "INVALID_ARGUMENT"
    assert context.extra["hedges_sent"] == context.extra["grpc_attempts"] == 2
    assert len(seen) == 2


async def test_the_first_hedges_fatal_status_is_grpcs_error_unchanged(server: Server) -> None:
    async def fatal(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT)
        return b""  # pragma: no cover

    method = server.unary_unary("F", fatal)
    cfg = hedging_config(max_attempts=3, delay="1s", non_fatal=None)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert call_context(info.value) is None  # no hedge went out: no retry decision


async def test_a_deadline_in_the_backoff_says_how_many_attempts_were_sent(
    server: Server,
) -> None:
    method = server.unary_unary("D", always_unavailable)
    cfg = retry_config(max_attempts=5, initial="0.2s", maximum="0.2s", multiplier=1)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(  # backoffs of 0.16-0.24 s: the deadline comes in one
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=0.5)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    context = call_context(info.value)
    assert context is not None
    assert context.extra["grpc_attempts"] == server.count("D")
    assert context.extra["grpc_status"] == "UNAVAILABLE"


async def test_a_call_committed_by_its_replay_buffer_says_so(server: Server) -> None:
    method = server.unary_unary("B", always_unavailable)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), per_call_buffer_limit=10
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x" * 18)
    assert server.count("B") == 1  # committed: not retried
    context = call_context(info.value)
    assert context is not None
    because = context.extra.get("not_retried_because") or ""
    assert "replay buffer" in because, context
    assert "headers" not in because
