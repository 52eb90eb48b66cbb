"""gRPC channel races a randomized schedule found (tests/grpc_a6/test_grpc_fuzz.py), each pinned.

Real grpc.aio server on 127.0.0.1. Where the race is one loop step wide, the test forces the
step: a done callback on the attempt grpc.aio made, or grpc.aio's ``Call.initial_metadata``
wrapped so that the application's ``call.cancel()`` runs the step after sdkcore read the
headers (only the timing is forced; the calls, the server and the channel are real). Each
test failed before its fix (CHANGELOG, "Fixed").
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc.aio import _call as aio_call
from grpc_server import TEST_TIMEOUT, Passthrough, Server, abort, wait_until

from sdkcore.grpc import insecure_channel, previous_rpc_attempts, retry_controller

pytestmark = pytest.mark.asyncio


def retry_config(codes: list[str], **extra: Any) -> str:
    policy = {
        "maxAttempts": 3,
        "initialBackoff": "0.001s",
        "maxBackoff": "0.001s",
        "backoffMultiplier": 1,
        "retryableStatusCodes": codes,
    }
    return json.dumps(
        {"methodConfig": [{"name": [{"service": "test.Svc"}], "retryPolicy": policy}], **extra}
    )


def hedging_config(delay: str) -> str:
    policy = {"maxAttempts": 2, "hedgingDelay": delay, "nonFatalStatusCodes": ["UNAVAILABLE"]}
    return json.dumps(
        {"methodConfig": [{"name": [{"service": "test.Svc"}], "hedgingPolicy": policy}]}
    )


async def test_cancel_after_an_attempt_failed_and_before_the_retry_ends_the_call(
    server: Server,
) -> None:
    """The first attempt's ABORTED is in; call.cancel() runs before the awaiting task resumes:
    True, and the call ends cancelled with nothing more sent (it used to retry and answer)."""

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        if n == 1:
            await abort(context, grpc.StatusCode.ABORTED)
        return b"ok"

    method = server.unary_unary("M", fn)
    returned: list[bool] = []
    async with insecure_channel(server.target, service_config=retry_config(["ABORTED"])) as ch:
        call = ch.unary_unary(method)(b"x")
        call._call.add_done_callback(lambda _: returned.append(call.cancel()))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, TEST_TIMEOUT)
        assert call.cancelled()
    assert returned == [True]
    assert server.count("M") == 1


async def test_cancel_as_the_retry_answers_is_consistent(server: Server) -> None:
    """call.cancel() the step after the retry's OK arrived: either False and the answer
    stands (as grpc.aio's cancel() of a call whose status is in), or True and the call
    ends cancelled. It used to say True, and the call then answered OK while
    cancelled() said True."""

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        if n == 1:
            await abort(context, grpc.StatusCode.ABORTED)
        return b"ok"

    method = server.unary_unary("M", fn)
    returned: list[bool] = []
    app_call: Any = None
    original = aio_call.Call.__init__

    def init(self: Any, cython_call: Any, metadata: Any, *args: Any, **kwargs: Any) -> None:
        original(self, cython_call, metadata, *args, **kwargs)
        if dict(self._metadata).get("grpc-previous-rpc-attempts") == "1":  # the retry
            loop = asyncio.get_running_loop()
            self.add_done_callback(
                lambda _: loop.call_soon(lambda: returned.append(app_call.cancel()))
            )

    aio_call.Call.__init__ = init
    try:
        async with insecure_channel(server.target, service_config=retry_config(["ABORTED"])) as ch:
            app_call = ch.unary_unary(method)(b"x")
            try:
                outcome: Any = await asyncio.wait_for(app_call, TEST_TIMEOUT)
            except asyncio.CancelledError as exc:
                outcome = exc
            cancelled = app_call.cancelled()
    finally:
        aio_call.Call.__init__ = original
    assert len(returned) == 1
    if returned[0]:
        assert isinstance(outcome, asyncio.CancelledError)
        assert cancelled
    else:
        assert outcome == b"ok"
        assert not cancelled
    assert server.count("M") == 2


@pytest.mark.parametrize("config", [retry_config(["UNAVAILABLE"]), None])
async def test_cancelling_the_task_reading_a_stream_cancels_the_rpc(
    server: Server, config: str | None
) -> None:
    """As on a plain grpc.aio channel: the server sees the cancellation."""
    cancelled = asyncio.Event()

    async def hang(request: bytes, context: Any, n: int) -> Any:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        yield b"never"

    method = server.unary_stream("S", hang)
    async with insecure_channel(server.target, service_config=config) as ch:
        call = ch.unary_stream(method)(b"x")

        async def reader() -> list[bytes]:
            return [m async for m in call]

        task = asyncio.create_task(reader())
        while server.count("S") == 0:  # noqa: ASYNC110 - the server's count has no event
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(cancelled.wait(), TEST_TIMEOUT)
        assert call.cancelled()


async def test_an_ok_stream_with_no_message_adds_one_token_ratio(server: Server) -> None:
    async def unavailable(request: bytes, context: Any, n: int) -> bytes:
        await abort(context, grpc.StatusCode.UNAVAILABLE)
        return b""

    async def empty_ok(request: bytes, context: Any, n: int) -> Any:
        return
        yield  # an async generator that sends no message

    fail = server.unary_unary("Fail", unavailable)
    empty = server.unary_stream("Empty", empty_ok)
    config = retry_config(["UNAVAILABLE"], retryThrottling={"maxTokens": 10, "tokenRatio": 1})
    async with insecure_channel(server.target, service_config=config) as ch:
        throttler = retry_controller(ch).throttler
        assert throttler is not None
        with pytest.raises(aio.AioRpcError):
            await ch.unary_unary(fail)(b"x")
        before = throttler.tokens
        assert [m async for m in ch.unary_stream(empty)(b"x")] == []
        assert throttler.tokens - before == 1.0


@pytest.mark.parametrize("later", [False, True])
async def test_cancel_as_a_hedge_commits_cancels_the_call_and_the_committed_hedge(
    server: Server, later: bool
) -> None:
    """Hedge 1 sends its headers (it commits); the application cancels the step after sdkcore
    read them (the cancel used to be lost: the call answered) or two steps after (the call
    ended cancelled but hedge 1's RPC ran on the server)."""
    loop = asyncio.get_running_loop()
    hedge1_cancelled = asyncio.Event()

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        index = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts", "0")
        try:
            if index == "1":
                await context.send_initial_metadata((("x-headers", "1"),))
            await asyncio.sleep(10)
            return b"late"
        except asyncio.CancelledError:
            if index == "1":
                hedge1_cancelled.set()
            raise

    method = server.unary_unary("M", fn)
    app_call: Any = None
    returned: list[bool] = []
    original = aio_call.Call.initial_metadata

    async def initial_metadata(self: Any) -> Any:
        md = await original(self)
        if md and app_call is not None:
            if later:
                loop.call_soon(lambda: loop.call_soon(lambda: returned.append(app_call.cancel())))
            else:
                loop.call_soon(lambda: returned.append(app_call.cancel()))
        return md

    aio_call.Call.initial_metadata = initial_metadata
    try:
        async with insecure_channel(server.target, service_config=hedging_config("0.005s")) as ch:
            app_call = ch.unary_unary(method)(b"x")
            with pytest.raises(asyncio.CancelledError):
                await app_call  # awaited here, as an application does (the handler ends in 10 s)
            await asyncio.wait_for(hedge1_cancelled.wait(), TEST_TIMEOUT)
    finally:
        aio_call.Call.initial_metadata = original
    assert returned == [True]


async def test_a_fatal_status_reports_its_own_hedges_index(server: Server) -> None:
    """Hedge 1 fails INVALID_ARGUMENT (fatal) and is booked first; hedge 0's ABORTED is read
    after it: the call's status is hedge 1's, and so is its grpc-previous-rpc-attempts."""
    hedge0_done = asyncio.Event()
    original_read = aio_call._StreamResponseMixin.read
    original_init = aio_call.Call.__init__

    def init(self: Any, cython_call: Any, metadata: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, cython_call, metadata, *args, **kwargs)
        if not any(key == "grpc-previous-rpc-attempts" for key, _ in self._metadata):
            self.add_done_callback(lambda _: hedge0_done.set())

    async def read(self: Any) -> Any:
        try:
            return await original_read(self)
        except aio.AioRpcError:
            await hedge0_done.wait()  # hedge 1's failure is read once hedge 0's arrived
            raise

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        index = dict(context.invocation_metadata()).get("grpc-previous-rpc-attempts", "0")
        if index == "0":
            await asyncio.sleep(0.05)
            await abort(context, grpc.StatusCode.ABORTED)
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT)
        return b""

    method = server.unary_unary("M", fn)
    aio_call._StreamResponseMixin.read = read
    aio_call.Call.__init__ = init
    try:
        async with insecure_channel(server.target, service_config=hedging_config("0s")) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await asyncio.wait_for(ch.unary_unary(method)(b"x"), TEST_TIMEOUT)
    finally:
        aio_call._StreamResponseMixin.read = original_read
        aio_call.Call.__init__ = original_init
    if info.value.code() is grpc.StatusCode.INVALID_ARGUMENT:
        assert previous_rpc_attempts(info.value) == 1
    else:  # hedge 0's ABORTED was booked first after all: its own index
        assert info.value.code() is grpc.StatusCode.ABORTED
        assert previous_rpc_attempts(info.value) == 0


async def test_a_cancelled_hedged_call_leaves_the_channels_close_set_at_once(
    server: Server,
) -> None:
    """A hedged call whose runner started is in the set of calls the channel's close
    cancels; ``call.cancel()`` takes it out at once (it is done as far as close goes), not a
    turn later when the runner's task has ended (300 fuzz seeds once found it there)."""

    async def hangs(request: bytes, context: Any, n: int) -> bytes:
        await asyncio.sleep(10)
        return b"late"

    method = server.unary_unary("H", hangs)
    async with insecure_channel(server.target, service_config=hedging_config("0.001s")) as ch:
        waiting = retry_controller(ch)._waiting
        call = ch.unary_unary(method)(b"x")
        await asyncio.wait_for(wait_until(lambda: call in waiting), TEST_TIMEOUT)
        assert call.cancel()
        assert call not in waiting
        with pytest.raises(asyncio.CancelledError):
            await call


@pytest.mark.parametrize("interceptor", [False, True], ids=["plain", "app_interceptor"])
async def test_the_awaiting_task_cancelled_as_the_first_attempt_failed_ends_the_call(
    server: Server, interceptor: bool
) -> None:
    """The awaiting task is cancelled in the turn after the first attempt's UNAVAILABLE (a
    retryable status) came in, before it resumed: the call is cancelled with it and nothing
    more is sent. It was left pending, and a later reader (or, with an application
    interceptor, the call's own watcher) sent a retry after the cancel and answered OK."""

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        if n == 1:
            await abort(context, grpc.StatusCode.UNAVAILABLE)
        return b"ok"

    method = server.unary_unary("M", fn)
    loop = asyncio.get_running_loop()
    async with insecure_channel(
        server.target,
        service_config=retry_config(["UNAVAILABLE"]),
        interceptors=[Passthrough()] if interceptor else None,
    ) as ch:
        call = ch.unary_unary(method)(b"x")
        task = asyncio.ensure_future(call)
        call._call.add_done_callback(lambda _: loop.call_soon(task.cancel))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, TEST_TIMEOUT)
        await asyncio.sleep(0.05)  # nobody reads the call meanwhile
        assert server.count("M") == 1
        assert await asyncio.wait_for(call.code(), TEST_TIMEOUT) is grpc.StatusCode.CANCELLED
        assert call.cancelled()
        assert call.done()
    assert server.count("M") == 1
