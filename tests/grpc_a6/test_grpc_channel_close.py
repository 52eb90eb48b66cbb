"""Closing an sdkcore channel ends its calls as grpc.aio ends the calls in flight.

grpc.aio's ``Channel.close()`` refuses new calls and cancels the calls it tracks: an
awaiting task gets ``asyncio.CancelledError``, ``code()`` is CANCELLED and ``details()``
"Locally cancelled by application!" (checked against a plain grpc.aio call below). A
call waiting in sdkcore's backoff, in a transparent retry's delay or between hedges
has no attempt in flight for grpc.aio to cancel: it must end the same way, at once
(not when its wait ends), and send no further attempt. grpc.aio's close is
asyncio-only, hence no trio variants. Every wait here is at least 8 s (proportional
jitter of a 10 s backoff), so "at once" is checked with a bound far below it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    Passthrough,
    ReservedPort,
    Server,
    abort,
    retry_config,
    wait_until,
)
from hedge_server import UNAVAILABLE, HedgeScript, block, fail, hedging_config  # noqa: E402

from sdkcore import RetryOrchestrator  # noqa: E402
from sdkcore.grpc import BackoffJitter, RetryController, insecure_channel, retry_stats  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio

#: A backoff no test waits for: 10 s, drawn in 8-12 s.
LONG = {"initial": "10s", "maximum": "10s"}
#: Much less than any wait here, much more than a close takes.
PROMPT = 4.0
CANCELLED_DETAILS = "Locally cancelled by application!"


def always(code: Any = UNAVAILABLE) -> Any:
    async def fn(request: Any, context: Any, attempt: int) -> bytes:
        await abort(context, code)
        return b""

    return fn


def hold_then(seconds: float, then: Any) -> Any:
    async def fn(request: Any, context: Any, attempt: int) -> bytes:
        await asyncio.sleep(seconds)
        return await then(request, context, attempt)  # type: ignore[no-any-return]

    return fn


def ok() -> Any:
    async def fn(request: Any, context: Any, attempt: int) -> bytes:
        return b"ok"

    return fn


def hang() -> Any:
    async def fn(request: Any, context: Any, attempt: int) -> bytes:
        await asyncio.Event().wait()
        return b""

    return fn


async def outcome(aw: Any) -> Any:
    """What awaiting ``aw`` gives: its result, or the exception (CancelledError included)."""
    try:
        return await aw
    except BaseException as exc:  # the outcome is what the test checks
        return exc


async def ended(task: Any) -> Any:
    """The outcome of ``task``: a cancel scope expiring around this raises, not ``task``."""
    return await asyncio.shield(task)


def scheduled(events: list[Any]) -> Callable[[], bool]:
    return lambda: any(e["event"] == "retry.scheduled" for e in events)


async def in_flight_at_close(server: Server) -> tuple[Any, Any, Any, bool]:
    """A plain grpc.aio call in flight when its channel closes: what its reader sees."""
    method = server.unary_unary("Native", hang())
    channel = aio.insecure_channel(server.target)
    call = channel.unary_unary(method)(b"x")
    waiting = asyncio.ensure_future(outcome(call))
    await wait_until(lambda: server.count("Native") == 1)
    await channel.close()
    return await ended(waiting), await call.code(), await call.details(), call.cancelled()


async def test_a_unary_call_in_backoff_ends_as_grpc_aio_ends_a_call_in_flight(
    server: Server,
) -> None:
    native_exc, native_code, native_details, native_cancelled = await in_flight_at_close(server)
    assert type(native_exc) is asyncio.CancelledError
    method = server.unary_unary("M", always())
    cfg = retry_config(max_attempts=5, **LONG)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        )
        call = ch.unary_unary(method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(scheduled(events))
        with anyio.fail_after(PROMPT):
            await ch.close()
            exc = await ended(waiting)
        # Before: grpc's raw UsageError("Channel is closed."), once the 8-12 s wait ended.
        assert type(exc) is type(native_exc)
        assert await call.code() is native_code is grpc.StatusCode.CANCELLED
        assert await call.details() == native_details == CANCELLED_DETAILS
        assert call.cancelled() is native_cancelled is True
        assert call.done()
        await asyncio.sleep(0.1)
    assert server.count("M") == 1  # no attempt after the close


async def test_a_call_nobody_awaits_is_cancelled_in_its_backoff(server: Server) -> None:
    """The retry loop runs in a task of its own: the readers see the cancellation."""
    method = server.unary_unary("M", always())
    cfg = retry_config(max_attempts=5, **LONG)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        )
        call = ch.unary_unary(method)(b"x")
        await wait_until(scheduled(events))
        with anyio.fail_after(PROMPT):
            await ch.close()
            assert await call.code() is grpc.StatusCode.CANCELLED
        assert call.cancelled()
        assert type(await outcome(call)) is asyncio.CancelledError
    assert server.count("M") == 1


async def test_a_call_waiting_to_retry_a_failed_connection_ends_cancelled() -> None:
    """No connection can be made: the attempt fails fast with UNAVAILABLE (as grpcio's), and
    the call waits in the policy's backoff when the channel closes."""
    with (
        ReservedPort() as port,
        anyio.fail_after(TEST_TIMEOUT),
        capture_retry_events() as events,
    ):
        ch = insecure_channel(port.target, service_config=retry_config(max_attempts=5, **LONG))
        call = ch.unary_unary("/test.Svc/M")(b"x", timeout=60)
        waiting = asyncio.ensure_future(outcome(call))
        stats = retry_stats(ch)
        await wait_until(lambda: any(e["event"] == "retry.scheduled" for e in events))
        with anyio.fail_after(PROMPT):
            await ch.close()
            exc = await ended(waiting)
        assert type(exc) is asyncio.CancelledError  # before: UsageError
        assert await call.code() is grpc.StatusCode.CANCELLED
        sent = stats.for_method("/test.Svc/M").retry_attempts
        await asyncio.sleep(0.3)
        assert stats.for_method("/test.Svc/M").retry_attempts == sent  # nothing after close


async def test_close_with_a_grace_ends_waiting_calls_at_once_and_lets_attempts_finish(
    server: Server,
) -> None:
    """``close(grace)``: calls in backoff end at once; an attempt in flight may finish.

    grpc.aio refuses new calls as soon as close starts, so a call whose attempt then
    fails with a retryable status ends cancelled at once instead of waiting to retry;
    one whose attempt succeeds within the grace returns its response.
    """
    waiting_m = server.unary_unary("Waiting", always())
    failing_m = server.unary_unary("Failing", hold_then(0.3, always()))
    ok_m = server.unary_unary("Ok", hold_then(0.3, ok()))
    cfg = retry_config(max_attempts=5, **LONG)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        )
        in_backoff = asyncio.ensure_future(outcome(ch.unary_unary(waiting_m)(b"x")))
        await wait_until(scheduled(events))
        failing = asyncio.ensure_future(outcome(ch.unary_unary(failing_m)(b"x")))
        succeeding = asyncio.ensure_future(outcome(ch.unary_unary(ok_m)(b"x")))
        await wait_until(lambda: server.count("Failing") == server.count("Ok") == 1)
        with anyio.fail_after(PROMPT):
            closing = asyncio.ensure_future(ch.close(grace=8))
            assert type(await ended(in_backoff)) is asyncio.CancelledError
            assert not closing.done()  # ended before the grace, not by its end
            assert type(await ended(failing)) is asyncio.CancelledError
            assert await ended(succeeding) == b"ok"
            await closing
        await asyncio.sleep(0.1)
    assert (server.count("Waiting"), server.count("Failing"), server.count("Ok")) == (1, 1, 1)


def streaming_methods(server: Server) -> dict[str, Callable[[Any], Any]]:
    """Each streaming shape, failing UNAVAILABLE; how to call it and await its outcome."""

    async def unary_stream(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        await abort(context, UNAVAILABLE)
        yield b""

    async def stream_unary(requests: Any, context: Any, attempt: int) -> bytes:
        async for _ in requests:
            pass
        await abort(context, UNAVAILABLE)
        return b""

    async def stream_stream(requests: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        async for _ in requests:
            pass
        await abort(context, UNAVAILABLE)
        yield b""

    us = server.unary_stream("US", unary_stream)
    su = server.stream_unary("SU", stream_unary)
    ss = server.stream_stream("SS", stream_stream)
    return {
        "US": lambda ch: ch.unary_stream(us)(b"x"),
        "SU": lambda ch: ch.stream_unary(su)(iter([b"x"])),
        "SS": lambda ch: ch.stream_stream(ss)(iter([b"x"])),
    }


@pytest.mark.parametrize("shape", ["US", "SU", "SS"])
@pytest.mark.parametrize("grace", [None, 8.0])
async def test_a_streaming_call_in_backoff_ends_cancelled(
    server: Server, shape: str, grace: float | None
) -> None:
    """Without a grace grpc.aio cancelled these already (its interceptor call); with one,
    the call slept through the grace and then met UsageError."""
    make = streaming_methods(server)[shape]
    cfg = retry_config(max_attempts=5, **LONG)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        )
        call = make(ch)
        waiting = asyncio.ensure_future(outcome(call if shape == "SU" else call.read()))
        await wait_until(scheduled(events))
        with anyio.fail_after(PROMPT):
            await ch.close(grace)
            exc = await ended(waiting)
            assert type(exc) is asyncio.CancelledError
            assert await call.code() is grpc.StatusCode.CANCELLED
        assert call.cancelled()
        await asyncio.sleep(0.1)
    assert server.count(shape) == 1


# (NaN: grpc.aio closes with it as with a grace; the channel's check took it for a
# negative grace grpc.aio refuses, and left the waiting calls alone)
@pytest.mark.parametrize("grace", [None, 8.0, math.nan])
async def test_a_hedged_call_waiting_for_its_next_hedge_ends_cancelled(
    server: Server, grace: float | None
) -> None:
    """Hedge 0 failed with a pushback of 10 s: no hedge in flight, the next one waits."""
    script = HedgeScript(server, "H", {0: fail(UNAVAILABLE, pushback="10000")})
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = insecure_channel(server.target, service_config=hedging_config(max_attempts=3))
        call = ch.unary_unary(script.method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(lambda: any(e["event"] == "hedge.failed" for e in events))
        with anyio.fail_after(PROMPT):
            await ch.close(grace)
            exc = await ended(waiting)
        assert type(exc) is asyncio.CancelledError  # before: UsageError after 10 s
        assert await call.code() is grpc.StatusCode.CANCELLED
        assert call.cancelled()
        await asyncio.sleep(0.1)
    assert script.count == 1


async def test_a_hedged_call_with_hedges_in_flight_cancels_them_all(server: Server) -> None:
    """Hedges after the first are not calls grpc.aio tracks: the close cancels them too
    (so it did before; a guard for the hedged call the close now cancels itself)."""
    script = HedgeScript(server, "H", {0: block(), 1: block()})
    config = hedging_config(max_attempts=3, delay="0.2s")
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=config)
        call = ch.unary_unary(script.method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(lambda: script.count == 2)
        with anyio.fail_after(PROMPT):
            await ch.close()
            exc = await ended(waiting)
        assert type(exc) is asyncio.CancelledError
        assert await call.code() is grpc.StatusCode.CANCELLED
        await wait_until(lambda: script.cancelled() == {0, 1})
        await asyncio.sleep(0.3)
    assert script.count == 2  # the third hedge, due 0.2 s later, was never sent


async def test_a_hand_wired_channel_closed_with_a_grace_ends_the_call_cancelled(
    server: Server,
) -> None:
    """RetryController.interceptors() on a plain grpc.aio channel: sdkcore does not see the
    close, but the attempt the closed channel refuses ends the call cancelled, not with
    grpc's UsageError."""
    method = server.unary_unary("M", always())
    cfg = retry_config(max_attempts=5, initial="0.5s", maximum="0.5s")
    controller = RetryController(server.target, cfg, backoff_jitter=BackoffJitter.PROPORTIONAL)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = aio.insecure_channel(
            server.target,
            interceptors=controller.interceptors(),
            options=controller.channel_options(),
        )
        controller.bind_channel(ch)
        call = ch.unary_unary(method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(scheduled(events))
        closing = asyncio.ensure_future(ch.close(grace=8))
        exc = await ended(waiting)
        assert type(exc) is asyncio.CancelledError  # before: UsageError
        assert await call.code() is grpc.StatusCode.CANCELLED
        await closing
    assert server.count("M") == 1


async def test_a_call_on_a_closed_channel_is_refused_as_grpc_aio_refuses_it(
    server: Server,
) -> None:
    """Unchanged: the first attempt on a closed channel raises grpc's UsageError."""
    method = server.unary_unary("M", ok())
    ch = insecure_channel(server.target, service_config=retry_config())
    await ch.close()
    with pytest.raises(aio.UsageError):
        ch.unary_unary(method)(b"x")


@pytest.mark.parametrize(
    ("code", "ends_with"),
    [(UNAVAILABLE, "cancelled"), (grpc.StatusCode.INVALID_ARGUMENT, "its status")],
)
async def test_hedge_zero_failing_during_a_grace_sends_no_other_hedge(
    server: Server, code: Any, ends_with: str
) -> None:
    """Hedge 0 is in flight when ``close(grace)`` starts and fails within the grace: a
    non-fatal status ends the call cancelled (no hedge can follow), a fatal one is the
    call's answer, as for a call that is not hedged."""
    script = HedgeScript(server, "H", {0: fail(code, delay=0.3)})
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=hedging_config(delay="5s"))
        call = ch.unary_unary(script.method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(lambda: script.count == 1)
        with anyio.fail_after(PROMPT):
            closing = asyncio.ensure_future(ch.close(grace=8))
            exc = await ended(waiting)
            await closing
        if ends_with == "cancelled":
            assert type(exc) is asyncio.CancelledError
            assert await call.code() is grpc.StatusCode.CANCELLED
        else:
            assert isinstance(exc, aio.AioRpcError)
            assert exc.code() is code
        await asyncio.sleep(0.1)
    assert script.count == 1


@pytest.mark.parametrize("interceptor", [False, True], ids=["plain", "app_interceptor"])
async def test_close_starting_as_a_backoff_ends_ends_the_call_cancelled(
    server: Server, interceptor: bool
) -> None:
    """``close(grace)`` starts in the turn the backoff ends, so the retry attempt is refused.
    With an application interceptor the refusal came out of ``await call`` as grpc's raw
    ``UsageError`` ("Channel is closed.") instead of the cancellation rfc/0003 promises."""
    method = server.unary_unary("Failing", always())
    holder: dict[str, Any] = {}

    async def sleep(seconds: float) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def end_backoff_and_close() -> None:
            done.set_result(None)  # the backoff ends...
            holder["close"] = asyncio.ensure_future(holder["ch"].close(0.5))  # ...as close starts

        loop.call_later(seconds, end_backoff_and_close)
        await done

    cfg = retry_config(max_attempts=5, initial="0.05s", maximum="0.05s")
    with anyio.fail_after(TEST_TIMEOUT):
        ch = holder["ch"] = insecure_channel(
            server.target,
            service_config=cfg,
            orchestrator=RetryOrchestrator(sleep=sleep),
            interceptors=[Passthrough()] if interceptor else None,
        )
        call = ch.unary_unary(method)(b"x")
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await call.code() is grpc.StatusCode.CANCELLED
        await holder["close"]
