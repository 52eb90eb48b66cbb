"""Server-, client- and bidi-streaming calls: retry before commit, replay, commit rules."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import HEADERS_FLUSH, TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402

from sdkcore.grpc import insecure_channel, previous_rpc_attempts, retry_controller  # noqa: E402

pytestmark = pytest.mark.asyncio
ABORTED = grpc.StatusCode.ABORTED
PREV = "grpc-previous-rpc-attempts"


async def collect(call: Any) -> list[bytes]:
    return [m async for m in call]


async def drain_into(call: Any, got: list[bytes]) -> None:
    async for m in call:
        got.append(m)


async def test_server_streaming_retried_before_first_message(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        if attempt == 1:
            await abort(context, ABORTED)
        for i in range(3):
            yield request + str(i).encode()

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            assert await collect(call) == [b"m0", b"m1", b"m2"]
            assert await call.code() is grpc.StatusCode.OK
            assert await previous_rpc_attempts(call) == 1
    assert server.count("S") == 2
    assert server.attempts["S"][1][PREV] == "1"


async def test_server_streaming_read_api(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        if attempt == 1:
            await abort(context, ABORTED)
        yield b"only"

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            assert await call.read() == b"only"
            assert await call.read() is aio.EOF
    assert server.count("S") == 2


async def test_retry_recv_message_commits(server: Server) -> None:
    """retry_recv_message.cc: once a response message arrived, a later failure is final."""

    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"first"
        await abort(context, ABORTED)

    method = server.unary_stream("S", fn)
    got: list[bytes] = []
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            with pytest.raises(aio.AioRpcError) as info:
                await drain_into(call, got)
    assert got == [b"first"]
    assert info.value.code() is ABORTED
    assert server.count("S") == 1


async def test_server_streaming_headers_commit(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        await context.send_initial_metadata((("x-h", "1"),))
        await asyncio.sleep(HEADERS_FLUSH)  # see HEADERS_FLUSH
        await abort(context, ABORTED)
        yield b""

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            md = await call.initial_metadata()
            assert ("x-h", "1") in tuple(md)
            with pytest.raises(aio.AioRpcError):
                await collect(call)
            assert await call.code() is ABORTED
    assert server.count("S") == 1


async def read_all(requests: AsyncIterator[bytes]) -> list[bytes]:
    return [r async for r in requests]


async def test_client_streaming_replay(server: Server) -> None:
    seen: list[list[bytes]] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        msgs = await read_all(requests)
        seen.append(msgs)
        if attempt == 1:
            await abort(context, ABORTED)
        return b"|".join(msgs)

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_unary(method)(iter([b"a", b"b", b"c"]))
            assert await call == b"a|b|c"
            assert await previous_rpc_attempts(call) == 1
            assert retry_controller(ch).buffered_bytes == 0
    assert seen == [[b"a", b"b", b"c"], [b"a", b"b", b"c"]]
    assert server.attempts["C"][1][PREV] == "1"


async def test_client_streaming_replay_with_write_api(server: Server) -> None:
    seen: list[list[bytes]] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        msgs = await read_all(requests)
        seen.append(msgs)
        if attempt == 1:
            await abort(context, ABORTED)
        return b"".join(msgs)

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_unary(method)()
            await call.write(b"x")
            await call.write(b"y")
            await call.done_writing()
            assert await call == b"xy"
    assert seen == [[b"x", b"y"], [b"x", b"y"]]


async def test_client_streaming_buffer_overflow_commits(server: Server) -> None:
    seen: list[list[bytes]] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        seen.append(await read_all(requests))
        await abort(context, ABORTED)
        return b""

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), per_call_buffer_limit=4
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.stream_unary(method)(iter([b"aaa", b"bbb", b"ccc"]))
            assert retry_controller(ch).buffered_bytes == 0
    assert info.value.code() is ABORTED
    # The committed attempt still got every message, in order; no retry followed.
    assert seen == [[b"aaa", b"bbb", b"ccc"]]


async def test_bidi_retried_before_first_response(server: Server) -> None:
    async def fn(
        requests: AsyncIterator[bytes], context: Any, attempt: int
    ) -> AsyncIterator[bytes]:
        if attempt == 1:
            # Read every request before failing: aborting while the client still
            # writes can end the call with INTERNAL in grpcio itself (a transport race).
            async for _ in requests:
                pass
            await abort(context, ABORTED)
        async for r in requests:
            yield r.upper()

    method = server.stream_stream("B", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_stream(method)(iter([b"a", b"b"]))
            assert await collect(call) == [b"A", b"B"]
    assert server.count("B") == 2


async def test_bidi_commits_after_first_response(server: Server) -> None:
    async def fn(
        requests: AsyncIterator[bytes], context: Any, attempt: int
    ) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r
            break
        await abort(context, ABORTED)

    method = server.stream_stream("B", fn)
    got: list[bytes] = []
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_stream(method)()
            await call.write(b"one")
            with pytest.raises(aio.AioRpcError):
                await drain_into(call, got)
            assert await call.code() is ABORTED
    assert got == [b"one"]
    assert server.count("B") == 1


async def test_streaming_cancel(server: Server) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        started.set()
        with anyio.move_on_after(TEST_TIMEOUT):
            await release.wait()
        yield b"late"

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            await started.wait()
            assert call.cancel()
            assert await call.code() is grpc.StatusCode.CANCELLED
            assert call.cancelled()
            release.set()
    assert server.count("S") == 1
