"""Closing an sdkcore channel ends its calls as grpc.aio ends the calls in flight.

grpc.aio's ``Channel.close()`` refuses new calls and cancels the calls it tracks: an
awaiting task gets ``asyncio.CancelledError``, ``code()`` is CANCELLED and ``details()``
"Locally cancelled by application!" (checked against a plain grpc.aio call below). A
call waiting in sdkcore's backoff, in a transparent retry's delay or between hedges
has no attempt in flight for grpc.aio to cancel: it must end the same way, at once
(not when its wait ends), and send no further attempt. ``close(grace)`` first lets
sdkcore's calls retry and hedge within the grace (as grpcio's own retries do inside one
C-core call), refusing new calls, and ends the rest when the grace is over. grpc.aio's
close is asyncio-only, hence no trio variants. Every wait here is at least 8 s
(proportional jitter of a 10 s backoff), so "at once" is checked with a bound far below it.
"""

from __future__ import annotations

import asyncio
import gc
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, TypedDict

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
from hedge_server import ok as answer  # noqa: E402

from sdkcore import RetryOrchestrator  # noqa: E402
from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    RetryController,
    insecure_channel,
    retry_controller,
    retry_stats,
)
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio


class Backoff(TypedDict):
    """``retry_config``'s backoff keywords."""

    initial: str
    maximum: str


#: A backoff no test waits for: 10 s, drawn in 8-12 s.
LONG: Backoff = {"initial": "10s", "maximum": "10s"}
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


async def in_long_backoff(server: Server) -> tuple[Any, Any, Any]:
    """A channel, and a call of method "M" (always UNAVAILABLE) waiting 8-12 s to retry:
    ``(channel, call, task awaiting the call's outcome)``."""
    method = server.unary_unary("M", always())
    cfg = retry_config(max_attempts=5, **LONG)
    with capture_retry_events() as events:
        ch = insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        )
        call = ch.unary_unary(method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(scheduled(events))
    return ch, call, waiting


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
    with anyio.fail_after(TEST_TIMEOUT):
        ch, call, waiting = await in_long_backoff(server)
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


def fail_first_then_ok(hold: float = 0.0) -> Any:
    """The first attempt fails UNAVAILABLE (after ``hold`` seconds), every later one is OK."""

    async def fn(request: Any, context: Any, attempt: int) -> bytes:
        await asyncio.sleep(hold)
        if attempt == 1:
            await abort(context, UNAVAILABLE)
        return b"ok"

    return fn


async def test_close_with_a_grace_lets_a_call_in_backoff_retry_and_succeed(
    server: Server,
) -> None:
    """A call waiting 0.3 s to retry when ``close(grace=8)`` starts is retried within the
    grace and succeeds, as with grpcio's own retries; the close ends as soon as sdkcore's
    calls are over, not at the grace's end. Before: the call ended cancelled at once."""
    method = server.unary_unary("M", fail_first_then_ok())
    cfg = retry_config(max_attempts=3, initial="0.3s", maximum="0.3s")
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        ch = insecure_channel(server.target, service_config=cfg)
        call = ch.unary_unary(method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(scheduled(events))
        with anyio.fail_after(PROMPT):
            await ch.close(grace=8)  # waits for the call: grpc.aio's close would cut it
        assert await ended(waiting) == b"ok"
        assert await call.code() is grpc.StatusCode.OK
    assert server.count("M") == 2


async def test_close_with_a_grace_retries_an_attempt_that_fails_within_it(
    server: Server,
) -> None:
    """An attempt in flight when the close starts fails 0.3 s later: it is retried within
    the grace (before: the call ended cancelled, grpc.aio refusing the new attempt); an
    attempt that succeeds within the grace returns its response; the close returns once
    both calls are over."""
    failing_m = server.unary_unary("Failing", fail_first_then_ok(hold=0.3))
    ok_m = server.unary_unary("Ok", hold_then(0.3, ok()))
    cfg = retry_config(max_attempts=3, initial="0.05s", maximum="0.05s")
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=cfg)
        failing = asyncio.ensure_future(outcome(ch.unary_unary(failing_m)(b"x")))
        succeeding = asyncio.ensure_future(outcome(ch.unary_unary(ok_m)(b"x")))
        await wait_until(lambda: server.count("Failing") == server.count("Ok") == 1)
        with anyio.fail_after(PROMPT):
            await ch.close(grace=8)  # waits for both (their tasks may resume a turn later)
        assert await ended(failing) == b"ok"
        assert await ended(succeeding) == b"ok"
    assert (server.count("Failing"), server.count("Ok")) == (2, 1)


async def test_close_with_a_grace_ends_a_call_still_waiting_when_the_grace_is_over(
    server: Server,
) -> None:
    """A backoff of 8-12 s outlasts a grace of 0.5 s: the call ends cancelled when the
    grace is over (as grpcio ends its calls then), and no attempt follows."""
    with anyio.fail_after(TEST_TIMEOUT):
        ch, call, waiting = await in_long_backoff(server)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with anyio.fail_after(PROMPT):
            await ch.close(grace=0.5)
            exc = await ended(waiting)
        assert loop.time() - start >= 0.45  # it waited for the grace
        assert type(exc) is asyncio.CancelledError
        assert await call.code() is grpc.StatusCode.CANCELLED
        await asyncio.sleep(0.1)
    assert server.count("M") == 1


async def test_new_calls_during_a_grace_are_refused_as_grpc_aio_refuses_them(
    server: Server,
) -> None:
    """While ``close(grace)`` waits for a retrying call, grpc.aio's channel is still open:
    every new call (a retried method, one without a plan, each streaming shape) is refused
    with grpc.aio's ``UsageError("Channel is closed.")`` all the same, when it is made (as
    plain grpc.aio refuses a call on a closed channel), and nothing reaches the server."""
    method = server.unary_unary("M", fail_first_then_ok())
    plain = server.unary_unary("Plain", ok())
    streams = streaming_methods(server)
    cfg = retry_config(max_attempts=3, initial="1s", maximum="1s")
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        # 0.8-1.2 s: A6's full jitter drew a backoff below the 0.05 s looked at below one
        # time in twenty, and the call was over before the close was seen waiting for it
        ch = insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        )
        call = ch.unary_unary(method)(b"x")
        await wait_until(scheduled(events))
        closing = asyncio.ensure_future(ch.close(grace=8))
        await asyncio.sleep(0.05)
        assert not closing.done()  # waiting for the call in its 1 s backoff
        with pytest.raises(aio.UsageError, match="Channel is closed"):
            ch.unary_unary(method)(b"x")
        for name in ("Plain", "/test.Svc/Unknown"):
            target = plain if name == "Plain" else name
            with pytest.raises(aio.UsageError, match="Channel is closed"):
                ch.unary_unary(target)(b"x")
        for make in streams.values():
            # Refused at the call, as plain grpc.aio refuses every shape on a closed channel
            with pytest.raises(aio.UsageError, match="Channel is closed"):
                make(ch)
        assert await call == b"ok"  # the call made before the close is retried
        await closing
    assert (server.count("M"), server.count("Plain")) == (2, 0)
    assert sum(server.count(shape) for shape in streams) == 0


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
@pytest.mark.parametrize("grace", [None, 0.5])
async def test_a_streaming_call_in_backoff_ends_cancelled(
    server: Server, shape: str, grace: float | None
) -> None:
    """Without a grace grpc.aio cancelled these already (its interceptor call); with one,
    the call slept through the grace and then met UsageError. Now it ends cancelled at
    once, or when a grace shorter than its backoff is over."""
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
@pytest.mark.parametrize("grace", [None, 0.5, math.nan])
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
    [(UNAVAILABLE, "the next hedge"), (grpc.StatusCode.INVALID_ARGUMENT, "its status")],
)
async def test_hedge_zero_failing_during_a_grace_is_hedged_within_it(
    server: Server, code: Any, ends_with: str
) -> None:
    """Hedge 0 is in flight when ``close(grace)`` starts and fails within the grace: a
    non-fatal status sends the next hedge, whose answer is the call's (as grpcio's hedging
    within its grace; before: the call ended cancelled); a fatal one is the call's answer."""
    script = HedgeScript(server, "H", {0: fail(code, delay=0.3), 1: answer()})
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=hedging_config(delay="5s"))
        call = ch.unary_unary(script.method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(lambda: script.count == 1)
        with anyio.fail_after(PROMPT):
            await ch.close(grace=8)
            exc = await ended(waiting)
        if ends_with == "the next hedge":
            assert exc == b"ok"
            assert script.count == 2
        else:
            assert isinstance(exc, aio.AioRpcError)
            assert exc.code() is code
            assert script.count == 1


async def test_a_hedge_due_within_the_grace_is_sent(server: Server) -> None:
    """Hedge 0 hangs; the next hedge is due 0.3 s after it, within a grace of 8 s: it goes
    out and answers the call, and the close returns then (hedge 0 is cancelled)."""
    script = HedgeScript(server, "H", {0: block(), 1: answer()})
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(
            server.target, service_config=hedging_config(max_attempts=2, delay="0.3s")
        )
        call = ch.unary_unary(script.method)(b"x")
        waiting = asyncio.ensure_future(outcome(call))
        await wait_until(lambda: script.count == 1)
        with anyio.fail_after(PROMPT):
            await ch.close(grace=8)
        assert await ended(waiting) == b"ok"
        await wait_until(lambda: script.cancelled() == {0})
    assert script.count == 2


async def test_a_close_without_grace_during_a_grace_ends_everything_at_once(
    server: Server,
) -> None:
    """A second ``close()`` (no grace) while the first waits within its grace: the calls
    end cancelled at once and both closes return."""
    with anyio.fail_after(TEST_TIMEOUT):
        ch, _, waiting = await in_long_backoff(server)
        graceful = asyncio.ensure_future(ch.close(grace=30))
        await asyncio.sleep(0.05)
        assert not graceful.done()
        with anyio.fail_after(PROMPT):
            await ch.close()
            await graceful
            exc = await ended(waiting)
        assert type(exc) is asyncio.CancelledError
    assert server.count("M") == 1


async def test_the_channel_waits_for_no_call_once_they_are_over(server: Server) -> None:
    """Every way a call ends lets go of it (OK, a final status, retried then OK, cancelled,
    hedged, streaming): a later ``close(grace=30)`` returns at once."""
    okm = server.unary_unary("Ok", ok())
    bad = server.unary_unary("Bad", always(grpc.StatusCode.INVALID_ARGUMENT))
    flaky = server.unary_unary("Flaky", fail_first_then_ok())
    hung = server.unary_unary("Hung", hang())
    streams = streaming_methods(server)
    cfg = retry_config(max_attempts=2, initial="0.01s", maximum="0.01s")
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=cfg)
        assert await ch.unary_unary(okm)(b"x") == b"ok"
        assert type(await outcome(ch.unary_unary(bad)(b"x"))) is aio.AioRpcError
        assert await ch.unary_unary(flaky)(b"x") == b"ok"
        cut = ch.unary_unary(hung)(b"x")
        await wait_until(lambda: server.count("Hung") == 1)
        cut.cancel()
        assert type(await outcome(cut)) is asyncio.CancelledError
        for shape, make in streams.items():
            stream_call = make(ch)
            await outcome(stream_call if shape == "SU" else stream_call.read())
        fired = ch.unary_unary(okm)(b"x")  # nobody awaits it
        await wait_until(fired.done)
        with anyio.fail_after(PROMPT):
            await ch.close(grace=30)
    hedged = HedgeScript(server, "H", {0: answer()})
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=hedging_config())
        assert await ch.unary_unary(hedged.method)(b"x") == b"ok"
        with anyio.fail_after(PROMPT):
            await ch.close(grace=30)


async def test_a_streaming_call_made_a_turn_before_close_grace_is_served(server: Server) -> None:
    """A streaming call made just before ``close(grace)``: the channel had let it in, but its
    first attempt (made by its own task a turn later) was refused as if it were new. It
    goes out within the grace now, as with grpc.aio (a review's repro)."""

    async def one(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"a"

    stream = server.unary_stream("S", one)
    slow = server.unary_unary("Slow", hold_then(0.3, ok()))
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=retry_config())
        keep = asyncio.ensure_future(outcome(ch.unary_unary(slow)(b"x")))  # the close waits
        await wait_until(lambda: server.count("Slow") == 1)
        # made now; its attempt task runs its first step after close(grace) began
        reader = asyncio.ensure_future(outcome(ch.unary_stream(stream)(b"x").read()))
        with anyio.fail_after(PROMPT):
            await ch.close(grace=5)
        assert await ended(reader) == b"a"
        assert await ended(keep) == b"ok"


def _bad_size(message: Any) -> int:
    if message == b"bad":
        raise ValueError("cannot size")
    return len(message)


class _Failing(aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """An application interceptor that raises instead of handing the call on."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        raise RuntimeError("interceptor failed")


async def test_a_call_whose_making_raised_is_not_waited_for(server: Server) -> None:
    """A call whose making raised (the channel's ``message_size`` refused the message) was
    noted as a live call before the error, and a later ``close(grace=30)`` waited the whole
    grace for it; so did a streaming call whose first message could not be sized."""
    method = server.unary_unary("M", ok())

    async def one(request: Any, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield b"a"

    stream = server.unary_stream("S", one)
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(server.target, service_config=retry_config(), message_size=_bad_size)
        with pytest.raises(ValueError, match="cannot size"):
            ch.unary_unary(method)(b"bad")
        with pytest.raises(ValueError, match="cannot size"):  # at the call, as unary-unary
            ch.unary_stream(stream)(b"bad")
        with anyio.fail_after(PROMPT):
            await ch.close(grace=30)


@pytest.mark.parametrize("read", ["nobody", "code", "await"])
async def test_a_call_an_application_interceptor_failed_is_over(server: Server, read: str) -> None:
    """An application interceptor raised instead of sending: a call nobody awaited, or read
    only through ``code()``, never ended (``done()`` stayed False, its replay buffer stayed
    reserved) and ``close(grace=30)`` waited the whole grace for it."""
    method = server.unary_unary("M", ok())
    with anyio.fail_after(TEST_TIMEOUT):
        ch = insecure_channel(
            server.target, service_config=retry_config(), interceptors=[_Failing()]
        )
        call = ch.unary_unary(method)(b"x")
        if read == "code":
            assert type(await outcome(call.code())) is RuntimeError
        elif read == "await":
            assert type(await outcome(call)) is RuntimeError
        await wait_until(call.done)
        assert retry_controller(ch).buffered_bytes == 0
        with anyio.fail_after(PROMPT):
            await ch.close(grace=30)
    assert server.count("M") == 0


@pytest.mark.parametrize("interceptor", [False, True], ids=["plain", "app_interceptor"])
async def test_close_starting_as_a_backoff_ends_ends_the_call_cancelled(
    server: Server, interceptor: bool
) -> None:
    """``close()`` starts in the turn the backoff ends, so the retry attempt is refused.
    With an application interceptor the refusal came out of ``await call`` as grpc's raw
    ``UsageError`` ("Channel is closed.") instead of the cancellation rfc/0003 promises."""
    method = server.unary_unary("Failing", always())
    holder: dict[str, Any] = {}

    async def sleep(seconds: float) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def end_backoff_and_close() -> None:
            done.set_result(None)  # the backoff ends...
            holder["close"] = asyncio.ensure_future(holder["ch"].close(0))  # ...as close starts

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


@pytest.mark.parametrize("style", ["read", "code", "unread", "write"])
@pytest.mark.parametrize("shape", ["US", "SU", "SS"])
async def test_a_stream_made_in_the_turn_of_close_ends_cancelled(
    server: Server, shape: str, style: str
) -> None:
    """A streaming call made in the loop turn ``close()`` begins in: its attempt task finds
    the channel closing before its first attempt. It raised grpc.aio's ``UsageError`` from
    every accessor (``code()`` included, which should answer a status), and a call nobody
    read logged "Task exception was never retrieved" (a review); plain grpc.aio cancels a
    call it made when it closes. It ends cancelled: reads raise ``CancelledError``,
    ``code()`` is CANCELLED, a ``write()`` is refused ("already finished"), nothing is
    logged, and nothing reaches the server."""
    make = streaming_methods(server)[shape]
    loop = asyncio.get_running_loop()
    logged: list[Any] = []
    loop.set_exception_handler(lambda _, context: logged.append(context.get("message")))
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            ch = insecure_channel(server.target, service_config=retry_config())
            if style == "write" and shape != "US":
                call = getattr(ch, {"SU": "stream_unary", "SS": "stream_stream"}[shape])(
                    f"/test.Svc/{shape}"
                )()
            else:
                call = make(ch)
            await ch.close()
            if style == "read" or (style == "write" and shape == "US"):
                with pytest.raises(asyncio.CancelledError):
                    await (call if shape == "SU" else call.read())
            elif style == "write":
                with pytest.raises(asyncio.InvalidStateError, match="already finished"):
                    await call.write(b"x")
            if style != "unread":
                assert await call.code() is grpc.StatusCode.CANCELLED
            del call
            for _ in range(3):
                gc.collect()
                await asyncio.sleep(0.01)
        assert logged == []
    finally:
        loop.set_exception_handler(None)
    assert sum(server.count(s) for s in ("US", "SU", "SS")) == 0
