"""grpc C-core end2end retry scenarios (test/core/end2end/tests/retry_*), on a real server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import (  # noqa: E402
    HEADERS_FLUSH,
    TEST_TIMEOUT,
    Server,
    abort,
    retry_config,
    wait_until,
)

from sdkcore import Request, RequestCanceledException, RequestState, RetryOrchestrator  # noqa: E402
from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    RetryController,
    insecure_channel,
    previous_rpc_attempts,
    retry_controller,
    retry_stats,
)
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio
ABORTED = grpc.StatusCode.ABORTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
PREV = "grpc-previous-rpc-attempts"


def fail_then_ok(
    failures: int, code: Any = ABORTED, trailing: tuple[tuple[str, str], ...] = ()
) -> Callable[[bytes, Any, int], Awaitable[bytes]]:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt <= failures:
            await abort(context, code, trailing=trailing)
        return b"ok:" + request

    return fn


async def test_retry_aborted_then_ok(server: Server) -> None:
    """retry.cc: ABORTED then OK; the header is absent on the first attempt, "1" on the second."""
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_unary(method)(b"x")
            assert await call == b"ok:x"
            assert await call.code() is grpc.StatusCode.OK
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
            stats = retry_stats(ch).for_method(method)
    assert server.count("M") == 2
    assert PREV not in server.attempts["M"][0]
    assert server.attempts["M"][1][PREV] == "1"
    assert stats.retry_attempts == 1
    assert stats.failed_retry_attempts == 0
    assert stats.histogram[1] == 1


async def test_retry_too_many_attempts(server: Server) -> None:
    """retry_too_many_attempts.cc: maxAttempts 2 and both attempts fail: the second is final."""
    method = server.unary_unary("M", fail_then_ok(99))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=2)
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
            stats = retry_stats(ch).for_method(method)
    assert info.value.code() is ABORTED
    assert previous_rpc_attempts(info.value) == 1
    assert server.count("M") == 2
    assert [a.get(PREV) for a in server.attempts["M"]] == [None, "1"]
    assert (stats.retry_attempts, stats.failed_retry_attempts) == (1, 1)
    cause = info.value.__cause__
    assert isinstance(cause, RequestCanceledException)
    assert cause.context is not None
    assert cause.context.extra["grpc_status"] == "ABORTED"
    assert "maxAttempts" in cause.context.extra["not_retried_because"]


async def test_retry_non_retriable_status(server: Server) -> None:
    """retry_non_retriable_status.cc: a status outside retryableStatusCodes is returned at once."""
    method = server.unary_unary("M", fail_then_ok(99, grpc.StatusCode.INVALID_ARGUMENT))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert server.count("M") == 1


@pytest.mark.parametrize(
    ("max_attempts", "cap", "expected"), [(10, None, 5), (10, 7, 7), (3, 7, 3)]
)
async def test_max_attempts_clamped_to_client_cap(
    server: Server, max_attempts: int, cap: int | None, expected: int
) -> None:
    method = server.unary_unary("M", fail_then_ok(99))
    kwargs: dict[str, Any] = {} if cap is None else {"max_attempts_cap": cap}
    cfg = retry_config(max_attempts=max_attempts, initial="0.001s", maximum="0.002s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg, **kwargs) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
    assert server.count("M") == expected


async def test_retry_server_pushback_delay(server: Server) -> None:
    """retry_server_pushback_delay.cc: the retry waits the pushed-back delay, not the backoff."""
    method = server.unary_unary(
        "M", fail_then_ok(1, UNAVAILABLE, trailing=(("grpc-retry-pushback-ms", "300"),))
    )
    cfg = retry_config(initial="0.001s", maximum="0.001s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            start = time.monotonic()
            assert await ch.unary_unary(method)(b"x") == b"ok:x"
            elapsed = time.monotonic() - start
    assert server.count("M") == 2
    assert elapsed >= 0.25  # the backoff alone would be at most 1 ms


async def test_retry_server_pushback_zero_retries_at_once(server: Server) -> None:
    """Pushback "0" means retry now (grpcio 1.85's own retries hang on it)."""
    method = server.unary_unary(
        "M", fail_then_ok(1, UNAVAILABLE, trailing=(("grpc-retry-pushback-ms", "0"),))
    )
    # A 20 s backoff: only an immediate pushback retry finishes within the timeout.
    cfg = retry_config(initial="20s", maximum="20s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            start = time.monotonic()
            assert await ch.unary_unary(method)(b"x") == b"ok:x"
            elapsed = time.monotonic() - start
    assert server.count("M") == 2
    assert elapsed < 10.0


async def test_a_repeated_pushback_header_reaches_the_client_as_its_last_value(
    server: Server,
) -> None:
    """rfc/0003: grpc C-core hands a client only the last of several
    ``grpc-retry-pushback-ms`` values (so ``parse_pushback``'s rule for several values is
    met only by hand-built metadata). Plain grpc.aio, the server sending 100 then 900."""
    method = server.unary_unary(
        "M",
        fail_then_ok(
            99,
            UNAVAILABLE,
            trailing=(("grpc-retry-pushback-ms", "100"), ("grpc-retry-pushback-ms", "900")),
        ),
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(server.target) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    trailing = info.value.trailing_metadata() or ()
    assert [v for k, v in trailing if k == "grpc-retry-pushback-ms"] == ["900"]


@pytest.mark.parametrize("value", ["-1", "abc", "1.5"])
async def test_retry_server_pushback_disabled(server: Server, value: str) -> None:
    """retry_server_pushback_disabled.cc: a negative/unparsable pushback means don't retry."""
    method = server.unary_unary(
        "M", fail_then_ok(1, UNAVAILABLE, trailing=(("grpc-retry-pushback-ms", value),))
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is UNAVAILABLE
    assert server.count("M") == 1


async def test_retry_throttled(server: Server) -> None:
    """retry_throttled.cc: maxTokens 1 -> the first failure empties the bucket: no retry."""
    method = server.unary_unary("M", fail_then_ok(1))
    cfg = retry_config(throttling={"maxTokens": 1, "tokenRatio": 0.5})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
            assert throttler.tokens == 0
            # A success adds tokenRatio back.
            assert await ch.unary_unary(method)(b"y") == b"ok:y"
            assert throttler.tokens == 0.5
    assert info.value.code() is ABORTED
    assert server.count("M") == 2
    assert "throttled" in str(info.value.__cause__)


async def test_one_server_spelled_three_ways_shares_one_throttle_bucket(server: Server) -> None:
    """A6 throttles "per server name": 127.0.0.1:P, dns:///127.0.0.1:P and ipv4:127.0.0.1:P
    are one server (grpc C-core keyed the bucket on the canonical URI's path). Each
    spelling had a bucket of its own, so a channel spelled otherwise kept retrying into
    a server the first had throttled."""
    method = server.unary_unary("M", fail_then_ok(99))
    cfg = retry_config(throttling={"maxTokens": 4, "tokenRatio": 0.1})
    port = server.target.rpartition(":")[2]
    spellings = [f"127.0.0.1:{port}", f"dns:///127.0.0.1:{port}", f"ipv4:127.0.0.1:{port}"]
    with anyio.fail_after(TEST_TIMEOUT):
        async with (
            insecure_channel(spellings[0], service_config=cfg) as first,
            insecure_channel(spellings[1], service_config=cfg) as second,
            insecure_channel(spellings[2], service_config=cfg) as third,
        ):
            buckets = [retry_controller(ch).throttler for ch in (first, second, third)]
            assert buckets[0] is not None
            assert buckets[0] is buckets[1] is buckets[2]
            with pytest.raises(aio.AioRpcError):
                await first.unary_unary(method)(b"x")  # drains the bucket to its threshold
            sent = server.count("M")
            with pytest.raises(aio.AioRpcError):
                await second.unary_unary(method)(b"y")
            assert server.count("M") == sent + 1  # throttled: no retry


async def test_non_retryable_status_costs_no_throttle_token(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(99, grpc.StatusCode.NOT_FOUND))
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 0.1})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            assert throttler.tokens == 10


async def test_retry_exceeds_buffer_size_in_initial_batch(server: Server) -> None:
    """retry_exceeds_buffer_size_in_initial_batch.cc: a request over the buffer limit commits."""
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), per_call_buffer_limit=4
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"12345")
            assert retry_controller(ch).buffered_bytes == 0
    assert info.value.code() is ABORTED
    assert server.count("M") == 1


async def test_channel_buffer_limit_commits(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), channel_buffer_limit=4
        ) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"12345")
    assert server.count("M") == 1


async def test_retry_recv_initial_metadata(server: Server) -> None:
    """retry_recv_initial_metadata.cc: response headers commit the call."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await context.send_initial_metadata((("x-server", "1"),))
        await asyncio.sleep(HEADERS_FLUSH)  # see HEADERS_FLUSH
        await abort(context, ABORTED)
        return b""

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is ABORTED
    assert ("x-server", "1") in tuple(info.value.initial_metadata())
    assert server.count("M") == 1


async def test_retry_cancellation(server: Server) -> None:
    """retry_cancellation.cc: cancelling an in-flight call ends it, CANCELLED, with no retry."""
    release = asyncio.Event()
    handler_done = asyncio.Event()

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        try:
            with anyio.move_on_after(TEST_TIMEOUT):
                await release.wait()
            await abort(context, ABORTED)
            return b""
        finally:
            handler_done.set()

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            orchestrator = retry_controller(ch).orchestrator
            call = ch.unary_unary(method)(b"x")
            await wait_until(lambda: server.count("M") == 1)
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert await call.code() is grpc.StatusCode.CANCELLED
            # The call is over: nothing is left that could start another attempt.
            assert call.done()
            assert orchestrator.requests_in_retry == 0
            release.set()
            await handler_done.wait()
    assert server.count("M") == 1


async def test_retry_cancel_during_delay(server: Server) -> None:
    """retry_cancel_during_delay.cc: a cancel during the backoff ends the call at once."""
    method = server.unary_unary("M", fail_then_ok(99))
    cfg = retry_config(initial="20s", maximum="20s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            orchestrator = retry_controller(ch).orchestrator
            call = ch.unary_unary(method)(b"x")
            await wait_until(lambda: orchestrator.requests_in_retry == 1)
            start = time.monotonic()
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert time.monotonic() - start < 5.0
            assert await call.code() is grpc.StatusCode.CANCELLED
            assert orchestrator.requests_in_retry == 0
    assert server.count("M") == 1


async def test_deadline_during_backoff(server: Server) -> None:
    """The call's deadline spans all attempts: reaching it during backoff -> DEADLINE_EXCEEDED."""
    method = server.unary_unary("M", fail_then_ok(99))
    cfg = retry_config(initial="20s", maximum="20s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            start = time.monotonic()
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=0.3)
            elapsed = time.monotonic() - start
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.2 <= elapsed < 5.0
    assert server.count("M") == 1


async def test_method_config_timeout_applies(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await asyncio.sleep(5)
        return b""

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(timeout="0.2s")
        ) as ch:
            start = time.monotonic()
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
            assert time.monotonic() - start < 3.0
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_retry_disabled(server: Server) -> None:
    """retry_disabled.cc: one switch turns retries off for the channel."""
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), retries_enabled=False
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is ABORTED
    assert server.count("M") == 1


async def test_retry_disabled_keeps_method_timeout(server: Server) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await asyncio.sleep(5)
        return b""

    method = server.unary_unary("M", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(timeout="0.2s"), retries_enabled=False
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
            assert retry_controller(ch).throttler is None
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


async def test_app_supplied_previous_attempts_header_is_replaced(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            md = aio.Metadata((PREV, "7"), ("x-app", "a"))
            assert await ch.unary_unary(method)(b"x", metadata=md) == b"ok:x"
    assert [a.get(PREV) for a in server.attempts["M"]] == [None, "1"]
    assert all(a["x-app"] == "a" for a in server.attempts["M"])


async def test_histogram_buckets_each_retry_once(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(99))
    cfg = retry_config(max_attempts=7, initial="0.001s", maximum="0.001s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg, max_attempts_cap=7) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
            stats = retry_stats(ch).for_method(method)
    # Retries 1..6: one each in >=1..>=4, two (5th and 6th) in >=5.
    assert stats.retry_attempts == 6
    assert stats.failed_retry_attempts == 6
    assert dict(stats.histogram) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 10: 0, 100: 0, 1000: 0}


async def test_retries_and_refusals_go_through_the_orchestrator(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(99))
    orchestrator = RetryOrchestrator()
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=2), orchestrator=orchestrator
        ) as ch:
            assert retry_controller(ch).orchestrator is orchestrator
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
    names = [(e["event"], e.get("request_name"), e.get("reason")) for e in events]
    assert names == [
        ("retry.scheduled", method, "SERVICE_RESPONSE_CODE_INDICATED"),
        ("retry.not_retried", method, "SERVICE_RESPONSE_CODE_INDICATED"),
    ]


async def test_method_without_policy_is_not_retried(server: Server) -> None:
    method = server.unary_unary("Other", fail_then_ok(1))
    cfg = retry_config().replace("test.Svc", "other.Svc")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
    assert server.count("Other") == 1


async def test_successful_call_completes_its_request(server: Server) -> None:
    finished: list[Request] = []

    class Recording(RetryOrchestrator):
        def succeed(self, request: Request) -> None:
            super().succeed(request)
            finished.append(request)

    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(), orchestrator=Recording()
        ) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok:x"
    assert len(finished) == 1
    assert finished[0].state is RequestState.SUCCEEDED
    assert finished[0].retry_attempts == 1
    assert finished[0].name == method


async def test_success_of_a_method_without_policy_feeds_the_throttler(server: Server) -> None:
    """A6: every successful RPC adds tokenRatio, also with transparent retries off and a
    method that has no retryPolicy (and no timeout) in the service config."""
    method = server.unary_unary("M", fail_then_ok(0))
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 0.5}).replace(
        "test.Svc", "other.Svc"
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=cfg, transparent_retries=False
        ) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            throttler.record_failure()
            throttler.record_failure()
            before = throttler.milli_tokens
            assert await ch.unary_unary(method)(b"x") == b"ok:x"
            assert throttler.milli_tokens == before + 500
            stream = server.unary_stream("S", lambda request, context, attempt: one(request))
            assert [m async for m in ch.unary_stream(stream)(b"y")] == [b"y"]
            assert throttler.milli_tokens == before + 1000


async def one(message: bytes) -> Any:
    yield message


@pytest.mark.parametrize(
    ("option", "field"),
    [
        ("grpc.per_rpc_retry_buffer_size", "per_call_buffer_limit"),
        ("grpc.retry_buffer_size", "channel_buffer_limit"),
    ],
)
async def test_grpcios_own_buffer_options_set_the_replay_limits(
    server: Server, option: str, field: str
) -> None:
    """A channel ported from grpcio keeps its retry buffer options: they went to C-core,
    whose retry filter is off, and a 300 KiB request was not retried (over the 256 KiB
    default). A keyword of sdkcore's own that says otherwise is a conflict."""
    method = server.unary_unary("M", fail_then_ok(1))
    big = b"x" * (300 * 1024)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target,
            service_config=retry_config(),
            options=[(option, 64 * 1024 * 1024)],
        ) as ch:
            assert getattr(retry_controller(ch), field) == 64 * 1024 * 1024
            if field == "per_call_buffer_limit":
                assert await ch.unary_unary(method)(big) == b"ok:" + big
    if field == "per_call_buffer_limit":
        assert server.count("M") == 2  # retried: the request fit the replay buffer
    with pytest.raises(ValueError, match=rf"{option}.*conflicts with {field}=1000"):
        insecure_channel(server.target, options=[(option, 4096)], **{field: 1000})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be a number of bytes"):
        insecure_channel(server.target, options=[(option, "big")])
    # A controller built by hand (channel_options is public) is not changed by them.
    controller = RetryController(server.target)
    controller.channel_options([(option, 4096)])
    assert getattr(controller, field) != 4096
