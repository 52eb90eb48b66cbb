"""A retried gRPC call cut in flight by its caller is reported as a core door reports it.

On a real grpc.aio server on 127.0.0.1: attempt 1 fails UNAVAILABLE (retried at once),
attempt 2 hangs until the client cancels it. The cancellation, by the awaiting task or
by ``call.cancel()``, on every call shape the channel has (a unary call awaited or only
read, one through an application interceptor, a response stream), ends the call's
request: the cut attempt is booked maybe applied and ``retry.cancelled`` is logged
(TASK_CANCELLED for the task's, CANCELLED_VIA_CONTEXT for ``call.cancel()``'s), as the
core doors report a cancellation (rfc/0003, "Cancellation"). Before, the request stayed
pending and the log ended with ``retry.scheduled``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    Passthrough,
    Server,
    abort,
    config_json,
    retry_config,
    wait_until,
)

from sdkcore.grpc import insecure_channel  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _hangs(release: asyncio.Event) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await release.wait()
        return b"late"

    return fn


def _second_hangs(release: asyncio.Event) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt == 1:
            await abort(context, UNAVAILABLE)
        await release.wait()
        return b"late"

    return fn


def _second_hangs_stream(release: asyncio.Event) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        if attempt == 1:
            await abort(context, UNAVAILABLE)
        await release.wait()
        yield b"late"

    return fn


def _cancelled(events: list[Any]) -> list[dict[str, Any]]:
    return [dict(e) for e in events if e["event"] == "retry.cancelled"]


CASES = [
    ("awaited", "task"),
    ("awaited", "call.cancel()"),
    # Read through code() only: the loop runs in a task of the channel's; a reader's
    # cancellation leaves the call running (as grpc.aio's), so only call.cancel() cuts it.
    ("read only", "call.cancel()"),
    ("interceptor", "task"),
    ("interceptor", "call.cancel()"),
    ("response stream", "task"),
    ("response stream", "call.cancel()"),
]


@pytest.mark.parametrize(("shape", "by"), CASES)
async def test_a_retried_attempt_cut_by_the_caller_is_logged_and_booked(
    server: Server, shape: str, by: str
) -> None:
    release = asyncio.Event()
    if shape == "response stream":
        method = server.unary_stream("M", _second_hangs_stream(release))
    else:
        method = server.unary_unary("M", _second_hangs(release))
    interceptors = [Passthrough()] if shape == "interceptor" else None
    cfg = retry_config(initial="0.001s", maximum="0.001s")
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=cfg, interceptors=interceptors
        ) as ch:
            if shape == "response stream":
                call = ch.unary_stream(method)(b"x")

                async def read() -> Any:
                    return [m async for m in call]

                pending = asyncio.ensure_future(read())
            else:
                call = ch.unary_unary(method)(b"x")
                if shape == "read only":
                    pending = asyncio.ensure_future(call.code())
                else:
                    pending = asyncio.ensure_future(call)
            await wait_until(lambda: server.count("M") == 2)
            await asyncio.sleep(0.05)  # the second attempt is in flight, hanging
            assert _cancelled(events) == []
            if by == "task":
                pending.cancel()
            else:
                assert call.cancel()
            if shape == "read only":
                assert await pending == grpc.StatusCode.CANCELLED
            else:
                with pytest.raises(asyncio.CancelledError):
                    await pending
            release.set()
            await wait_until(lambda: bool(_cancelled(events)))
    assert server.count("M") == 2  # nothing sent after the cancellation
    [event] = _cancelled(events)
    assert event["attempt"] == 2  # the cut attempt is booked: two attempts
    assert event["in_flight"] is True
    assert event["maybe_applied"] is True
    expected = "CANCELLED_VIA_CONTEXT" if by == "call.cancel()" else "TASK_CANCELLED"
    assert event["cancellation_reason"] == expected
    scheduled = [e for e in events if e["event"] == "retry.scheduled"]
    assert len(scheduled) == 1


async def test_a_call_cut_on_its_first_attempt_logs_nothing(server: Server) -> None:
    """Never retried: no request, no retry event (as before), whatever cuts it."""
    release = asyncio.Event()
    method = server.unary_unary("M", _hangs(release))
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            pending = asyncio.ensure_future(ch.unary_unary(method)(b"x"))
            await wait_until(lambda: server.count("M") == 1)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            release.set()
    assert list(events) == []


def _hedging(delay: str, attempts: int = 3) -> str:
    mc = {
        "name": [{"service": "test.Svc"}],
        "hedgingPolicy": {"maxAttempts": attempts, "hedgingDelay": delay},
    }
    return config_json(mc, timeout=None, throttling=None)


async def test_a_hedged_call_cancelled_with_hedges_out_logs_it(server: Server) -> None:
    """call.cancel() of a hedged call with three hedges in flight logged only their
    hedge.cancelled: the request's own retry.cancelled was missing (the core door logs it)."""
    release = asyncio.Event()
    method = server.unary_unary("M", _hangs(release))
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=_hedging("0.01s")) as ch:
            call = ch.unary_unary(method)(b"x")
            pending = asyncio.ensure_future(call)
            await wait_until(lambda: server.count("M") == 3)
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            release.set()
    [event] = _cancelled(events)
    assert event["cancellation_reason"] == "CANCELLED_VIA_CONTEXT"
    assert event["in_flight"] is True


async def test_hedge_won_elapsed_counts_from_the_calls_start(server: Server) -> None:
    """On a channel the chain begins after the hedging delay (hedge 0 is the call's own
    first attempt): hedge.won's elapsed_ms left that delay out (1.5 ms for a call that
    took more than 50)."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt == 1:
            await asyncio.sleep(1.0)  # the first hedge is slow: the second wins
        return b"ok"

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=_hedging("0.05s", attempts=2)
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    [won] = [e for e in events if e["event"] == "hedge.won"]
    assert won["hedge"] == 1
    assert won["elapsed_ms"] >= 50.0


async def test_a_retried_stream_whose_request_iterator_raises_is_not_a_cancellation(
    server: Server,
) -> None:
    """The application's request iterator raised after a retry: the call ends cancelled,
    as grpc.aio's, but nobody cancelled it: no retry.cancelled (it said TASK_CANCELLED)."""
    retried = asyncio.Event()

    async def fn(requests: Any, context: Any, attempt: int) -> bytes:
        async for _ in requests:
            if attempt == 1:
                await abort(context, UNAVAILABLE)
            retried.set()
        return b"done"

    method = server.stream_unary("S", fn)

    async def source() -> Any:
        yield b"first"
        await retried.wait()
        raise ValueError("the application's source broke")

    cfg = retry_config(initial="0.001s", maximum="0.001s")
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=cfg) as ch:
            call = ch.stream_unary(method)(source())
            with pytest.raises(asyncio.CancelledError):
                await call
    assert server.count("S") == 2
    assert [e["event"] for e in events] == ["retry.scheduled"]
