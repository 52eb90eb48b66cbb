"""Hardening of the gRPC channel path: every failure a complete, honest report.

Server pushback values that cannot be read, rejected channel arguments, a
``grpc-previous-rpc-attempts`` sent by the server, reprs of the statistics, one
status -> RetryReason table for both gRPC paths, and ordinary non-retryable
answers kept out of the retry log. Against a real grpc.aio server on 127.0.0.1.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, ReservedPort, Server, abort, retry_config  # noqa: E402

from sdkcore import (  # noqa: E402
    AttemptEffect,
    Request,
    RequestState,
    RetryableError,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.grpc import (  # noqa: E402
    PUSHBACK_DONT_RETRY,
    BackoffJitter,
    MethodRetryStats,
    RetryStats,
    _call,
    insecure_channel,
    parse_pushback,
    previous_rpc_attempts,
    retry_controller,
    retry_stats,
    throttler_for_target,
)
from sdkcore.mapping import grpc_failure  # noqa: E402
from sdkcore.mapping._grpc_status import grpc_status_reason  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

ABORTED = grpc.StatusCode.ABORTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
PREV = "grpc-previous-rpc-attempts"


def fail_then_ok(
    failures: int, code: Any = ABORTED, trailing: tuple[tuple[str, str], ...] = ()
) -> Callable[[bytes, Any, int], Awaitable[bytes]]:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt <= failures:
            await abort(context, code, trailing=trailing)
        context.set_trailing_metadata(trailing)
        return b"ok:" + request

    return fn


# -- 2. pushback values that are not a usable integer mean "don't retry" ---------------


@pytest.mark.parametrize(
    "value",
    [
        "9" * 10_000,
        b"9" * 10_000,
        "-" + "9" * 10_000,
        "2147483648",
        "\u0663",  # a non-ASCII digit
        "+5",
        " 5",
        "5 ",
        "",
    ],
)
def test_unusable_pushback_means_do_not_retry(value: str | bytes) -> None:
    assert parse_pushback([value]) == PUSHBACK_DONT_RETRY


def test_usable_pushback_values() -> None:
    assert parse_pushback(["2147483647"]) == 2**31 - 1
    assert parse_pushback([b"0"]) == 0
    assert parse_pushback(["0" * 10_000 + "1"]) == 1  # leading zeros: still the integer 1
    assert parse_pushback([]) is None


@pytest.mark.asyncio
async def test_huge_pushback_from_the_server_ends_the_call_with_its_status(
    server: Server,
) -> None:
    """End to end (grpc C-core re-encodes this key on the way; parse_pushback is tested above)."""
    method = server.unary_unary(
        "M", fail_then_ok(99, UNAVAILABLE, trailing=(("grpc-retry-pushback-ms", "9" * 5_000),))
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is UNAVAILABLE
    assert server.count("M") == 1
    cause = info.value.__cause__
    assert cause is not None
    assert "pushback" in str(cause)


# -- 3. a rejected channel leaves the shared throttler alone -------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "bad",
    [
        {"max_attempts_cap": 0},
        {"backoff_jitter": "full"},
        {"transparent_retry_limit": -1},
        {"per_call_buffer_limit": -1},
        {"transparent_retries": "yes"},
        {"stats": {}},
        {"message_size": 5},
        {"options": [("grpc.service_config", "{}")]},
        {"options": [(1, 2)]},
        {"interceptors": [object()]},
        {"compression": "gzip"},
    ],
    ids=lambda bad: next(iter(bad)),
)
async def test_rejected_channel_leaves_the_live_throttler_alone(
    server: Server, bad: dict[str, Any]
) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    live_cfg = retry_config(throttling={"maxTokens": 100, "tokenRatio": 0.5})
    other_cfg = retry_config(throttling={"maxTokens": 2, "tokenRatio": 0.01})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=live_cfg) as live:
            throttler = retry_controller(live).throttler
            assert throttler is not None
            throttler.record_failure()
            throttler.record_success()
            assert throttler.tokens == 99.5
            with pytest.raises((ValueError, TypeError)):
                insecure_channel(server.target, service_config=other_cfg, **bad)
            assert throttler.tokens == 99.5
            assert (throttler.max_tokens, throttler.token_ratio) == (100, 0.5)
            assert throttler_for_target(server.target, 100, 0.5) is throttler
            # The next call is retried, not throttled (2-token bucket: 1.99 -> 0.99).
            assert await live.unary_unary(method)(b"x") == b"ok:x"
    assert server.count("M") == 2


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("bad", "match"),
    [({"max_attempts_cap": 0}, "max_attempts_cap"), ({"interceptors": [object()]}, "Interceptor")],
)
async def test_rejected_channel_with_a_new_target_leaves_no_bucket(
    server: Server, bad: dict[str, Any], match: str
) -> None:
    target = f"{server.target}-{match}"
    cfg = retry_config(throttling={"maxTokens": 3, "tokenRatio": 1})
    with pytest.raises(ValueError, match=match):
        insecure_channel(target, service_config=cfg, **bad)
    fresh = throttler_for_target(target, 7, 1)
    assert fresh.max_tokens == 7
    assert fresh.tokens == 7


def test_bad_arguments_name_the_argument() -> None:
    from sdkcore.grpc import RetryController

    with pytest.raises(TypeError, match=r"backoff_jitter.*BackoffJitter"):
        RetryController("t", backoff_jitter="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_attempts_cap.*>= 1"):
        RetryController("t", max_attempts_cap=0)
    with pytest.raises(ValueError, match=r"transparent_retry_limit.*>= 0"):
        RetryController("t", transparent_retry_limit=-1)
    with pytest.raises(TypeError, match=r"transparent_retries.*bool"):
        RetryController("t", transparent_retries=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"stats.*RetryStats"):
        RetryController("t", stats={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"message_size.*callable"):
        RetryController("t", message_size=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"target.*str"):
        RetryController(b"t")  # type: ignore[arg-type]
    assert RetryController("t", backoff_jitter=BackoffJitter.PROPORTIONAL).target == "t"


# -- 4. grpc-previous-rpc-attempts is the client's own count ----------------------------


def test_previous_rpc_attempts_is_a_plain_function() -> None:
    assert not inspect.iscoroutinefunction(previous_rpc_attempts)
    assert previous_rpc_attempts(None) == 0
    assert previous_rpc_attempts(aio.Metadata((PREV, "2"))) == 2
    assert previous_rpc_attempts(((PREV, "3"), ("x", "y"))) == 3
    assert previous_rpc_attempts(aio.Metadata((PREV, "9" * 10_000))) == 0
    assert previous_rpc_attempts(aio.Metadata((PREV, "nope"))) == 0
    err = aio.AioRpcError(ABORTED, aio.Metadata(), aio.Metadata((PREV, "4")))
    assert previous_rpc_attempts(err) == 4


@pytest.mark.asyncio
async def test_previous_rpc_attempts_of_a_call_says_what_to_pass(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(0))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_unary(method)(b"x")
            await call
            with pytest.raises(TypeError, match=r"await call.trailing_metadata\(\)"):
                previous_rpc_attempts(call)
            assert previous_rpc_attempts(await call.trailing_metadata()) == 0


SERVER_SAYS = ((PREV, "7"),)


@pytest.mark.asyncio
async def test_server_sent_previous_attempts_is_ignored_on_a_first_attempt_error(
    server: Server,
) -> None:
    method = server.unary_unary(
        "M", fail_then_ok(99, grpc.StatusCode.INVALID_ARGUMENT, trailing=SERVER_SAYS)
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert previous_rpc_attempts(info.value) == 0
    assert PREV not in dict(info.value.trailing_metadata())


@pytest.mark.asyncio
async def test_server_sent_previous_attempts_is_ignored_on_a_first_attempt_success(
    server: Server,
) -> None:
    method = server.unary_unary("M", fail_then_ok(0, trailing=SERVER_SAYS))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_unary(method)(b"x")
            assert await call == b"ok:x"
            assert previous_rpc_attempts(await call.trailing_metadata()) == 0


@pytest.mark.asyncio
async def test_server_sent_previous_attempts_is_replaced_after_retries(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(1, trailing=SERVER_SAYS))
    failing = server.unary_unary("F", fail_then_ok(99, trailing=SERVER_SAYS))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_unary(method)(b"x")
            assert await call == b"ok:x"
            trailing = await call.trailing_metadata()
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(failing)(b"x")
    assert trailing.get_all(PREV) == ["1"]
    assert previous_rpc_attempts(trailing) == 1
    assert previous_rpc_attempts(info.value) == 2


@pytest.mark.asyncio
async def test_server_sent_previous_attempts_is_ignored_on_a_streaming_call(
    server: Server,
) -> None:
    async def fn(request: bytes, context: Any, attempt: int) -> Any:
        context.set_trailing_metadata(SERVER_SAYS)
        yield b"one"

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"x")
            assert [m async for m in call] == [b"one"]
            assert previous_rpc_attempts(await call.trailing_metadata()) == 0


# -- 5. reprs of the statistics --------------------------------------------------------


def test_method_retry_stats_repr_shows_the_counters() -> None:
    stats = RetryStats()
    stats.record_retry("/p.S/M", 1)
    stats.record_retry("/p.S/M", 2)
    stats.record_failed_retry("/p.S/M")
    text = repr(stats.for_method("/p.S/M"))
    assert text == (
        "MethodRetryStats(retry_attempts=2, failed_retry_attempts=1, "
        "transparent_retries=0, histogram={1: 1, 2: 1})"
    )
    assert repr(MethodRetryStats()) == (
        "MethodRetryStats(retry_attempts=0, failed_retry_attempts=0, "
        "transparent_retries=0, histogram={})"
    )


def test_retry_stats_repr_names_methods_and_counters() -> None:
    stats = RetryStats()
    assert repr(stats) == "<RetryStats methods=0>"
    stats.record_retry("/p.S/A", 1)
    stats.record_failed_retry("/p.S/A")
    stats.record_transparent_retry("/p.S/B")
    assert repr(stats) == (
        "<RetryStats methods=2 /p.S/A: retries=1 failed=1 transparent=0;"
        " /p.S/B: retries=0 failed=0 transparent=1>"
    )
    for i in range(20):
        stats.record_retry(f"/p.S/M{i:02}", 1)
    text = repr(stats)
    assert text.startswith("<RetryStats methods=22 /p.S/A: retries=1")
    assert text.endswith("... and 14 more>")


@pytest.mark.asyncio
async def test_channel_stats_repr_after_a_retry(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(1))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok:x"
            text = repr(retry_stats(ch))
    assert text == f"<RetryStats methods=1 {method}: retries=1 failed=0 transparent=0>"


# -- 6. one status -> RetryReason table for both gRPC paths ------------------------------

FAILURE_CODES = [code for code in grpc.StatusCode if code is not grpc.StatusCode.OK]


@pytest.mark.asyncio
async def test_both_grpc_paths_name_the_same_reason_for_every_status(server: Server) -> None:
    names = {}
    for code in FAILURE_CODES:
        names[code] = server.unary_unary(code.name, fail_then_ok(1, code))
    cfg = json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": "test.Svc"}],
                    "retryPolicy": {
                        "maxAttempts": 2,
                        "initialBackoff": "0.001s",
                        "maxBackoff": "0.001s",
                        "backoffMultiplier": 1,
                        "retryableStatusCodes": [code.name for code in FAILURE_CODES],
                    },
                }
            ]
        }
    )
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=cfg, transparent_retries=False
        ) as ch:
            for code in FAILURE_CODES:
                assert await ch.unary_unary(names[code])(b"x") == b"ok:x"
    channel = {e["request_name"]: e["reason"] for e in events if e["event"] == "retry.scheduled"}
    for code in FAILURE_CODES:
        table = grpc_status_reason(code)
        assert channel[names[code]] == table.name, code
        mapped = grpc_failure(code)
        if isinstance(mapped, RetryableError):
            assert mapped.reason is table, code
    assert grpc_status_reason(UNAVAILABLE) is RetryReason.SERVICE_NOT_AVAILABLE
    mapped = grpc_failure(UNAVAILABLE)
    assert isinstance(mapped, RetryableError)
    assert mapped.reason is RetryReason.SERVICE_NOT_AVAILABLE


def test_status_reason_table_covers_every_failure_and_allows_the_a6_retry() -> None:
    for code in FAILURE_CODES:
        reason = grpc_status_reason(code)
        assert reason is grpc_status_reason(code.value[0]) is grpc_status_reason(code.name)
        # A6 decides by status code alone; the orchestrator must not veto it.
        assert reason.allows_non_idempotent_retry, code
        assert not reason.always_retry, code
    with pytest.raises(ValueError, match="OK"):
        grpc_status_reason(grpc.StatusCode.OK)


# -- 7. ordinary non-retryable answers are not retry decisions ---------------------------


class _Recording(Request):
    made: ClassVar[list[Request]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Recording.made.append(self)


@pytest.mark.asyncio
@pytest.mark.parametrize("has_policy", [True, False])
async def test_non_retryable_status_fails_without_a_retry_decision(
    server: Server, monkeypatch: pytest.MonkeyPatch, has_policy: bool
) -> None:
    monkeypatch.setattr(_call, "Request", _Recording)
    _Recording.made = []
    method = server.unary_unary("M", fail_then_ok(99, grpc.StatusCode.NOT_FOUND))
    cfg = retry_config() if has_policy else retry_config().replace("test.Svc", "other.Svc")
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert server.count("M") == 1
    assert events == []
    # A first attempt's answer needs no Request: none is built only to be failed.
    assert _Recording.made == []


@pytest.mark.asyncio
async def test_non_retryable_status_after_a_retry_fails_the_request(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_call, "Request", _Recording)
    _Recording.made = []

    async def unavailable_then_not_found(request: bytes, context: Any, attempt: int) -> bytes:
        code = grpc.StatusCode.UNAVAILABLE if attempt == 1 else grpc.StatusCode.NOT_FOUND
        await abort(context, code)
        return b""

    method = server.unary_unary("M", unavailable_then_not_found)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert server.count("M") == 2
    assert [r.state for r in _Recording.made] == [RequestState.FAILED]
    assert _Recording.made[0].retry_attempts == 1


@pytest.mark.asyncio
async def test_non_retryable_status_on_a_streaming_call(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_call, "Request", _Recording)
    _Recording.made = []

    async def fn(request: bytes, context: Any, attempt: int) -> Any:
        await abort(context, grpc.StatusCode.NOT_FOUND)
        yield b""

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"x")
            with pytest.raises(aio.AioRpcError) as info:
                _ = [m async for m in call]
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    assert events == []
    assert _Recording.made == []  # a first attempt's answer: no Request is built


@pytest.mark.asyncio
async def test_retryable_status_still_goes_through_the_orchestrator(server: Server) -> None:
    method = server.unary_unary("M", fail_then_ok(99))
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=2)
        ) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
    assert [e["event"] for e in events] == ["retry.scheduled", "retry.not_retried"]


@pytest.mark.asyncio
async def test_dont_retry_pushback_on_a_non_retryable_status_still_costs_a_token(
    server: Server,
) -> None:
    """A6 throttling: a "don't retry" pushback counts as a failure whatever the status."""
    method = server.unary_unary(
        "M",
        fail_then_ok(99, grpc.StatusCode.NOT_FOUND, trailing=(("grpc-retry-pushback-ms", "-1"),)),
    )
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 1})
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(f"{server.target}", service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            before = throttler.milli_tokens
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
            assert throttler.milli_tokens == before - 1000
    assert events == []


@pytest.mark.asyncio
async def test_dont_retry_pushback_costs_a_token_on_a_method_without_a_policy_too(
    server: Server,
) -> None:
    """A6: "every outgoing RPC (regardless of service or method invoked)" moves the bucket,
    and a "don't retry" pushback counts as a failure: also on a method the service config
    gives no retryPolicy, unary and response-streaming (as grpc-java; it cost nothing)."""
    dont_retry = (("grpc-retry-pushback-ms", "-1"),)
    unary = server.unary_unary("M", fail_then_ok(99, grpc.StatusCode.NOT_FOUND, dont_retry))

    async def fn(request: bytes, context: Any, attempt: int) -> Any:
        await abort(context, grpc.StatusCode.NOT_FOUND, trailing=dont_retry)
        yield b""

    stream = server.unary_stream("S", fn)
    # throttling for the channel, a retryPolicy for another service only
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 1}).replace(
        "test.Svc", "other.Svc"
    )
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            before = throttler.milli_tokens
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(unary)(b"x")
            assert throttler.milli_tokens == before - 1000
            with pytest.raises(aio.AioRpcError):
                _ = [m async for m in ch.unary_stream(stream)(b"y")]
            assert throttler.milli_tokens == before - 2000


@pytest.mark.asyncio
async def test_an_ok_answer_with_a_dont_retry_pushback_is_a_success_for_throttling(
    server: Server,
) -> None:
    """A6 counts a pushback only on a failed RPC (grpc C-core's retry filter records an
    OK status as a success first): an OK answer carrying "don't retry" gives a token back."""
    dont_retry = (("grpc-retry-pushback-ms", "-1"),)
    refused = server.unary_unary("Refused", fail_then_ok(99, grpc.StatusCode.NOT_FOUND, dont_retry))
    answered = server.unary_unary("Answered", fail_then_ok(0, trailing=dont_retry))
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 1})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(f"{server.target}", service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            full = throttler.milli_tokens
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(refused)(b"x")
            assert throttler.milli_tokens == full - 1000  # the refusal cost a token
            assert await ch.unary_unary(answered)(b"x") == b"ok:x"
            assert throttler.milli_tokens == full  # the OK answer gave it back


# -- 8. the attempt's AioRpcError is the cause; what the server may have done ------------


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and all(exc is not e for e in seen):
        seen.append(exc)
        exc = exc.__cause__
    return seen


@pytest.mark.asyncio
async def test_refused_retry_is_caused_by_the_attempts_grpc_error(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_call, "Request", _Recording)
    _Recording.made = []
    method = server.unary_unary("M", fail_then_ok(99))
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=2)
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    caused_by = [e.get("caused_by") for e in events]
    assert caused_by == ["AioRpcError: ABORTED: scripted ABORTED"] * 2
    chain = _chain(info.value)
    assert [type(e).__name__ for e in chain] == [
        "AioRpcError",
        "RequestCanceledException",
        "AioRpcError",
    ]
    assert chain[2].code() is ABORTED  # type: ignore[attr-defined]
    assert chain[2].__cause__ is None, "no cycle back to the final error"
    request = _Recording.made[0]
    assert [a.effect for a in request.attempts] == [AttemptEffect.MAYBE_APPLIED] * 2
    assert request.last_error is chain[2]


@pytest.mark.asyncio
async def test_server_unavailable_timeout_says_the_call_may_have_reached_it(
    server: Server,
) -> None:
    """UNAVAILABLE is retried for SERVICE_NOT_AVAILABLE, yet the server answered: it may
    have applied the call. The retryPolicy declares the method safe to send again (its
    request is idempotent), so the timeout says so rather than "ambiguous"."""
    method = server.unary_unary("M", fail_then_ok(99, UNAVAILABLE))
    cfg = retry_config(initial="5s", maximum="5s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(  # a 4-6 s backoff: the deadline comes inside it
            server.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=0.2)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    cause = info.value.__cause__
    assert isinstance(cause, UnambiguousTimeoutException)
    assert "may have reached the server, but it is idempotent" in str(cause)


@pytest.mark.asyncio
async def test_never_sent_attempts_make_a_timeout_unambiguous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_call, "Request", _Recording)
    _Recording.made = []
    with ReservedPort() as port, anyio.fail_after(TEST_TIMEOUT):
        # No connection: each attempt fails fast with UNAVAILABLE (as grpcio's) and is
        # retried by the policy, until the deadline cuts a backoff.
        cfg = retry_config(max_attempts=5, initial="0.2s", maximum="0.2s")
        async with insecure_channel(
            port.target, service_config=cfg, backoff_jitter=BackoffJitter.PROPORTIONAL
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary("/test.Svc/M")(b"x", timeout=0.3)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(info.value.__cause__, UnambiguousTimeoutException)
    request = _Recording.made[0]
    assert request.attempts, "the attempts that found no connection are recorded"
    assert {a.effect for a in request.attempts} == {AttemptEffect.NOT_SENT}
    assert {a.reason for a in request.attempts} == {RetryReason.SERVICE_NOT_AVAILABLE}


async def _drain_into(call: Any, got: list[bytes]) -> None:
    async for message in call:
        got.append(message)


@pytest.mark.asyncio
async def test_committed_stream_that_fails_completes_its_request_as_failed(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_call, "Request", _Recording)
    _Recording.made = []

    async def fn(request: bytes, context: Any, attempt: int) -> Any:
        yield b"first"
        await abort(context, ABORTED)

    method = server.unary_stream("S", fn)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            call = ch.unary_stream(method)(b"x")
            got: list[bytes] = []
            with pytest.raises(aio.AioRpcError) as info:
                await _drain_into(call, got)
    assert got == [b"first"]
    assert info.value.code() is ABORTED
    assert events == []
    assert [r.state for r in _Recording.made] == [RequestState.FAILED]
    assert _Recording.made[0].last_error is not None


def test_retry_stats_count_at_most_max_methods_apart() -> None:
    """A gateway's channel calling thousands of generic methods grew one entry per method
    for its life: the ones past the bound are counted together as "other"."""
    from sdkcore.grpc import _stats

    stats = RetryStats()
    for n in range(_stats.MAX_METHODS + 5):
        stats.record_retry(f"/gw.Any/M{n}", 1)
    snapshot = stats.snapshot()
    assert len(snapshot) == _stats.MAX_METHODS + 1
    assert snapshot["other"].retry_attempts == 5
    assert stats.for_method("/gw.Any/M0").retry_attempts == 1  # the ones before, as before


@pytest.mark.asyncio
async def test_a_channel_keeps_the_plans_of_at_most_max_methods(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound a method's plan is built per call, not kept: calls still retry."""
    from sdkcore.grpc import _controller

    monkeypatch.setattr(_controller, "MAX_METHODS", 3)
    calls = []

    async def flaky(request: bytes, context: Any, attempt: int) -> bytes:
        calls.append(attempt)
        if attempt == 1:
            await abort(context, grpc.StatusCode.UNAVAILABLE)
        return b"ok"

    methods = [server.unary_unary(f"M{n}", flaky) for n in range(6)]
    cfg = retry_config(max_attempts=3, initial="0.001s", maximum="0.002s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            for method in methods:
                assert await ch.unary_unary(method)(b"x") == b"ok"
            core = retry_controller(ch)
            assert len(core._plans) == 3
    assert len(calls) == 12  # every call retried once, kept plan or not
