"""Load shedding on sdkcore gRPC channels: limiter= and throttle= around every attempt (rfc/0009).

grpc.aio runs on asyncio only, so these tests have no trio variant.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, abort, wait_until  # noqa: E402

from sdkcore import AdaptiveConcurrencyLimiter, AdaptiveThrottle, ConcurrencyLimiter  # noqa: E402
from sdkcore.grpc import RetryController, insecure_channel, secure_channel  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio


def _held(server: Server, name: str) -> tuple[str, asyncio.Event, asyncio.Event]:
    """A method whose first call waits for ``release``; ``entered`` is set when it started."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        if n == 1:
            entered.set()
            await release.wait()
        return b"ok%d" % n

    return server.unary_unary(name, fn), entered, release


async def test_limiter_of_one_second_call_waits_then_succeeds(server: Server) -> None:
    method, entered, release = _held(server, "M")
    limiter = ConcurrencyLimiter(1, name="svc")
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            first = ch.unary_unary(method)(b"a")
            await entered.wait()
            assert limiter.in_flight == 1
            second = asyncio.ensure_future(ch.unary_unary(method)(b"b", timeout=TEST_TIMEOUT))
            await asyncio.sleep(0.05)  # the second is refused locally and backs off meanwhile
            assert server.count("M") == 1  # nothing of the second reached the server
            assert not second.done()
            release.set()
            assert await first == b"ok1"
            assert await second == b"ok2"
    assert server.count("M") == 2
    assert limiter.in_flight == 0


async def test_limiter_refusal_fails_unavailable_naming_it(server: Server) -> None:
    method, entered, release = _held(server, "M")
    limiter = ConcurrencyLimiter(1, name="svc-limit")
    async with insecure_channel(server.target, limiter=limiter, transparent_retry_limit=0) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            first = ch.unary_unary(method)(b"a")
            await entered.wait()
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"b")
            err = info.value
            assert err.code() is grpc.StatusCode.UNAVAILABLE
            assert "svc-limit" in err.details()
            assert "nothing was sent" in err.details()
            release.set()
            assert await first == b"ok1"
    assert server.count("M") == 1
    assert limiter.in_flight == 0


async def test_refusal_with_deadline_ends_deadline_exceeded(server: Server) -> None:
    method, entered, release = _held(server, "M")
    limiter = ConcurrencyLimiter(1)
    async with insecure_channel(server.target, limiter=limiter) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            first = ch.unary_unary(method)(b"a")
            await entered.wait()
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"b", timeout=0.1)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "refused locally" in (info.value.debug_error_string() or "")
            release.set()
            await first
    assert limiter.in_flight == 0


async def test_permit_returned_on_cancel_and_close(server: Server) -> None:
    method, entered, release = _held(server, "M")
    limiter = AdaptiveConcurrencyLimiter(initial_limit=1, min_limit=1, max_limit=1)
    ch = insecure_channel(server.target, limiter=limiter)
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            call = ch.unary_unary(method)(b"a")
            await entered.wait()
            assert limiter.in_flight == 1
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(0)
            assert limiter.in_flight == 0
            # in flight when the channel closes
            entered.clear()
            server.attempts.clear()
            call = ch.unary_unary(method)(b"b")
            await entered.wait()
            assert limiter.in_flight == 1
    finally:
        await ch.close()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.sleep(0)
    assert limiter.in_flight == 0
    release.set()


async def test_throttle_fed_resource_exhausted_refuses_locally(server: Server) -> None:
    async def fn(request: bytes, context: Any, n: int) -> bytes:
        await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED)
        return b""

    method = server.unary_unary("M", fn)
    throttle = AdaptiveThrottle(k=2.0, random=lambda: 0.0, name="svc-throttle")
    async with insecure_channel(server.target, throttle=throttle, transparent_retry_limit=0) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            codes = []
            for _ in range(10):
                with pytest.raises(aio.AioRpcError) as info:
                    await ch.unary_unary(method)(b"x")
                codes.append(info.value.code())
    # The first answer (RESOURCE_EXHAUSTED) makes requests - 2*accepts > 0: from then
    # on every call is refused locally (random() == 0.0), and nothing reaches the server.
    assert server.count("M") == 1
    assert codes[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes[1:] == [grpc.StatusCode.UNAVAILABLE] * 9
    assert throttle.rejection_probability > 0.0


async def test_throttle_then_limiter_both_released(server: Server) -> None:
    method, _entered, release = _held(server, "M")
    release.set()
    limiter = ConcurrencyLimiter(2)
    throttle = AdaptiveThrottle()
    async with insecure_channel(server.target, limiter=limiter, throttle=throttle) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            results = await asyncio.gather(*(ch.unary_unary(method)(b"x") for _ in range(6)))
    assert len(results) == 6
    assert limiter.in_flight == 0
    assert throttle.rejection_probability == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"limiter": 3}, "limiter"),
        ({"limiter": AdaptiveThrottle()}, "limiter"),
        ({"throttle": ConcurrencyLimiter(1)}, "throttle"),
    ],
)
async def test_bad_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(TypeError, match=rf"\({field}=\.\.\.\)"):
        insecure_channel("127.0.0.1:1", **kwargs)
    with pytest.raises(TypeError, match=rf"\({field}=\.\.\.\)"):
        secure_channel("127.0.0.1:1", grpc.ssl_channel_credentials(), **kwargs)
    with pytest.raises(TypeError, match=rf"\({field}=\.\.\.\)"):
        RetryController("127.0.0.1:1", **kwargs)


async def test_hedged_copy_refused_is_not_sent_and_call_succeeds(server: Server) -> None:
    from hedge_server import HedgeScript, hedging_config, ok

    script = HedgeScript(server, "M", {0: ok(0.2, b"slow"), 1: ok(0.0, b"fast")})
    limiter = ConcurrencyLimiter(1)
    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="0.01s"),
        limiter=limiter,
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            # hedge 1 is refused locally (hedge 0 holds the only permit): never sent,
            # and the call ends with hedge 0's answer instead of failing.
            assert await ch.unary_unary(script.method)(b"x") == b"slow"
    assert script.count == 1
    assert limiter.in_flight == 0


async def test_hedged_call_all_refused_fails_unavailable(server: Server) -> None:
    from hedge_server import HedgeScript, hedging_config, ok

    method, entered, release = _held(server, "H")
    script = HedgeScript(server, "M", {0: ok(0.0, b"a"), 1: ok(0.0, b"b")})
    limiter = ConcurrencyLimiter(1, name="hedge-limit")
    async with insecure_channel(
        server.target,
        service_config=hedging_config(max_attempts=2, delay="0.01s"),
        limiter=limiter,
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            first = ch.unary_unary(method)(b"a")
            await entered.wait()
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(script.method)(b"x", timeout=1.0)
            release.set()
            await first
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "hedge-limit" in info.value.details()
    assert script.count == 0
    assert limiter.in_flight == 0


async def test_a_hedged_copy_refused_locally_costs_no_token_and_no_failed_retry(
    server: Server,
) -> None:
    """As on the retry path: a copy the limiter refused was never sent, so it takes no
    A6 throttle token and is no failed retry (before: a token and a failed retry each)."""
    from hedge_server import HedgeScript, hedging_config, ok

    from sdkcore.grpc import RetryThrottler, retry_controller

    script = HedgeScript(server, "M", {0: ok(0.2, b"slow"), 1: ok(0.0, b"fast")})
    config = hedging_config(
        max_attempts=2, delay="0.01s", throttling={"maxTokens": 100, "tokenRatio": 0.1}
    )
    async with insecure_channel(
        server.target, service_config=config, limiter=ConcurrencyLimiter(1)
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            assert await ch.unary_unary(script.method)(b"x") == b"slow"
        controller = retry_controller(ch)
        throttler = controller.throttler
        assert isinstance(throttler, RetryThrottler)
        assert throttler.tokens == 100  # full: the refusal took none, the OK call adds none
        assert controller.stats.for_method(script.method).failed_retry_attempts == 0
    assert script.count == 1


async def test_a_gated_channel_commits_a_hedge_on_its_headers(server: Server) -> None:
    """A limiter keeps commit-on-headers: hedge 1 is opened as a unary-stream call inside
    the gate, so its headers stop hedge 2 and cancel hedge 0 (before: hedge 1 was a unary
    call through the gate, and hedge 2 went out)."""
    from hedge_server import HedgeScript, headers_then, hedging_config, ok

    script = HedgeScript(server, "M", {1: headers_then(ok(0.6, b"from 1"))})
    limiter = ConcurrencyLimiter(100)
    async with insecure_channel(
        server.target, service_config=hedging_config(delay="0.2s"), limiter=limiter
    ) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            assert await ch.unary_unary(script.method)(b"x") == b"from 1"
    assert script.count == 2  # committed on hedge 1's headers: hedge 2 never sent
    assert limiter.in_flight == 0  # every hedge's permit given back


# -- what an attempt's status teaches the adaptive limiter (rfc/0009) ----------------------


async def _gate_settled(limiter: AdaptiveConcurrencyLimiter) -> None:
    """The permits come back in grpc.aio's done callbacks: wait for them."""
    with anyio.fail_after(TEST_TIMEOUT):
        while limiter.in_flight:  # noqa: ASYNC110 - polls the limiter's gauge
            await asyncio.sleep(0.001)


async def test_attempts_cut_by_their_deadline_halve_an_adaptive_limit(server: Server) -> None:
    """DEADLINE_EXCEEDED is a timeout, a drop: the limit halves, as it does for a
    TimeoutError under execute() (before: a round-trip sample of the deadline's length,
    so a slow endpoint whose calls all timed out kept its limit and taught the
    baseline the deadline)."""
    slow = asyncio.Event()  # set when the test ends: no call is answered in time

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        await slow.wait()
        return b"late"

    method = server.unary_unary("Slow", fn)
    limiter = AdaptiveConcurrencyLimiter(initial_limit=20, name="slow")
    try:
        async with insecure_channel(server.target, limiter=limiter) as ch:
            for _ in range(3):
                with pytest.raises(aio.AioRpcError) as info:
                    await ch.unary_unary(method)(b"x", timeout=0.05)
                assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                await _gate_settled(limiter)
    finally:
        slow.set()
    assert limiter.limit <= 10  # halved at least once (20 before: never shrank)
    assert limiter.baseline_rtt is None  # a drop teaches no round trip


async def test_connection_refused_attempts_count_for_nothing() -> None:
    """UNAVAILABLE with nothing received while the channel cannot connect: no round
    trip was measured (before: each fast failure was a sample, and the baseline learned
    was a fraction of a millisecond, against which every real answer is "slow")."""
    import socket

    closed = socket.socket()  # bound, never listening: connections are refused
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    limiter = AdaptiveConcurrencyLimiter(initial_limit=20, name="unreachable")
    try:
        async with insecure_channel(
            f"127.0.0.1:{port}", limiter=limiter, transparent_retry_limit=0
        ) as ch:
            with anyio.fail_after(TEST_TIMEOUT):
                for _ in range(25):  # more than a window's 10 samples, twice
                    with pytest.raises(aio.AioRpcError) as info:
                        await ch.unary_unary("/test.Svc/M")(b"x", timeout=TEST_TIMEOUT)
                    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
                    await _gate_settled(limiter)
    finally:
        closed.close()
    assert limiter.baseline_rtt is None
    assert limiter.limit == 20


async def test_a_servers_own_unavailable_is_still_a_round_trip(server: Server) -> None:
    """The answer of a server that is up (over a ready connection) is a sample, whatever
    its status: only a connection that could not be made counts for nothing."""

    async def fn(request: bytes, context: Any, n: int) -> bytes:
        await abort(context, grpc.StatusCode.UNAVAILABLE)
        return b""

    method = server.unary_unary("M", fn)
    limiter = AdaptiveConcurrencyLimiter(initial_limit=20, name="answers")
    async with insecure_channel(server.target, limiter=limiter, transparent_retry_limit=0) as ch:
        with anyio.fail_after(TEST_TIMEOUT):
            for _ in range(25):
                with pytest.raises(aio.AioRpcError) as info:
                    await ch.unary_unary(method)(b"x")
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE
                await _gate_settled(limiter)
    assert limiter.baseline_rtt is not None  # a window of answers closed


async def test_a_limiter_refusal_is_retried_under_its_own_reason(server: Server) -> None:
    """An attempt the channel's limiter refused is re-sent transparently, and its retry is
    logged (and counted) as CONCURRENCY_LIMITED: the client shed it, no socket failed."""
    method, entered, release = _held(server, "M")
    limiter = ConcurrencyLimiter(1, name="svc")
    with capture_retry_events() as events:
        async with insecure_channel(server.target, limiter=limiter) as ch:
            with anyio.fail_after(TEST_TIMEOUT):
                first = ch.unary_unary(method)(b"a")
                await entered.wait()
                second = asyncio.ensure_future(ch.unary_unary(method)(b"b", timeout=TEST_TIMEOUT))
                await wait_until(lambda: any(e["event"] == "retry.scheduled" for e in events))
                release.set()
                assert await first == b"ok1"
                assert await second == b"ok2"
    reasons = {e["reason"] for e in events if e["event"] == "retry.scheduled"}
    assert reasons == {"CONCURRENCY_LIMITED"}
    assert server.count("M") == 2


async def test_a_throttle_refusal_is_retried_under_its_own_reason(server: Server) -> None:
    async def fn(request: bytes, context: Any, n: int) -> bytes:
        if n == 1:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED)
        return b"ok"

    method = server.unary_unary("M", fn)
    draws = iter([0.0, 0.0, 0.0])  # refused twice after the first answer, then let through

    throttle = AdaptiveThrottle(k=2.0, random=lambda: next(draws, 1.0), name="svc-throttle")
    with capture_retry_events() as events:
        async with insecure_channel(server.target, throttle=throttle) as ch:
            with anyio.fail_after(TEST_TIMEOUT):
                with pytest.raises(aio.AioRpcError):
                    await ch.unary_unary(method)(b"x")
                assert await ch.unary_unary(method)(b"y", timeout=TEST_TIMEOUT) == b"ok"
    reasons = [e["reason"] for e in events if e["event"] == "retry.scheduled"]
    assert reasons
    assert set(reasons) == {"CLIENT_THROTTLED"}
    assert server.count("M") == 2


async def test_a_refusal_waits_at_least_the_adaptive_limiters_hint(server: Server) -> None:
    """An adaptive limiter's refusal carries its last round trip as ``retry_after``; the
    channel re-sent the refused attempt after its own transparent backoff (10 ms,
    doubling) without reading it, as the core doors do."""

    async def slow(request: bytes, context: Any, n: int) -> bytes:
        await asyncio.sleep(0.3)
        return b"slow"

    slow_method = server.unary_unary("S", slow)
    method, entered, release = _held(server, "M")
    limiter = AdaptiveConcurrencyLimiter(1, min_limit=1, max_limit=1, name="svc")
    with capture_retry_events() as events:
        async with insecure_channel(server.target, limiter=limiter) as ch:
            with anyio.fail_after(TEST_TIMEOUT):
                assert await ch.unary_unary(slow_method)(b"s") == b"slow"  # last RTT >= 0.3 s
                first = ch.unary_unary(method)(b"a")
                await entered.wait()
                second = asyncio.ensure_future(ch.unary_unary(method)(b"b", timeout=TEST_TIMEOUT))
                await wait_until(lambda: any(e["event"] == "retry.scheduled" for e in events))
                release.set()
                assert await first == b"ok1"
                assert await second == b"ok2"
    delays = [e["delay_ms"] for e in events if e["event"] == "retry.scheduled"]
    assert delays
    assert min(delays) >= 300.0, delays  # the hint, not the 10 ms transparent backoff
