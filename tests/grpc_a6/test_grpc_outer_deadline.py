"""A gRPC call made inside an sdkcore request's send never outlives that request.

Its deadline is the earlier of its own timeout and the outer request's time left,
and every attempt's ``grpc-timeout`` says so: the test server answers with
``context.time_remaining()``, what it read from the header. Without an outer
request nothing changes. grpc.aio is asyncio-only, hence no trio variants. The
bounds compare a 60 s timeout with a 2 s one: generous either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402
from hedge_server import hedging_config  # noqa: E402

from sdkcore import Request, RetryOrchestrator  # noqa: E402
from sdkcore.grpc import RetryController, call_context, insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio

OWN = 60.0  # the call's own timeout
OUTER = 2.0  # the outer request's
SLACK = 0.2  # grpc-timeout is rounded up to its unit


def remaining() -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        left = context.time_remaining()
        return b"none" if left is None else repr(left).encode()

    return fn


def seconds(reply: bytes) -> float | None:
    return None if reply == b"none" else float(reply)


def open_channel(server: Server, kind: str) -> Any:
    """A channel of each kind whose calls sdkcore handles differently."""
    if kind == "retried":
        return insecure_channel(server.target, service_config=retry_config())
    if kind == "hedged":
        return insecure_channel(server.target, service_config=hedging_config(delay="5s"))
    if kind == "not retried":  # grpc.aio's own multi-callable before
        return insecure_channel(server.target, retries_enabled=False)
    config = retry_config() if kind == "hand-wired" else hedging_config(delay="5s")
    controller = RetryController(server.target, config)
    channel = aio.insecure_channel(
        server.target,
        interceptors=controller.interceptors(),
        options=controller.channel_options(),
    )
    controller.bind_channel(channel)
    return channel


KINDS = ["retried", "hedged", "not retried", "hand-wired", "hand-wired hedged"]


async def inside_a_request(send: Callable[[], Any], outer: float = OUTER) -> Any:
    async def attempt(request: Request) -> Any:
        return await send()

    return await RetryOrchestrator().execute(Request(name="outer", timeout=outer), attempt)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("own", [OWN, None], ids=["own-60s", "own-none"])
async def test_a_unary_call_inside_a_request_sends_the_time_left(
    server: Server, kind: str, own: float | None
) -> None:
    method = server.unary_unary("M", remaining())
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, kind) as ch:
            sent = seconds(
                await inside_a_request(lambda: ch.unary_unary(method)(b"x", timeout=own))
            )
    # Before: 60 s (or no deadline at all), whatever the outer request had left.
    assert sent is not None
    assert 0.0 < sent <= OUTER + SLACK


@pytest.mark.parametrize("kind", ["retried", "not retried"])
async def test_a_streaming_call_inside_a_request_sends_the_time_left(
    server: Server, kind: str
) -> None:
    async def stream(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield await remaining()(request, context, attempt)

    method = server.unary_stream("S", stream)
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, kind) as ch:

            async def read_one() -> bytes:
                return await ch.unary_stream(method)(b"x", timeout=OWN).read()  # type: ignore[no-any-return]

            sent = seconds(await inside_a_request(read_one))
    assert sent is not None
    assert 0.0 < sent <= OUTER + SLACK


@pytest.mark.parametrize("kind", KINDS)
async def test_without_an_outer_request_nothing_changes(server: Server, kind: str) -> None:
    method = server.unary_unary("M", remaining())
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, kind) as ch:
            sent = seconds(await ch.unary_unary(method)(b"x", timeout=OWN))
            unbounded = seconds(await ch.unary_unary(method)(b"x"))
    assert sent is not None
    assert OWN - 10 < sent <= OWN + SLACK
    assert unbounded is None


async def test_an_own_timeout_shorter_than_the_outer_one_is_kept(server: Server) -> None:
    method = server.unary_unary("M", remaining())
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, "retried") as ch:
            sent = seconds(
                await inside_a_request(lambda: ch.unary_unary(method)(b"x", timeout=0.5), OWN)
            )
    assert sent is not None
    assert 0.0 < sent <= 0.5 + SLACK


async def test_a_retry_sends_what_is_left_of_the_outer_deadline(server: Server) -> None:
    """The first attempt takes 1.2 s of the outer 2 s, then fails with UNAVAILABLE.

    The retry is sent with the 0.8 s left. The call's own retry deadline is counted
    from the call's start, once: inheriting the outer deadline again when the first
    failure builds the call's Request (on a clock dated back to the call's start)
    would end it 1.2 s early, with DEADLINE_EXCEEDED and no retry.
    """

    async def slow_then_remaining(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt == 1:
            await asyncio.sleep(1.2)
            await abort(context, grpc.StatusCode.UNAVAILABLE)
        return await remaining()(request, context, attempt)  # type: ignore[no-any-return]

    method = server.unary_unary("M", slow_then_remaining)
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, "retried") as ch:
            call = ch.unary_unary(method)
            sent = seconds(await inside_a_request(lambda: call(b"x", timeout=OWN)))
    assert server.count("M") == 2
    assert sent is not None
    assert 0.0 < sent <= OUTER - 1.2 + SLACK


async def test_a_call_made_after_the_outer_request_ended_keeps_its_own_timeout(
    server: Server,
) -> None:
    """A task spawned during send outlives it: its later call is not bound by a request
    that has already ended."""
    method = server.unary_unary("M", remaining())
    go = asyncio.Event()
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, "retried") as ch:

            async def later() -> bytes:
                await go.wait()
                return await ch.unary_unary(method)(b"x", timeout=OWN)  # type: ignore[no-any-return]

            tasks: list[asyncio.Task[bytes]] = []

            async def spawn() -> None:
                tasks.append(asyncio.ensure_future(later()))

            await inside_a_request(spawn)
            go.set()
            sent = seconds(await tasks[0])
    assert sent is not None
    assert OWN - 10 < sent <= OWN + SLACK


@pytest.mark.parametrize("kind", ["retried", "hedged"])
async def test_a_call_cut_by_the_outer_deadline_names_the_outer_request(
    server: Server, kind: str
) -> None:
    """Every attempt fails UNAVAILABLE; the wait for the next one reaches the outer
    request's deadline. The call's context says whose deadline it was (the outer's
    name and timeout), as a Request built inside the send would.

    The outer request is marked as being sent by hand (what every door does around
    send), without the door's own cut at the same instant, which could end the send
    before the call reports.
    """

    async def unavailable(request: bytes, context: Any, attempt: int) -> bytes:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", "10000"),))
        await abort(context, grpc.StatusCode.UNAVAILABLE)
        return b""

    method = server.unary_unary("M", unavailable)
    with anyio.fail_after(TEST_TIMEOUT):
        async with open_channel(server, kind) as ch:

            async def send() -> Any:
                try:
                    return await ch.unary_unary(method)(b"x", timeout=OWN)
                except aio.AioRpcError as err:
                    return err

            outer = Request(name="outer", timeout=0.5)
            mark = outer._dispatching()
            try:
                err = await send()
            finally:
                Request._dispatched_done(mark)
    assert isinstance(err, aio.AioRpcError)
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    context = call_context(err)
    assert context is not None
    assert context.extra["deadline_from"]["request_name"] == "outer"
    assert context.extra["deadline_from"]["timeout_ms"] == 500.0
