"""Deterministic regressions for what tests/grpc_a6/test_grpc_stream_fuzz.py found.

A stream-unary (client-streaming) call is committed once the client receives the response
headers (A6 "When Retries are Valid": "The client receives Response-Headers"), like the
other shapes (rfc/0003: "commit on response headers"). sdkcore's attempt loop awaits a
stream-unary attempt as a whole (``_RetryingCall._drive``: ``await call``) and never
looks at its headers while it runs: the call commits on them only if the attempt fails
(``_Call.failed``). Until then:

* ``initial_metadata()`` waits for the whole call (the answer), where grpc.aio returns the
  headers as they arrive: an application that reads them before it writes the rest of its
  requests waits for ever (until its deadline);
* the replay buffer keeps every request message, and keeps taking new ones, for a call
  that can no longer be retried (A6 "Memory Management": once committed, the messages
  already sent are freed and later ones are not buffered): the channel's budget
  (``retryBufferSize``) it holds costs other calls their retries.

Found by test_grpc_stream_fuzz.py: seeds 421 and 574 of a wider run (a stream-unary
call whose attempt sent headers and stalled; the application awaiting
``initial_metadata()`` got them only with the deadline's error), then its own seeds 2,
3, 4, 16, 19, 22, 37 and 38 (the replay buffer still takes a stream-unary call's
requests after its attempt's headers reached the client).

Each test knows the headers reached the client without a timer: an application
interceptor (it runs inside sdkcore's loop, once per attempt, rfc/0003) watches the
attempt's own grpc call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config, wait_until  # noqa: E402

from sdkcore.grpc import insecure_channel, retry_controller  # noqa: E402

pytestmark = pytest.mark.asyncio

ABORTED = grpc.StatusCode.ABORTED


class HeadersSeen(aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """Sets ``seen`` once an attempt's response headers (with metadata) reached the client."""

    def __init__(self) -> None:
        self.seen = asyncio.Event()
        self.watchers: list[asyncio.Task[None]] = []

    async def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        call = await continuation(details, request_iterator)

        async def watch() -> None:
            if await call.initial_metadata():
                self.seen.set()

        self.watchers.append(asyncio.ensure_future(watch()))
        return call


def headers_then_hold(server: Server, name: str, release: asyncio.Event, got: list[bytes]) -> str:
    """A stream-unary method: headers at once, then it reads every request, held by
    ``release`` after the first, and answers."""

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        await context.send_initial_metadata((("x-h", "1"),))
        async for r in requests:
            got.append(r)
            if len(got) == 1:
                await release.wait()
        return b"ok"

    return server.stream_unary(name, fn)


async def test_stream_unary_initial_metadata_returns_once_the_headers_arrive(
    server: Server,
) -> None:
    """grpc.aio returns a call's initial metadata when its headers arrive; an application
    may read them before it writes the rest of its requests."""
    release = asyncio.Event()
    got: list[bytes] = []
    method = headers_then_hold(server, "C", release, got)
    watcher = HeadersSeen()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), interceptors=[watcher]
        ) as ch:
            call = ch.stream_unary(method)()
            await call.write(b"a")
            await watcher.seen.wait()  # the attempt's headers are at the client
            try:
                with anyio.fail_after(2.0):
                    md = await call.initial_metadata()
            finally:
                release.set()
                await call.done_writing()
                assert await call == b"ok"
    assert ("x-h", "1") in tuple(md)


async def test_stream_unary_call_commits_on_headers_and_stops_buffering(server: Server) -> None:
    """A6: once the headers arrived the call is committed: the messages already sent are
    freed, and later ones go out without being buffered."""
    release = asyncio.Event()
    got: list[bytes] = []
    method = headers_then_hold(server, "C", release, got)
    watcher = HeadersSeen()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), interceptors=[watcher]
        ) as ch:
            controller = retry_controller(ch)
            call = ch.stream_unary(method)()
            await call.write(b"a" * 1000)
            await watcher.seen.wait()  # the attempt's headers are at the client
            release.set()
            await call.write(b"b" * 1000)
            await call.write(b"c" * 1000)
            await wait_until(lambda: len(got) == 3)  # every message went out
            held = controller.buffered_bytes
            await call.done_writing()
            assert await call == b"ok"
    assert held == 0, f"{held} bytes buffered for a call whose response headers arrived"


async def test_a_headers_committed_call_does_not_cost_another_call_its_retry(
    server: Server,
) -> None:
    """The channel's replay budget held for a committed stream-unary call makes another
    call's request not fit: that call is then not retried (A6 retryBufferSize) and fails,
    where it would be retried and answered."""
    release = asyncio.Event()
    got: list[bytes] = []
    committed = headers_then_hold(server, "C", release, got)

    async def flaky(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        async for _ in requests:
            pass
        if attempt == 1:
            await abort(context, ABORTED)
        return b"second"

    other = server.stream_unary("D", flaky)
    watcher = HeadersSeen()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=retry_config(),
            interceptors=[watcher],
            channel_buffer_limit=2500,
        ) as ch:
            call = ch.stream_unary(committed)()
            await call.write(b"a" * 1000)
            await watcher.seen.wait()  # committed: its 1000 bytes are no longer needed
            release.set()
            await call.write(b"b" * 1000)
            await wait_until(lambda: len(got) == 2)
            try:
                answer = await ch.stream_unary(other)(iter([b"d" * 1000]))
            finally:
                await call.done_writing()
                assert await call == b"ok"
    assert answer == b"second"
    assert server.count("D") == 2
