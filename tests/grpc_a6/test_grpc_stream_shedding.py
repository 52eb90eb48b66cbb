"""Load shedding on the streaming shapes of sdkcore gRPC channels (rfc/0009).

The channel's ``limiter=`` and ``throttle=`` are taken around every attempt of a
unary-stream, stream-unary and stream-stream call, as around a unary-unary one: the
permit is held until the attempt's call is done (read to its end, failed, cancelled,
its channel closed), a refusal sends nothing and surfaces as a unary refusal does
(UNAVAILABLE "refused locally", retried transparently), and the throttle counts the
stream's status with the unary rules. A channel built by hand with
``RetryController.interceptors()`` is gated the same way. grpc.aio runs on asyncio
only: no trio variant.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    Server,
    abort,
    pass_through,
    retry_config,
    wait_until,
)

from sdkcore import AdaptiveConcurrencyLimiter, AdaptiveThrottle, ConcurrencyLimiter  # noqa: E402
from sdkcore.grpc import RetryController, insecure_channel, retry_stats  # noqa: E402

pytestmark = pytest.mark.asyncio

SHAPES = ["unary_stream", "stream_unary", "stream_stream"]
LIMITERS: dict[str, Callable[[], Any]] = {
    "fixed": lambda: ConcurrencyLimiter(1, name="svc-limit"),
    "adaptive": lambda: AdaptiveConcurrencyLimiter(1, 1, 1, name="svc-limit"),
}
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class Held:
    """A method of one shape whose first attempt waits for ``release`` (``entered``: it began).

    ``first`` is what its first attempt does before answering (None: nothing); every
    attempt then answers ``[b"r0", b"r1"]`` (a stream) or ``b"r0,r1"`` (stream-unary).
    """

    def __init__(
        self, server: Server, shape: str, *, before: Callable[..., Any] | None = None
    ) -> None:
        self.shape = shape
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.received: list[bytes] = []
        held = self

        async def wait(context: Any, n: int) -> None:
            if n == 1:
                held.entered.set()
                if before is not None:
                    await before(context)
                await held.release.wait()

        if shape == "unary_stream":

            async def us(request: bytes, context: Any, n: int) -> AsyncIterator[bytes]:
                held.received.append(request)
                await wait(context, n)
                for i in range(2):
                    yield b"r%d" % i

            self.method = server.unary_stream(shape, us)
        elif shape == "stream_unary":

            async def su(requests: AsyncIterator[bytes], context: Any, n: int) -> bytes:
                await wait(context, n)
                async for r in requests:
                    held.received.append(r)
                return b"r0,r1"

            self.method = server.stream_unary(shape, su)
        else:

            async def ss(
                requests: AsyncIterator[bytes], context: Any, n: int
            ) -> AsyncIterator[bytes]:
                await wait(context, n)
                async for r in requests:
                    held.received.append(r)
                for i in range(2):
                    yield b"r%d" % i

            self.method = server.stream_stream(shape, ss)

    @property
    def expected(self) -> Any:
        return b"r0,r1" if self.shape == "stream_unary" else [b"r0", b"r1"]

    def start(self, channel: Any, **kwargs: Any) -> Any:
        if self.shape == "unary_stream":
            return channel.unary_stream(self.method)(b"q", **kwargs)

        async def requests() -> AsyncIterator[bytes]:
            yield b"q"

        return getattr(channel, self.shape)(self.method)(requests(), **kwargs)

    async def finish(self, call: Any) -> Any:
        if self.shape == "stream_unary":
            return await call
        return [m async for m in call]


async def _error_of(held: Held, call: Any) -> Any:
    with pytest.raises(aio.AioRpcError) as info:
        await held.finish(call)
    return info.value


@pytest.mark.parametrize("kind", list(LIMITERS))
@pytest.mark.parametrize("shape", SHAPES)
async def test_a_limiter_of_one_refuses_a_second_concurrent_stream(
    server: Server, shape: str, kind: str
) -> None:
    held = Held(server, shape)
    limiter = LIMITERS[kind]()
    async with insecure_channel(server.target, limiter=limiter, transparent_retry_limit=0) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            first = held.start(ch)
            first_done = asyncio.ensure_future(held.finish(first))
            await held.entered.wait()
            assert limiter.in_flight == 1
            second = held.start(ch)
            err = await _error_of(held, second)
            assert err.code() is UNAVAILABLE
            assert "svc-limit" in err.details()
            assert "refused locally, nothing was sent" in err.details()
            assert await second.code() is UNAVAILABLE
            assert server.count(shape) == 1  # nothing of the second reached the server
            assert limiter.in_flight == 1
            held.release.set()
            assert await first_done == held.expected
            # the permit comes back once the stream is done
            await wait_until(lambda: limiter.in_flight == 0)
            assert await first.code() is grpc.StatusCode.OK
    assert server.count(shape) == 1
    assert limiter.in_flight == 0


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_refused_stream_is_retried_and_sent_once_a_permit_is_free(
    server: Server, shape: str
) -> None:
    held = Held(server, shape)
    limiter = ConcurrencyLimiter(1)
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            first = held.start(ch)
            first_done = asyncio.ensure_future(held.finish(first))
            await held.entered.wait()
            second = held.start(ch, timeout=TEST_TIMEOUT)
            second_done = asyncio.ensure_future(held.finish(second))
            stats = retry_stats(ch)
            # refused, and retried transparently (backoff): nothing sent meanwhile
            await wait_until(lambda: stats.for_method(held.method).transparent_retries >= 2)
            assert server.count(shape) == 1
            assert not second_done.done()
            held.release.set()
            assert await first_done == held.expected
            assert await second_done == held.expected
            await wait_until(lambda: limiter.in_flight == 0)
    assert server.count(shape) == 2  # the second stream was sent once
    assert held.received == [b"q", b"q"]  # each stream's request reached the server once


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_stream_refused_until_its_deadline_ends_deadline_exceeded(
    server: Server, shape: str
) -> None:
    held = Held(server, shape)
    limiter = ConcurrencyLimiter(1)
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            with limiter.guard():  # the only permit, held elsewhere
                err = await _error_of(held, held.start(ch, timeout=0.2))
            assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "refused locally" in (err.debug_error_string() or "")
    assert server.count(shape) == 0
    assert limiter.in_flight == 0


@pytest.mark.parametrize("kind", list(LIMITERS))
@pytest.mark.parametrize("shape", SHAPES)
async def test_the_permit_comes_back_when_the_stream_is_cancelled(
    server: Server, shape: str, kind: str
) -> None:
    held = Held(server, shape)
    limiter = LIMITERS[kind]()
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            call = held.start(ch)
            task = asyncio.ensure_future(held.finish(call))
            await held.entered.wait()
            assert limiter.in_flight == 1
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: limiter.in_flight == 0)
            assert await call.code() is grpc.StatusCode.CANCELLED
            # the channel goes on taking streams
            held.release.set()
            assert await held.finish(held.start(ch)) == held.expected
            await wait_until(lambda: limiter.in_flight == 0)


@pytest.mark.parametrize("shape", ["unary_stream", "stream_stream"])
async def test_the_permit_comes_back_when_a_committed_stream_is_cancelled(
    server: Server, shape: str
) -> None:
    async def headers(context: Any) -> None:
        await context.send_initial_metadata((("x-h", "1"),))  # commits the call

    held = Held(server, shape, before=headers)
    limiter = ConcurrencyLimiter(1)
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            call = held.start(ch)
            assert ("x-h", "1") in tuple(await call.initial_metadata())
            assert limiter.in_flight == 1  # held while the committed stream is open
            assert call.cancel()
            await wait_until(lambda: limiter.in_flight == 0)
            assert await call.code() is grpc.StatusCode.CANCELLED
    held.release.set()


@pytest.mark.parametrize("shape", SHAPES)
async def test_the_permit_comes_back_after_a_server_error(server: Server, shape: str) -> None:
    limiter = AdaptiveConcurrencyLimiter(1, 1, 1)
    seen: list[int] = []

    async def fail(context: Any) -> None:
        seen.append(limiter.in_flight)  # the attempt holds the permit until its status
        await abort(context, grpc.StatusCode.INTERNAL)

    held = Held(server, shape, before=fail)
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            call = held.start(ch)
            err = await _error_of(held, call)
            assert err.code() is grpc.StatusCode.INTERNAL
            assert seen == [1]
            await wait_until(lambda: limiter.in_flight == 0)
            held.release.set()
            assert await held.finish(held.start(ch)) == held.expected
            await wait_until(lambda: limiter.in_flight == 0)
    assert server.count(shape) == 2


@pytest.mark.parametrize("shape", ["stream_unary", "stream_stream"])
async def test_the_permit_comes_back_when_the_request_iterator_raises(
    server: Server, shape: str
) -> None:
    held = Held(server, shape)
    limiter = ConcurrencyLimiter(1)
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            seen: list[int] = []

            async def requests() -> AsyncIterator[bytes]:
                yield b"q"
                await held.entered.wait()
                seen.append(limiter.in_flight)  # the attempt in flight holds the permit
                raise RuntimeError("the application's request iterator failed")

            call = getattr(ch, shape)(held.method)(requests())
            task = asyncio.ensure_future(held.finish(call))
            await asyncio.wait([task])
            assert task.cancelled()  # as grpc.aio: the call ends cancelled
            assert seen == [1]
            await wait_until(lambda: limiter.in_flight == 0)
    held.release.set()


@pytest.mark.parametrize("shape", SHAPES)
async def test_the_permit_comes_back_when_the_channel_closes(server: Server, shape: str) -> None:
    held = Held(server, shape)
    limiter = ConcurrencyLimiter(1)
    ch = insecure_channel(server.target, limiter=limiter)
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            call = held.start(ch)
            task = asyncio.ensure_future(held.finish(call))
            await held.entered.wait()
            assert limiter.in_flight == 1
    finally:
        await ch.close()
    with anyio.fail_after(TEST_TIMEOUT):
        await asyncio.wait([task])
        assert task.cancelled() or isinstance(task.exception(), aio.AioRpcError)
        await wait_until(lambda: limiter.in_flight == 0)
    held.release.set()


@pytest.mark.parametrize("shape", SHAPES)
async def test_the_throttle_counts_a_resource_exhausted_stream_as_a_rejection(
    server: Server, shape: str
) -> None:
    async def exhausted(context: Any) -> None:
        await abort(context, RESOURCE_EXHAUSTED)

    held = Held(server, shape, before=exhausted)
    throttle = AdaptiveThrottle(k=2.0, random=lambda: 0.0, name="svc-throttle")
    async with insecure_channel(server.target, throttle=throttle, transparent_retry_limit=0) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            err = await _error_of(held, held.start(ch))
            assert err.code() is RESOURCE_EXHAUSTED
            await wait_until(lambda: throttle.requests == 1)
            assert throttle.accepts == 0  # a rejection, not an accept
            assert throttle.rejection_probability > 0.0
            # from now on refused locally (random() == 0.0): nothing reaches the server
            for _ in range(3):
                err = await _error_of(held, held.start(ch))
                assert err.code() is UNAVAILABLE
                assert "svc-throttle" in err.details()
    assert server.count(shape) == 1
    assert throttle.refused == 3


@pytest.mark.parametrize("shape", SHAPES)
async def test_the_throttle_counts_a_completed_stream_as_an_accept_and_a_cancel_as_nothing(
    server: Server, shape: str
) -> None:
    held = Held(server, shape)
    throttle = AdaptiveThrottle(name="svc-throttle")
    async with insecure_channel(server.target, throttle=throttle) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            call = held.start(ch)
            task = asyncio.ensure_future(held.finish(call))
            await held.entered.wait()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            held.release.set()
            assert await held.finish(held.start(ch)) == held.expected
            await wait_until(lambda: throttle.requests == 1)
            assert throttle.accepts == 1  # the cancelled stream counted nothing
    assert server.count(shape) == 2


@pytest.mark.parametrize("shape", ["unary_unary", *SHAPES])
async def test_a_channel_built_by_hand_with_the_interceptors_is_gated_too(
    server: Server, shape: str
) -> None:
    if shape == "unary_unary":

        async def fn(request: bytes, context: Any, n: int) -> bytes:
            return b"ok"

        method = server.unary_unary("M", fn)

        def start(channel: Any, **kwargs: Any) -> Any:
            return channel.unary_unary(method)(b"q", **kwargs)

        async def finish(call: Any) -> Any:
            return await call

        expected: Any = b"ok"
        name = "M"
    else:
        held = Held(server, shape)
        held.release.set()
        start, finish, expected, name = held.start, held.finish, held.expected, shape
    limiter = ConcurrencyLimiter(1, name="by-hand")
    controller = RetryController(server.target, limiter=limiter, transparent_retry_limit=0)
    async with aio.insecure_channel(
        server.target,
        options=controller.channel_options(),
        interceptors=controller.interceptors(),
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            with limiter.guard():  # the only permit, held elsewhere
                with pytest.raises(aio.AioRpcError) as info:
                    await finish(start(ch))
                assert info.value.code() is UNAVAILABLE
                assert "by-hand" in info.value.details()
                assert server.count(name) == 0
            assert await finish(start(ch)) == expected
            await wait_until(lambda: limiter.in_flight == 0)
    assert server.count(name) == 1


@pytest.mark.parametrize("shape", ["unary_unary", *SHAPES])
async def test_the_gate_sees_the_status_through_an_application_interceptor(
    server: Server, shape: str
) -> None:
    """With an application interceptor each attempt is grpc.aio's intercepted call, whose
    status is no status of the endpoint's: the gate counted every attempt an accept, and
    the throttle never throttled an endpoint answering RESOURCE_EXHAUSTED. It reads the
    call the interceptors made (``sdkcore.grpc._intercepted``)."""

    async def exhausted(request: Any, context: Any, n: int) -> Any:
        await abort(context, RESOURCE_EXHAUSTED)

    async def exhausted_stream(request: Any, context: Any, n: int) -> AsyncIterator[bytes]:
        await abort(context, RESOURCE_EXHAUSTED)
        yield b""

    if shape in ("unary_unary", "stream_unary"):
        method = getattr(server, shape)(shape, exhausted)
    else:
        method = getattr(server, shape)(shape, exhausted_stream)
    # random() 1.0: never below the rejection probability, nothing is refused locally
    throttle = AdaptiveThrottle(random=lambda: 1.0, name="svc-throttle")
    made: Callable[[Any], Awaitable[Any]] = {
        "unary_unary": lambda ch: ch.unary_unary(method)(b"q"),
        "unary_stream": lambda ch: ch.unary_stream(method)(b"q").read(),
        "stream_unary": lambda ch: ch.stream_unary(method)(iter([b"q"])),
        "stream_stream": lambda ch: ch.stream_stream(method)(iter([b"q"])).read(),
    }[shape]
    async with insecure_channel(
        server.target,
        service_config=retry_config(max_attempts=2),
        throttle=throttle,
        interceptors=pass_through(),
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            for _ in range(3):
                with pytest.raises(aio.AioRpcError) as info:
                    await made(ch)
                assert info.value.code() is RESOURCE_EXHAUSTED
            await wait_until(lambda: throttle.requests == 3)
    assert throttle.accepts == 0, throttle  # three rejections, no accept
