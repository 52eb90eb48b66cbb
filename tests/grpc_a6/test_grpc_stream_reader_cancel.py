"""A streaming call whose reading task is cancelled is cancelled with it, in every turn.

grpc.aio runs a channel's interceptors in a task of their own, and the application's first
read awaits it (``InterceptedUnaryStreamCall``). A cancellation of the reading task that
lands as that task completes raises in the application and reaches no call object: the
RPC runs on until its deadline or the channel's close. Plain grpc.aio with a no-op
interceptor does the same. The channel helpers' streaming calls were sdkcore interceptors'
calls, so they shared it (the gRPC fuzz's seed 19, under CPU load, 1 run in about 200);
they are now sdkcore's call objects, handed to the application directly (rfc/0003). A
channel built by hand with ``RetryController.interceptors()`` still goes through grpc.aio's
interceptor task: that limit stays there (strict xfail below).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("grpc")
from grpc import aio
from grpc_server import TEST_TIMEOUT, Server

from sdkcore.grpc import RetryController, insecure_channel

pytestmark = pytest.mark.asyncio

CONFIG = (
    '{"methodConfig": [{"name": [{"service": "test.Svc"}], "retryPolicy": {"maxAttempts": 3,'
    ' "initialBackoff": "0.01s", "maxBackoff": "0.01s", "backoffMultiplier": 2,'
    ' "retryableStatusCodes": ["UNAVAILABLE"]}}]}'
)
#: Loop turns between making the call and cancelling its reader (on a connected channel):
#: the turn the attempt task first runs, the attempt's call made, its request sent, the
#: server's handler started (within about 6 turns here).
TURNS = range(16)


class Seen:
    """What the server saw of each call (its request, or first message, names it)."""

    def __init__(self) -> None:
        self.started: set[bytes] = set()
        self.cancelled: set[bytes] = set()

    async def hold(self, key: bytes) -> None:
        self.started.add(key)
        try:
            await asyncio.sleep(TEST_TIMEOUT)
        except asyncio.CancelledError:
            self.cancelled.add(key)
            raise

    async def settled(self) -> None:
        """0.3 s for a late call to reach the server, then until every call that reached
        it is cancelled there (2 s at most)."""
        await asyncio.sleep(0.3)
        for _ in range(200):
            if self.started <= self.cancelled:
                return
            await asyncio.sleep(0.01)


def methods(server: Server, seen: Seen) -> dict[str, str]:
    async def unary_stream(request: bytes, context: Any, n: int) -> AsyncIterator[bytes]:
        await seen.hold(request)
        yield b""

    async def stream_unary(requests: AsyncIterator[bytes], context: Any, n: int) -> bytes:
        async for first in requests:
            await seen.hold(first)
        return b""

    async def stream_stream(
        requests: AsyncIterator[bytes], context: Any, n: int
    ) -> AsyncIterator[bytes]:
        async for first in requests:
            await seen.hold(first)
        yield b""

    return {
        "unary_stream": server.unary_stream("US", unary_stream),
        "stream_unary": server.stream_unary("SU", stream_unary),
        "stream_stream": server.stream_stream("SS", stream_stream),
    }


def reading(channel: Any, shape: str, method: str, key: bytes) -> Callable[[], Any]:
    """Make the call; return how the application reads it."""
    if shape == "unary_stream":
        call = channel.unary_stream(method)(key)
    else:

        async def requests() -> AsyncIterator[bytes]:
            yield key
            await asyncio.sleep(TEST_TIMEOUT)  # the stream stays open

        call = getattr(channel, shape)(method)(requests())
    if shape == "stream_unary":
        return lambda: call
    return lambda: call.read()


def cancel_after(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], turns: int) -> None:
    if turns == 0:
        task.cancel()
    else:
        loop.call_soon(cancel_after, loop, task, turns - 1)


async def run(channel: Any, shape: str, method: str, key: bytes, turns: int) -> asyncio.Task[Any]:
    """The reading task, cancelled ``turns`` loop turns after it made the call. Returned:
    the caller keeps it (and so the call) alive, so that no garbage collection of the call
    object cancels what the reader's cancellation did not."""
    loop = asyncio.get_running_loop()

    async def reader() -> Any:
        read = reading(channel, shape, method, key)
        task = asyncio.current_task()
        assert task is not None
        loop.call_soon(cancel_after, loop, task, turns)
        return await read()

    task = loop.create_task(reader())
    with pytest.raises(asyncio.CancelledError):
        await task
    return task


@pytest.mark.parametrize("shape", ["unary_stream", "stream_unary", "stream_stream"])
async def test_a_stream_whose_reader_is_cancelled_in_any_turn_is_cancelled(
    server: Server, shape: str
) -> None:
    """The reading task cancelled 0 to 15 loop turns after the call was made, then once the
    server runs it: each call either never reached the server or was cancelled there (none
    runs on)."""
    seen = Seen()
    method = methods(server, seen)[shape]
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=CONFIG) as channel:
            await channel.channel_ready()
            tasks = [
                await run(channel, shape, method, f"{shape}-{turns}".encode(), turns)
                for turns in TURNS
            ]
            # and once the server runs the call for sure (the sweep's cuts may all land
            # before the server's handler starts: each is then a call that never ran)
            key = f"{shape}-served".encode()
            loop = asyncio.get_running_loop()
            read = reading(channel, shape, method, key)

            async def reader() -> Any:
                return await read()

            task = loop.create_task(reader())
            while key not in seen.started:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await seen.settled()
            assert sorted(seen.started - seen.cancelled) == []  # none runs on
            assert key in seen.cancelled
            del task, tasks


@pytest.mark.xfail(
    strict=True,
    reason="rfc/0003: a channel built by hand goes through grpc.aio's interceptor task",
)
async def test_on_a_hand_built_channel_a_reader_cancelled_as_the_call_is_handed_over(
    server: Server,
) -> None:
    """The known limit, forced: the reading task cancelled right after grpc.aio's
    interceptor task's step, at the await of a task that just completed."""
    seen = Seen()
    method = methods(server, seen)["unary_stream"]
    controller = RetryController(server.target, CONFIG)
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(
            server.target,
            options=controller.channel_options(),
            interceptors=controller.interceptors(),
        ) as channel:
            await channel.channel_ready()
            task = await run(channel, "unary_stream", method, b"k", 0)
            await seen.settled()
            del task
            assert seen.started == {b"k"}  # the interleaving was forced: the RPC went out
            assert seen.cancelled == {b"k"}  # ... and was cancelled with its reader
