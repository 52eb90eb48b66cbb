"""Server-, client- and bidi-streaming calls: retry before commit, replay, commit rules."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc.aio import _base_call  # noqa: E402
from grpc_server import (  # noqa: E402
    HEADERS_FLUSH,
    TEST_TIMEOUT,
    Server,
    abort,
    retry_config,
    wait_until,
)
from h2_server import RawH2Server  # noqa: E402

from sdkcore import ConcurrencyLimiter  # noqa: E402
from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    RetryController,
    insecure_channel,
    previous_rpc_attempts,
    retry_controller,
    retry_stats,
)

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
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
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
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
            assert retry_controller(ch).buffered_bytes == 0
    assert seen == [[b"a", b"b", b"c"], [b"a", b"b", b"c"]]
    assert server.attempts["C"][1][PREV] == "1"


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("size", [0, 1])
async def test_the_request_iterator_is_read_as_the_attempt_sends(
    server: Server, kind: str, size: int
) -> None:
    """grpc.aio reads the next request message once the last was written. sdkcore read
    the whole iterator into its replay buffer at once: 200,000 messages for a server
    that read 3, and an endless iterator of empty messages (which never fill the byte
    limit) that never awaits froze the event loop for good (a review). Now it reads at
    most READ_AHEAD (16) messages past the furthest an attempt sent, a retry included."""
    pulled = 0
    total = 200_000

    def sync_source() -> Iterator[bytes]:
        nonlocal pulled
        for _ in range(total):
            pulled += 1
            yield b"x" * size

    async def async_source() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(total):  # never awaits: as an endless ping generator
            pulled += 1
            yield b"x" * size

    reads: list[int] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        read = 0
        async for _ in requests:
            read += 1
            if read == 3:
                break
        reads.append(pulled)
        if attempt == 1:
            await abort(context, ABORTED)
        return b"read 3"

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            source = sync_source() if kind == "sync" else async_source()
            assert await ch.stream_unary(method)(source) == b"read 3"
    # grpc.aio itself reads a few ahead (its own buffers): the bound is loose, the
    # read-everything-first it replaces was 200,000
    assert pulled < 100
    assert len(reads) == 2  # retried: the replay and the read on stay within the bound


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


async def test_commit_during_backoff_ends_the_call_with_the_last_error(server: Server) -> None:
    """A6: once committed, no further attempt. A replay buffer that overflows while the
    call waits out its backoff ends the call at once with the last attempt's error; the
    next attempt never starts with a truncated (or empty) request stream."""
    seen: list[list[bytes]] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        msgs: list[bytes] = []
        async for r in requests:
            msgs.append(r)
            if len(msgs) == 2:
                break
        seen.append(msgs)
        if attempt == 1:
            await abort(context, ABORTED)
        return b"ok:" + b"".join(msgs)

    method = server.stream_unary("C", fn)
    # A 16-24 s backoff: only a commit that ends the backoff finishes within the test.
    cfg = retry_config(initial="20s", maximum="20s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=cfg,
            per_call_buffer_limit=2,
            backoff_jitter=BackoffJitter.PROPORTIONAL,
        ) as ch:
            orchestrator = retry_controller(ch).orchestrator

            async def requests() -> AsyncIterator[bytes]:
                yield b"a"
                yield b"b"
                await wait_until(lambda: orchestrator.requests_in_retry == 1)
                yield b"c"  # overflows the 2-byte buffer during the backoff: commit

            with pytest.raises(aio.AioRpcError) as info:
                await ch.stream_unary(method)(requests())
            assert orchestrator.requests_in_retry == 0
            assert retry_controller(ch).buffered_bytes == 0
            stats = retry_stats(ch).for_method(method)
    assert info.value.code() is ABORTED
    assert seen == [[b"a", b"b"]]
    assert server.count("C") == 1
    assert stats.retry_attempts == 0
    assert "committed" in str(info.value.__cause__)


class _LoopErrors:
    """Collects what the event loop reports (e.g. "Task exception was never retrieved")."""

    def __init__(self) -> None:
        self.reports: list[str] = []

    def __call__(self, loop: Any, context: dict[str, Any]) -> None:
        self.reports.append(str(context.get("message")))


@contextlib.contextmanager
def _loop_errors() -> Iterator[_LoopErrors]:
    loop = asyncio.get_running_loop()
    errors = _LoopErrors()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(errors)
    try:
        yield errors
    finally:
        loop.set_exception_handler(previous)


async def _request_iterator_outcome(
    channel: Any, method: str, bidi: bool, received: asyncio.Event
) -> tuple[str, str, bool]:
    async def requests() -> AsyncIterator[bytes]:
        yield b"debit"
        await received.wait()
        raise RuntimeError("the application's request iterator failed")

    if bidi:
        call = channel.stream_stream(method)(requests())

        async def consume() -> Any:
            return [m async for m in call]
    else:
        call = channel.stream_unary(method)(requests())

        async def consume() -> Any:
            return await call

    task = asyncio.ensure_future(consume())
    await asyncio.wait([task])
    if task.cancelled():
        how = "CancelledError"
    elif isinstance(task.exception(), aio.AioRpcError):
        how = f"AioRpcError({task.exception().code().name})"  # type: ignore[union-attr]
    elif task.exception() is not None:
        how = type(task.exception()).__name__
    else:
        how = f"result {task.result()!r}"
    return how, (await call.code()).name, call.cancelled()


@pytest.mark.parametrize("bidi", [False, True], ids=["stream_unary", "stream_stream"])
async def test_raising_request_iterator_cancels_the_call_like_native(
    server: Server, bidi: bool
) -> None:
    """The stream is not half-closed: the RPC is cancelled, as plain grpc.aio does."""
    received: dict[str, asyncio.Event] = {}

    async def read(requests: AsyncIterator[bytes], context: Any, name: str) -> list[bytes]:
        msgs: list[bytes] = []
        async for r in requests:
            msgs.append(r)
            received[name].set()
        return msgs

    def unary(name: str) -> str:
        async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
            return b"server committed: " + b",".join(await read(requests, context, name))

        return server.stream_unary(name, fn)

    def streaming(name: str) -> str:
        async def fn(
            requests: AsyncIterator[bytes], context: Any, attempt: int
        ) -> AsyncIterator[bytes]:
            yield b"server committed: " + b",".join(await read(requests, context, name))

        return server.stream_stream(name, fn)

    make = streaming if bidi else unary
    native_method, ours_method = make("native"), make("ours")
    received.update(native=asyncio.Event(), ours=asyncio.Event())
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(server.target) as native:
            expected = await _request_iterator_outcome(
                native, native_method, bidi, received["native"]
            )
        with _loop_errors() as errors:
            async with insecure_channel(server.target, service_config=retry_config()) as ours:
                got = await _request_iterator_outcome(ours, ours_method, bidi, received["ours"])
                assert retry_controller(ours).buffered_bytes == 0
            gc.collect()
            await asyncio.sleep(0)
            assert errors.reports == []
    assert expected == ("CancelledError", "CANCELLED", True)
    assert got == expected
    assert server.count("ours") == 1


async def _how_the_stream_ended(make_channel: Any) -> list[str | None]:
    h2 = RawH2Server(lambda n: "respond")
    await h2.start()
    try:
        async with make_channel(h2.target) as ch:

            async def requests() -> AsyncIterator[bytes]:
                yield b"debit"
                await wait_until(lambda: bool(h2.streams and h2.streams[0].data))
                raise RuntimeError("the application's request iterator failed")

            call = ch.stream_unary("/test.Svc/C")(requests())

            async def consume() -> Any:
                return await call

            task = asyncio.ensure_future(consume())
            await asyncio.wait([task])
            assert task.cancelled()
            await h2.streams[0].ended_event.wait()
            return [s.ended for s in h2.streams]
    finally:
        await h2.stop()


async def test_raising_request_iterator_resets_the_stream_on_the_wire() -> None:
    """Seen by the server: the stream is reset (RST_STREAM), never half-closed, as native."""
    with anyio.fail_after(TEST_TIMEOUT):
        native = await _how_the_stream_ended(lambda target: aio.insecure_channel(target))
        ours = await _how_the_stream_ended(
            lambda target: insecure_channel(target, service_config=retry_config())
        )
    assert native == ["rst"]
    assert ours == ["rst"]


async def test_raising_message_size_cancels_the_call(server: Server) -> None:
    received = asyncio.Event()

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        async for _ in requests:
            received.set()
        return b"server committed"

    def size(message: Any) -> int:
        if message == b"debit":
            return 5
        raise ValueError("cannot size this message")

    async def requests() -> AsyncIterator[bytes]:
        yield b"debit"
        await received.wait()
        yield b"unsizable"

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        with _loop_errors() as errors:
            async with insecure_channel(
                server.target, service_config=retry_config(), message_size=size
            ) as ch:
                call = ch.stream_unary(method)(requests())
                with pytest.raises(asyncio.CancelledError):
                    await call
                assert await call.code() is grpc.StatusCode.CANCELLED
            gc.collect()
            await asyncio.sleep(0)
            assert errors.reports == []
    assert server.count("C") == 1


async def _blocked_stream(server: Server) -> tuple[str, asyncio.Event, asyncio.Event]:
    release = asyncio.Event()
    started = asyncio.Event()

    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        started.set()
        await release.wait()
        yield b"late"

    return server.unary_stream("S", fn), started, release


async def test_timing_out_a_wait_on_the_call_does_not_end_it(server: Server) -> None:
    """Cancelling the task that awaits call.code() raises in that task, like native."""
    method, started, release = await _blocked_stream(server)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            await started.wait()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(call.code(), 0.05)
            assert not call.done()
            assert not call.cancelled()
            release.set()
            assert await collect(call) == [b"late"]
            assert await call.code() is grpc.StatusCode.OK


@pytest.mark.parametrize(
    "accessor", ["initial_metadata", "trailing_metadata", "code", "details", "debug_error_string"]
)
async def test_cancelling_a_task_awaiting_the_call_is_not_swallowed(
    server: Server, accessor: str
) -> None:
    method, started, release = await _blocked_stream(server)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            await started.wait()
            waiter = asyncio.ensure_future(getattr(call, accessor)())
            await asyncio.sleep(0)  # the waiter is now awaiting the call
            waiter.cancel()
            await asyncio.wait([waiter])
            assert waiter.cancelled()
            assert not call.cancelled()
            release.set()
            assert await collect(call) == [b"late"]


async def test_cancelled_call_still_reports_cancelled(server: Server) -> None:
    method, started, release = await _blocked_stream(server)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            await started.wait()
            assert call.cancel()
            assert await call.code() is grpc.StatusCode.CANCELLED
            assert await call.details() == "Locally cancelled by application!"
            release.set()


class _FailingInterceptor(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Runs inside the retry loop; fails the attempt once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        await self.gate.wait()
        raise RuntimeError("an inner interceptor failed")


def _helper_waits() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "Event.wait" in repr(t.get_coro())]


async def test_wait_for_connection_leaves_no_task_behind(server: Server) -> None:
    """A channel built by hand: the application's interceptor runs in sdkcore's attempt
    (no attempt yet while it waits), so ``wait_for_connection()`` waits for one with a
    helper task, which it never leaves behind."""
    failing = _FailingInterceptor()
    controller = RetryController(server.target, retry_config())
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(
            server.target,
            options=controller.channel_options(),
            interceptors=[*controller.interceptors(), failing],
        ) as ch:
            call = ch.unary_stream("/test.Svc/S")(b"m")
            waiter = asyncio.ensure_future(call.wait_for_connection())
            await wait_until(lambda: bool(_helper_waits()))
            failing.gate.set()
            await waiter
            with pytest.raises(RuntimeError, match="inner interceptor"):
                await collect(call)
            await asyncio.sleep(0)
            assert _helper_waits() == []


async def test_wait_for_connection_on_the_channel_helpers_waits_for_the_attempt(
    server: Server,
) -> None:
    """The channel helpers' calls make each attempt through grpc.aio's multi-callable (the
    application's interceptors inside it): ``wait_for_connection()`` waits for the attempt,
    and so for its interceptors, and raises what they raised; no helper task is left."""
    failing = _FailingInterceptor()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), interceptors=[failing]
        ) as ch:
            call = ch.unary_stream("/test.Svc/S")(b"m")
            waiter = asyncio.ensure_future(call.wait_for_connection())
            await asyncio.sleep(0.05)
            assert not waiter.done()  # the attempt is made; its interceptor waits
            assert _helper_waits() == []
            failing.gate.set()
            with pytest.raises(RuntimeError, match="inner interceptor"):
                await waiter
            with pytest.raises(RuntimeError, match="inner interceptor"):
                await collect(call)
            await asyncio.sleep(0)
            assert _helper_waits() == []


async def test_committed_stream_error_reports_previous_attempts(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        if attempt == 1:
            await abort(context, ABORTED)
        yield b"first"
        await abort(context, ABORTED)

    method = server.unary_stream("S", fn)
    got: list[bytes] = []
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"m")
            with pytest.raises(aio.AioRpcError) as info:
                await drain_into(call, got)
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
    assert got == [b"first"]
    assert info.value.code() is ABORTED
    assert previous_rpc_attempts(info.value) == 1
    assert server.count("S") == 2


@pytest.mark.parametrize(
    ("code", "pushback", "cost"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "-1", 1000),  # "don't retry" pushback: a token
        (grpc.StatusCode.INVALID_ARGUMENT, None, 0),  # not retryable, no pushback: free
        (ABORTED, None, 1000),  # retryable: a token
    ],
)
async def test_committed_stream_failure_throttle_cost(
    server: Server, code: Any, pushback: str | None, cost: int
) -> None:
    """A committed call that fails costs a token by the same rule as any other failure."""

    async def fn(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"first"
        trailing = () if pushback is None else (("grpc-retry-pushback-ms", pushback),)
        await abort(context, code, trailing=trailing)

    method = server.unary_stream("S", fn)
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 0.1})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            controller = retry_controller(ch)
            throttler = controller.throttler
            assert throttler is not None
            before = throttler.milli_tokens
            call = ch.unary_stream(method)(b"m")
            with pytest.raises(aio.AioRpcError):
                await collect(call)
            # Accounted by the time the application sees the error.
            assert before - throttler.milli_tokens == cost


@pytest.mark.parametrize("shape", ["unary_stream", "stream_unary", "stream_stream"])
async def test_a_call_cancelled_before_it_commits_is_done_at_once(
    server: Server, shape: str
) -> None:
    """As grpc.aio's: after cancel() returned True, done() and cancelled() are True and a
    second cancel() returns False. Before a streaming call committed, done() stayed False
    (and a second cancel() returned True) until the attempts' task ended a turn later."""
    release = asyncio.Event()

    async def held_stream(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        await release.wait()
        yield b"late"

    async def held_unary(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        await release.wait()
        return b"late"

    async def held_bidi(
        requests: AsyncIterator[bytes], context: Any, attempt: int
    ) -> AsyncIterator[bytes]:
        await release.wait()
        yield b"late"

    async def requests() -> AsyncIterator[bytes]:
        yield b"x"
        await release.wait()

    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            if shape == "unary_stream":
                call: Any = ch.unary_stream(server.unary_stream("S", held_stream))(b"x")
            elif shape == "stream_unary":
                call = ch.stream_unary(server.stream_unary("S", held_unary))(requests())
            else:
                call = ch.stream_stream(server.stream_stream("S", held_bidi))(requests())
            await wait_until(lambda: server.count("S") == 1)
            assert not call.done()
            assert call.cancel() is True
            assert call.done()
            assert call.cancelled()
            assert call.cancel() is False
            assert await call.code() is grpc.StatusCode.CANCELLED
            release.set()


async def test_a_write_after_done_writing_is_refused_as_by_grpc_aio(server: Server) -> None:
    """grpc.aio refuses a write() after done_writing() (InvalidStateError, "half
    closed"). Reading the request stream only on demand saw done_writing() late: the
    write returned normally and its message was dropped (a review). The stream is read a
    few messages ahead of the wire, so done_writing() is seen at once."""
    seen: list[list[bytes]] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        seen.append(await read_all(requests))
        return b"%d" % len(seen[-1])

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_unary(method)()
            await call.write(b"a")
            await call.done_writing()
            with pytest.raises(asyncio.InvalidStateError, match="half closed"):
                await call.write(b"b")
            assert await call == b"1"
    assert seen == [[b"a"]]


async def test_a_write_after_done_writing_is_refused_while_the_call_waits_to_retry(
    server: Server,
) -> None:
    """During the backoff nothing is sent: counted as read-ahead, 16 buffered messages
    stopped the read of grpc.aio's write queue, done_writing() stayed unseen, and a
    write() after it returned with its message dropped (two reviews). grpc.aio's write
    stream is read at once: each write() waits for that read, so it cannot run ahead."""
    seen: list[list[bytes]] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        got: list[bytes] = []
        async for message in requests:
            got.append(message)
            if attempt == 1 and len(got) == 20:
                seen.append(got)
                await abort(context, ABORTED)
        seen.append(got)
        return b"%d" % len(got)

    method = server.stream_unary("C", fn)
    config = retry_config(initial="0.5s", maximum="0.5s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=config, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            waiting = retry_controller(ch).orchestrator
            call = ch.stream_unary(method)()
            for i in range(20):
                await call.write(b"m%d" % i)
            await wait_until(lambda: waiting.requests_in_retry == 1)  # in the backoff
            for i in range(20, 40):  # more than the read-ahead bound, while nothing is sent
                await call.write(b"m%d" % i)
            await call.done_writing()
            with pytest.raises(asyncio.InvalidStateError, match="half closed"):
                await call.write(b"after")
            assert await call == b"40"
    assert len(seen[0]) == 20
    assert seen[-1] == [b"m%d" % i for i in range(40)]


async def test_writes_after_the_commit_wait_for_the_wire(server: Server) -> None:
    """grpc.aio's write() stream is read at once only until the call commits (the byte
    limit bounds it there). Read at once after it too, nothing bounded it: against a
    server that stopped reading, write() returned at once without end (a review measured
    600 MiB held in 1.5 s, where plain grpc.aio blocks on flow control after a few MiB)."""
    stop = asyncio.Event()

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        async for _ in requests:
            await stop.wait()  # reads one message, then no more
        return b"done"

    method = server.stream_unary("C", fn)
    chunk = b"x" * 65536
    written = 0

    async def write_on(call: Any) -> None:
        nonlocal written
        for _ in range(10_000):
            await call.write(chunk)
            written += 1

    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), per_call_buffer_limit=4 * 65536
        ) as ch:
            call = ch.stream_unary(method)()
            with anyio.move_on_after(1.0):
                await write_on(call)
            call.cancel()
            stop.set()
    # plain grpc.aio: about 90 writes here; unbounded, thousands
    assert written < 1000, written


async def test_a_write_after_done_writing_is_refused_at_once_after_the_commit(
    server: Server,
) -> None:
    """After the commit the write() stream is read 16 messages ahead of the wire. Behind a
    server that stopped reading, ``done_writing()`` waits for room, and a ``write()`` made
    meanwhile was refused only once the stream's end was read: it waited, and could
    return with its message dropped (rfc/0003, a limit of the interceptor path). The
    channel helpers' calls note ``done_writing()`` when it is called: refused at once."""
    stop = asyncio.Event()

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        await context.send_initial_metadata((("committed", "1"),))
        async for _ in requests:
            await stop.wait()  # reads one message, then none until stop
        return b"done"

    method = server.stream_unary("C", fn)
    chunk = b"x" * 65536
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_unary(method)()
            assert await call.initial_metadata()  # the server's headers: committed
            blocked = None
            for _ in range(2_000):
                write = asyncio.ensure_future(call.write(chunk))
                done, _ = await asyncio.wait({write}, timeout=0.2)
                if not done:
                    blocked = write  # the wire and the read-ahead are full
                    break
                write.result()
            assert blocked is not None
            closing = asyncio.ensure_future(call.done_writing())
            await asyncio.sleep(0.05)
            assert not closing.done()  # behind the blocked write
            with anyio.fail_after(1.0), pytest.raises(asyncio.InvalidStateError, match="half"):
                await call.write(b"late")
            stop.set()
            await blocked
            await closing
            assert await call == b"done"


async def test_the_write_api_refuses_a_misuse_as_grpc_aio(server: Server) -> None:
    """``write()``/``done_writing()`` on a call made with a request iterator raise grpc.aio's
    UsageError ("may not be mixed"); ``write()`` on a finished call raises
    InvalidStateError ("already finished"); a second ``done_writing()`` does nothing."""

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        return b"%d" % len(await read_all(requests))

    method = server.stream_unary("C", fn)

    async def two() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_unary(method)(two())
            with pytest.raises(aio.UsageError, match="may not be mixed"):
                await call.write(b"x")
            with pytest.raises(aio.UsageError, match="may not be mixed"):
                await call.done_writing()
            assert await call == b"2"

            call = ch.stream_unary(method)()
            await call.write(b"a")
            await call.done_writing()
            await call.done_writing()
            assert await call == b"1"
            with pytest.raises(asyncio.InvalidStateError, match="already finished"):
                await call.write(b"b")


@pytest.mark.parametrize("kind", ["plain grpc.aio", "sdkcore"])
async def test_a_cancelled_done_writing_cancels_the_call(server: Server, kind: str) -> None:
    """``done_writing()`` waits for room behind a server that stopped reading; cancelled
    there (a ``wait_for`` timeout), plain grpc.aio cancels the RPC. sdkcore's first version
    dropped the half-close and refused a second ``done_writing()`` as done: the call hung
    until its deadline (a review). It cancels the call, as plain grpc.aio does."""
    stop = asyncio.Event()
    ended: list[bool] = []

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        await context.send_initial_metadata((("committed", "1"),))
        try:
            async for _ in requests:
                await stop.wait()
        except asyncio.CancelledError:
            ended.append(True)
            raise
        return b"done"

    method = server.stream_unary("C", fn)
    chunk = b"x" * 65536
    with anyio.fail_after(TEST_TIMEOUT):
        channel = (
            aio.insecure_channel(server.target)
            if kind == "plain grpc.aio"
            else insecure_channel(server.target, service_config=retry_config())
        )
        async with channel as ch:
            call = ch.stream_unary(method)()
            assert await call.initial_metadata()
            blocked = None
            for _ in range(2_000):  # fill the wire (and sdkcore's read-ahead)
                write = asyncio.ensure_future(call.write(chunk))
                done, _ = await asyncio.wait({write}, timeout=0.2)
                if not done:
                    blocked = write  # left waiting
                    break
            assert blocked is not None
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(call.done_writing(), 0.2)
            assert call.cancelled()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await blocked  # ended with the call
            if kind == "sdkcore":  # (plain grpc.aio says INTERNAL: its failed write's)
                assert await call.code() is grpc.StatusCode.CANCELLED
            await wait_until(lambda: ended == [True])  # the server saw the RPC cancelled
            stop.set()


async def test_a_done_writing_called_twice_at_once_ends_the_stream_once(server: Server) -> None:
    """Two ``done_writing()`` at once, behind a write that waits for room: both return once
    the stream's end is taken, and the server gets every message and the end."""
    release = asyncio.Event()

    async def fn(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        await release.wait()
        return b"%d" % len(await read_all(requests))

    method = server.stream_unary("C", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.stream_unary(method)()
            for i in range(3):
                await call.write(b"m%d" % i)
            first = asyncio.ensure_future(call.done_writing())
            second = asyncio.ensure_future(call.done_writing())
            release.set()
            await asyncio.gather(first, second)
            assert await call == b"3"


_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("interceptor_var", default="")


class _UpperUnaryStream(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Returns an async iterator of transformed responses, as grpc.aio allows; it sets a
    context variable around each yield (as a tracing span would), which fails if the
    iterator is run in two tasks."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(details, request)
        fail_after = self.fail_after

        async def upper() -> AsyncIterator[bytes]:
            n = 0
            async for response in call:
                token = _VAR.set("in the iterator")
                try:
                    yield response.upper()
                finally:
                    _VAR.reset(token)
                n += 1
                if fail_after is not None and n >= fail_after:
                    raise ValueError("the interceptor's iterator failed")

        return upper()


class _UpperStreamStream(aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        call = await continuation(details, requests)

        async def upper() -> AsyncIterator[bytes]:
            async for response in call:
                token = _VAR.set("in the iterator")
                try:
                    yield response.upper()
                finally:
                    _VAR.reset(token)

        return upper()


def _transforming_method(server: Server, shape: str, *, fail_first: bool) -> str:
    async def two(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        if fail_first and attempt == 1:
            await abort(context, grpc.StatusCode.UNAVAILABLE)
        if not isinstance(request, bytes):
            request = b"".join([r async for r in request])
        yield request + b"a"
        yield b"b"
        await asyncio.sleep(0)

    return str(getattr(server, shape.split()[0])("T", two))


@pytest.mark.parametrize("read", ["async for", "read()"])
@pytest.mark.parametrize("shape", ["unary_stream", "stream_stream", "stream_stream write()"])
async def test_an_interceptor_that_transforms_the_responses_is_read_through(
    server: Server, shape: str, read: str
) -> None:
    """An application interceptor may return an async iterator of transformed responses
    (grpc.aio wraps it; its ``read()`` raises NotImplementedError): every response-
    streaming call on such a channel failed with NotImplementedError (a review; on the
    interceptor path too). It is read by iterating it, in the application's task only (run
    in two tasks, a context variable set across its yields failed; a review), and the
    limiter's permit comes back."""
    method = _transforming_method(server, shape, fail_first=False)
    limiter = ConcurrencyLimiter(4, name="svc-limit")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=retry_config(),
            limiter=limiter,
            interceptors=[_UpperUnaryStream(), _UpperStreamStream()],
        ) as ch:
            if shape == "unary_stream":
                call = ch.unary_stream(method)(b"x")
            elif shape == "stream_stream":
                call = ch.stream_stream(method)(iter([b"x"]))
            else:
                call = ch.stream_stream(method)()
                await call.write(b"x")
                await call.done_writing()
            if read == "async for":
                got = [m async for m in call]
            else:
                got = []
                while (message := await call.read()) is not aio.EOF:
                    got.append(message)
            assert got == [b"XA", b"B"]
            assert await call.code() is grpc.StatusCode.OK
            await wait_until(lambda: limiter.in_flight == 0)
    assert server.count("T") == 1


async def test_a_call_whose_interceptor_took_the_responses_commits_when_it_returns(
    server: Server,
) -> None:
    """sdkcore sees the server's headers and messages of such a call only by running the
    interceptor's iterator, which is the application's to run: the call commits when the
    interceptors return it (rfc/0003). A first attempt failing UNAVAILABLE is then the
    call's answer, not retried, and its status is the server's (in the call and in the
    accounting: the request fails), never a success."""
    method = _transforming_method(server, "unary_stream", fail_first=True)
    limiter = ConcurrencyLimiter(4, name="svc-limit")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=retry_config(),
            limiter=limiter,
            interceptors=[_UpperUnaryStream()],
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            with pytest.raises(aio.AioRpcError) as info:
                [m async for m in call]
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            assert await call.code() is grpc.StatusCode.UNAVAILABLE
            await wait_until(lambda: limiter.in_flight == 0)
            stats = retry_stats(ch).snapshot()
    assert server.count("T") == 1
    assert sum(m.retry_attempts for m in stats.values()) == 0


async def test_an_interceptor_iterator_that_fails_gives_the_permit_back(server: Server) -> None:
    """The interceptor's iterator raises after the first message: the error reaches the
    application and the call is cancelled, so the limiter's permit comes back (it stayed
    held, and the next call was refused; a review)."""

    async def three(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        for m in (b"a", b"b", b"c"):
            yield m

    method = server.unary_stream("T", three)
    limiter = ConcurrencyLimiter(1, name="svc-limit")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=retry_config(),
            limiter=limiter,
            interceptors=[_UpperUnaryStream(fail_after=1)],
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            assert await call.read() == b"A"
            with pytest.raises(ValueError, match="iterator failed"):
                await call.read()
            assert call.done()
            await wait_until(lambda: limiter.in_flight == 0)


async def test_an_object_of_the_applications_with_a_call_attribute_is_not_unwrapped(
    server: Server,
) -> None:
    """An interceptor returning the application's own call wrapper, which has a ``_call``
    helper of its own: only grpc.aio's response-iterator wrapper is unwrapped (any ``_call``
    was: the gate then held its permit on a bound method and gave it back at once, and a
    limiter of one let a second stream in; a review)."""

    class Wrapped(_base_call.UnaryStreamCall):  # type: ignore[misc]
        """The application's delegating call; ``_call`` is a helper of its own."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def _call(self, name: str) -> Any:
            return getattr(self._inner, name)

        def cancel(self) -> bool:
            return bool(self._call("cancel")())

        def cancelled(self) -> bool:
            return bool(self._inner.cancelled())

        def done(self) -> bool:
            return bool(self._inner.done())

        def add_done_callback(self, callback: Any) -> None:
            self._inner.add_done_callback(lambda _: callback(self))

        def time_remaining(self) -> Any:
            return self._inner.time_remaining()

        async def initial_metadata(self) -> Any:
            return await self._inner.initial_metadata()

        async def trailing_metadata(self) -> Any:
            return await self._inner.trailing_metadata()

        async def code(self) -> Any:
            return await self._inner.code()

        async def details(self) -> Any:
            return await self._inner.details()

        async def debug_error_string(self) -> Any:
            return await self._inner.debug_error_string()

        async def wait_for_connection(self) -> None:
            await self._inner.wait_for_connection()

        def __aiter__(self) -> Any:
            return self._inner.__aiter__()

        async def read(self) -> Any:
            return await self._inner.read()

    class Wrapping(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
        async def intercept_unary_stream(
            self, continuation: Any, details: Any, request: Any
        ) -> Any:
            return Wrapped(await continuation(details, request))

    release = asyncio.Event()

    async def held(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"a"
        await release.wait()

    method = server.unary_stream("T", held)
    limiter = ConcurrencyLimiter(1, name="svc-limit")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), limiter=limiter, interceptors=[Wrapping()]
        ) as ch:
            first = ch.unary_stream(method)(b"x")
            assert await first.read() == b"a"
            assert limiter.in_flight == 1  # held while the stream is open
            release.set()
            assert await first.read() is aio.EOF
            await wait_until(lambda: limiter.in_flight == 0)


async def test_a_cancel_an_interceptor_held_back_sends_nothing_more(server: Server) -> None:
    """``call.cancel()`` while an application interceptor (which swallows its task's
    cancellation) waits before sending: ``cancel()`` says True, so nothing is sent after
    it, neither the attempt nor a retry (the attempt loop went on when the interceptor let
    it: the server saw two attempts and the reader got OK; a review)."""

    class Stubborn(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
        async def intercept_unary_stream(
            self, continuation: Any, details: Any, request: Any
        ) -> Any:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.3)
            return await continuation(details, request)

    async def two(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"a"

    method = server.unary_stream("S", two)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), interceptors=[Stubborn()]
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            await asyncio.sleep(0.05)
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()
            assert await call.code() is grpc.StatusCode.CANCELLED
            await asyncio.sleep(0.5)
    assert server.count("S") <= 1  # the interceptor's own continuation, at most


class _Take(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """A response iterator that ends early: after ``n`` responses, or with its own
    ``AioRpcError`` on a response it refuses, or mapping the server's error to one of the
    application's (``LookupError``)."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(details, request)
        how = self.how

        async def responses() -> AsyncIterator[bytes]:
            try:
                async for response in call:
                    if how == "refuse" and response == b"bad":
                        raise aio.AioRpcError(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            aio.Metadata(),
                            aio.Metadata(),
                            "the interceptor refused a response",
                        )
                    yield response
                    if how == "first":
                        return
            except aio.AioRpcError as err:
                if how != "map":
                    raise
                raise LookupError("mapped") from err

        return responses()


@pytest.mark.parametrize("how", ["first", "refuse"])
async def test_an_interceptor_iterator_that_ends_while_the_rpc_runs_ends_the_call(
    server: Server, how: str
) -> None:
    """The interceptor's iterator ends early (it takes the first response, or raises its own
    error) while the server still streams: the application's read waited for the server's
    status, which core gives only behind messages nobody would read now: it hung until the
    deadline, holding the limiter's permit (a review). The call ends at once."""
    release = asyncio.Event()

    async def streams(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        for message in (b"a", b"bad", b"c"):
            yield message
        await release.wait()

    method = server.unary_stream("T", streams)
    limiter = ConcurrencyLimiter(4, name="svc-limit")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), limiter=limiter, interceptors=[_Take(how)]
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            with anyio.fail_after(5):
                assert await call.read() == b"a"
                if how == "first":
                    assert await call.read() is aio.EOF
                else:
                    with pytest.raises(aio.AioRpcError) as info:
                        await call.read()
                    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    assert await call.code() is grpc.StatusCode.INVALID_ARGUMENT
                await wait_until(lambda: limiter.in_flight == 0)
            release.set()


async def test_a_server_error_an_interceptor_maps_keeps_its_status(server: Server) -> None:
    """The interceptor maps the server's UNAVAILABLE to an exception of the application's:
    the call ended with the server's status, so it is not a cancellation (it was booked
    one: ``cancelled()`` True and the request's outcome ``cancelled``; a review)."""

    async def one_then_fails(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"a"
        await abort(context, grpc.StatusCode.UNAVAILABLE)

    method = server.unary_stream("T", one_then_fails)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), interceptors=[_Take("map")]
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            assert await call.read() == b"a"
            with pytest.raises(LookupError, match="mapped"):
                await call.read()
            assert await call.code() is grpc.StatusCode.UNAVAILABLE
            assert not call.cancelled()


async def test_a_second_reader_at_once_leaves_the_first_reading(server: Server) -> None:
    """Two tasks iterate one call whose interceptor returned a response iterator: the
    second gets Python's RuntimeError, and the first reads on (the second's error was
    taken for the interceptor's and cancelled the call; a review). As plain grpc.aio."""
    release = asyncio.Event()

    async def streams(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"m0"
        await release.wait()
        yield b"m1"

    method = server.unary_stream("T", streams)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), interceptors=[_UpperUnaryStream()]
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            got: list[bytes] = []

            async def first() -> None:
                async for message in call:
                    got.append(message)

            reading = asyncio.ensure_future(first())
            await wait_until(lambda: got == [b"M0"])
            await asyncio.sleep(0.02)  # the first reader waits inside its next read
            with pytest.raises(RuntimeError, match="already running"):
                async for _ in call:
                    pass
            release.set()
            await reading
            assert got == [b"M0", b"M1"]
            assert await call.code() is grpc.StatusCode.OK
