"""No call on an sdkcore channel leaves its objects to the garbage collector.

A reference cycle per call makes every call's objects wait for a collection: CPU the
client pays (and pauses) that grpc.aio's own calls do not cost. The server runs in
this process, so only sdkcore's objects are counted (rfc/0003, "The direct path").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from gc_kit import sdkcore_garbage  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, retry_config  # noqa: E402

from sdkcore.grpc import insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio
CALLS = 30


async def ok(request: bytes, context: Any, attempt: int) -> bytes:
    return b"ok:" + request


async def fails_once(request: bytes, context: Any, attempt: int) -> bytes:
    if attempt % 2:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "first attempt fails")
    return b"ok:" + request


async def three(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
    for i in range(3):
        yield b"%d" % i


async def count(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
    return b"%d" % len([r async for r in requests])


async def echo_each(
    requests: AsyncIterator[bytes], context: Any, attempt: int
) -> AsyncIterator[bytes]:
    async for r in requests:
        yield r


@pytest.mark.parametrize("retried", [False, True], ids=["ok", "retried"])
async def test_a_unary_call_leaves_nothing_for_the_garbage_collector(
    server: Server, retried: bool
) -> None:
    """Each call left its call object, its state and, when retried, its Request to the
    collector while the state pointed back at the call object."""
    method = server.unary_unary("M", fails_once if retried else ok)
    cfg = retry_config(initial="0.001s", maximum="0.001s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            await ch.unary_unary(server.unary_unary("W", ok))(b"warm")

            async def call(i: int) -> None:
                assert await ch.unary_unary(method)(b"%d" % i) == b"ok:%d" % i

            left = await sdkcore_garbage(call, CALLS)
    assert server.count("M") == (2 * CALLS if retried else CALLS)
    assert left == []


async def test_streaming_calls_leave_nothing_for_the_garbage_collector(server: Server) -> None:
    """A streaming call kept grpc.aio's continuation, bound to grpc's intercepted call,
    whose task holds sdkcore's call as its result: four or five objects per call."""
    us = server.unary_stream("US", three)
    su = server.stream_unary("SU", count)
    ss = server.stream_stream("SS", echo_each)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            await ch.unary_unary(server.unary_unary("W", ok))(b"warm")

            async def unary_stream(i: int) -> None:
                assert [m async for m in ch.unary_stream(us)(b"x")] == [b"0", b"1", b"2"]

            async def stream_unary(i: int) -> None:
                assert await ch.stream_unary(su)(iter([b"a", b"b"])) == b"2"

            async def stream_stream(i: int) -> None:
                got = [m async for m in ch.stream_stream(ss)(iter([b"a", b"b"]))]
                assert got == [b"a", b"b"]

            left = {
                "unary_stream": await sdkcore_garbage(unary_stream, CALLS),
                "stream_unary": await sdkcore_garbage(stream_unary, CALLS),
                "stream_stream": await sdkcore_garbage(stream_stream, CALLS),
            }
    assert left == {"unary_stream": [], "stream_unary": [], "stream_stream": []}


async def test_a_hedged_methods_plans_are_freed_without_the_garbage_collector() -> None:
    """A hedging plan's one-copy variant (a request that does not fit the retry buffer is
    sent once, unhedged) pointed at itself: the plans of every hedged method were a
    reference cycle, left to the collector when the channel went (this file's unary test
    saw them collected during its calls, after a hedging test's channel)."""
    import gc
    import weakref

    from hedge_server import hedging_config

    from sdkcore.grpc import RetryController

    controller = RetryController("127.0.0.1:1", hedging_config())
    plan = controller.hedge_plan("/test.Svc/M")
    assert plan is not None
    single = plan.single()
    assert single.single() is single  # one copy already
    freed = [weakref.ref(plan.policy), weakref.ref(single.policy)]
    gc.disable()
    try:
        del plan, single, controller
        assert [ref() for ref in freed] == [None, None]
    finally:
        gc.enable()
