"""Edges of the gRPC channels, against a real grpc.aio server on 127.0.0.1.

* A status the client makes after the server's answer arrived (a response over the
  receive limit) commits the call: the server runs it exactly once, on every call
  shape, on the direct path and through the interceptors, hedged or retried.
* A hedged call whose hedges all failed, then reached its deadline, says so.
* The channel's own retries show in the error it raises (``__cause__``, the
  previous-attempts count, the debug string), for an outer request's context.
* Bad numbers to the public constructors: TypeError / ValueError naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402
from hedge_server import HedgeScript, fail, hedging_config  # noqa: E402

from sdkcore import (  # noqa: E402
    CouchbaseException,
    Request,
    RequestCanceledException,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore.grpc import (  # noqa: E402
    BackoffJitter,
    HedgingPolicy,
    RetryController,
    RetryPolicy,
    RetryThrottler,
    RetryThrottlingPolicy,
    ServiceConfig,
    ServiceConfigError,
    call_context,
    insecure_channel,
    previous_rpc_attempts,
    retry_controller,
    throttler_for_target,
)

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
NOT_FOUND = grpc.StatusCode.NOT_FOUND
LIMIT = 1000
BIG = b"x" * (2 * LIMIT)
SMALL_RECEIVE = [("grpc.max_receive_message_length", LIMIT)]
SECOND = timedelta(seconds=1)
CODES = frozenset({14})


def exhausted_config() -> str:
    return retry_config(
        max_attempts=5, initial="0.001s", maximum="0.001s", codes=("RESOURCE_EXHAUSTED",)
    )


async def big_answer(request: bytes, context: Any, attempt: int) -> bytes:
    return BIG


# -- a client-made status after the answer: committed, executed once -----------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["direct", "interceptors"])
async def test_unary_response_over_the_receive_limit_runs_once(server: Server, path: str) -> None:
    method = server.unary_unary("Big", big_answer)
    with anyio.fail_after(TEST_TIMEOUT):
        if path == "direct":
            ch = insecure_channel(
                server.target, service_config=exhausted_config(), options=SMALL_RECEIVE
            )
        else:
            controller = RetryController(server.target, exhausted_config())
            ch = aio.insecure_channel(
                server.target,
                options=controller.channel_options(SMALL_RECEIVE),
                interceptors=controller.interceptors(),
            )
        async with ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert server.count("Big") == 1
    assert info.value.code() is RESOURCE_EXHAUSTED
    assert "larger than max" in (info.value.details() or "")
    cause = info.value.__cause__
    assert isinstance(cause, RequestCanceledException)
    assert cause.context is not None
    assert "committed" in cause.context.extra["not_retried_because"]


@pytest.mark.asyncio
async def test_a_server_imitating_the_text_is_not_retried(server: Server) -> None:
    """Fail safe: the same text from the server makes its status final, never retried."""

    async def imitate(request: bytes, context: Any, attempt: int) -> bytes:
        await context.abort(RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 1)")
        raise AssertionError("unreachable")

    method = server.unary_unary("Imitate", imitate)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=exhausted_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.code() is RESOURCE_EXHAUSTED
    assert server.count("Imitate") == 1


@pytest.mark.asyncio
async def test_a_server_resource_exhausted_is_still_retried(server: Server) -> None:
    """The rule is about the client's own text: a server's RESOURCE_EXHAUSTED is retried."""

    async def busy(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt < 3:
            await abort(context, RESOURCE_EXHAUSTED)
        return b"ok"

    method = server.unary_unary("Busy", busy)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=exhausted_config()) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok"
    assert server.count("Busy") == 3


@pytest.mark.asyncio
async def test_server_streaming_first_message_over_the_limit_runs_once(server: Server) -> None:
    async def stream(request: bytes, context: Any, attempt: int) -> AsyncIterator[bytes]:
        yield BIG

    method = server.unary_stream("BigS", stream)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=exhausted_config(), options=SMALL_RECEIVE
        ) as ch:
            call = ch.unary_stream(method)(b"x")
            with pytest.raises(aio.AioRpcError) as info:
                async for _ in call:
                    pass
    assert info.value.code() is RESOURCE_EXHAUSTED
    assert server.count("BigS") == 1


@pytest.mark.asyncio
async def test_client_streaming_answer_over_the_limit_runs_once(server: Server) -> None:
    async def collect(requests: AsyncIterator[bytes], context: Any, attempt: int) -> bytes:
        async for _ in requests:
            pass
        return BIG

    method = server.stream_unary("BigC", collect)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=exhausted_config(), options=SMALL_RECEIVE
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.stream_unary(method)(iter([b"a", b"b"]))
    assert info.value.code() is RESOURCE_EXHAUSTED
    assert server.count("BigC") == 1


@pytest.mark.asyncio
async def test_bidi_first_message_over_the_limit_runs_once(server: Server) -> None:
    async def echo(
        requests: AsyncIterator[bytes], context: Any, attempt: int
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield BIG

    method = server.stream_stream("BigB", echo)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=exhausted_config(), options=SMALL_RECEIVE
        ) as ch:
            call = ch.stream_stream(method)(iter([b"a"]))
            with pytest.raises(aio.AioRpcError) as info:
                async for _ in call:
                    pass
    assert info.value.code() is RESOURCE_EXHAUSTED
    assert server.count("BigB") == 1


@pytest.mark.asyncio
async def test_hedged_answer_over_the_limit_is_final(server: Server) -> None:
    """RESOURCE_EXHAUSTED is non-fatal here, but the client made it: no more hedges."""
    script = HedgeScript(server, "BigH", {}, default=_big_step)
    cfg = hedging_config(max_attempts=3, delay="5s", non_fatal=("RESOURCE_EXHAUSTED",))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg, options=SMALL_RECEIVE) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(script.method)(b"x")
    assert info.value.code() is RESOURCE_EXHAUSTED
    assert script.count == 1


async def _big_step(context: Any) -> bytes:
    return BIG


# -- a hedged call that reached its deadline with nothing in flight -------------------------
@pytest.mark.asyncio
async def test_hedged_deadline_after_every_hedge_failed_says_none_in_flight(
    server: Server,
) -> None:
    # Hedge 0 fails at once with a pushback of 60 s: the next hedge waits for it, and the
    # call's 0.3 s deadline comes first. Nothing is in flight then.
    script = HedgeScript(server, "H", {0: fail(UNAVAILABLE, pushback="60000")})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=hedging_config(max_attempts=3, delay="5s")
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(script.method)(b"x", timeout=0.3)
    err = info.value
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    text = err.debug_error_string()
    assert "in flight" in text
    assert "hedge(s) in flight" not in text
    assert "no hedge in flight" in text
    assert "1 hedge(s) failed" in text
    assert "UNAVAILABLE" in text
    assert script.count == 1


@pytest.mark.asyncio
async def test_hedged_deadline_with_a_hedge_running_counts_it(server: Server) -> None:
    script = HedgeScript(server, "H2", {})  # every hedge blocks
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=hedging_config(max_attempts=2, delay="0.05s")
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(script.method)(b"x", timeout=0.5)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "with 2 hedge(s) in flight" in info.value.debug_error_string()


# -- the channel's retries, visible to an outer request -----------------------------------
def _unavailable_then(code: Any) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, UNAVAILABLE if attempt == 1 else code)
        raise AssertionError("unreachable")

    return fn


@pytest.mark.asyncio
async def test_an_answer_after_retries_carries_the_channel_context(server: Server) -> None:
    method = server.unary_unary("R", _unavailable_then(NOT_FOUND))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(initial="0.001s", maximum="0.001s")
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    err = info.value
    assert type(err) is aio.AioRpcError  # drop-in: grpc's own error type
    assert err.code() is NOT_FOUND
    assert previous_rpc_attempts(err) == 1
    assert isinstance(err.__cause__, CouchbaseException)
    context = call_context(err)
    assert context is not None
    assert context is err.__cause__.context
    assert context.retry_attempts == 1
    assert context.extra["grpc_attempts"] == 2
    assert [a.reason for a in context.attempts][:1] == [RetryReason.SERVICE_NOT_AVAILABLE]
    assert "sdkcore: 2 attempts" in err.debug_error_string()


@pytest.mark.asyncio
async def test_retries_exhausted_error_has_the_context_as_cause(server: Server) -> None:
    method = server.unary_unary("X", _unavailable_then(UNAVAILABLE))
    cfg = retry_config(max_attempts=2, initial="0.001s", maximum="0.001s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    err = info.value
    assert type(err) is aio.AioRpcError
    assert isinstance(err.__cause__, RequestCanceledException)
    context = call_context(err)
    assert context is not None
    assert context.retry_attempts == 1
    assert "sdkcore: 2 attempts" in err.debug_error_string()


@pytest.mark.asyncio
async def test_a_first_answer_is_grpcs_error_unchanged(server: Server) -> None:
    """No retry happened: the AioRpcError is grpc's, with no sdkcore context."""

    async def not_found(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, NOT_FOUND)
        raise AssertionError("unreachable")

    method = server.unary_unary("NF", not_found)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    assert info.value.__cause__ is None
    assert call_context(info.value) is None
    assert "sdkcore" not in (info.value.debug_error_string() or "")


@pytest.mark.asyncio
async def test_inner_retries_reach_an_outer_requests_failure(server: Server) -> None:
    """One outer SDK attempt over the channel: the outer failure leads to the inner context."""
    method = server.unary_unary("O", _unavailable_then(NOT_FOUND))
    orchestrator = RetryOrchestrator()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(initial="0.001s", maximum="0.001s")
        ) as ch:
            stub = ch.unary_unary(method)

            async def send(request: Request) -> bytes:
                return await stub(b"x")  # type: ignore[no-any-return]

            outer_request = Request(name="outer", timeout=5.0)
            with pytest.raises(aio.AioRpcError) as info:
                await orchestrator.execute(outer_request, send)
    outer = info.value
    # the outer request's own context shows the channel's attempts inside its one attempt
    (only,) = outer_request.attempts
    assert only.error is not None
    assert only.error.startswith("AioRpcError: NOT_FOUND")
    assert only.error.endswith("after 2 attempt(s))")  # the count, said once
    context = call_context(outer)
    assert context is not None
    assert context.request_name == method
    assert context.extra["grpc_attempts"] == 2
    assert len(context.attempts) == 2
    assert context.attempts[0].error is not None
    assert "UNAVAILABLE" in context.attempts[0].error
    # and wrapped by an outer mapper, the chain still leads there
    wrapped = RequestCanceledException("outer gave up")
    wrapped.__cause__ = outer
    assert call_context(wrapped) is context


# -- numbers -------------------------------------------------------------------------
BAD_NUMBERS = [
    float("inf"),
    float("nan"),
    pytest.param(10**400, id="10**400"),
    True,
    pytest.param(-(10**400), id="-10**400"),
]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize("field", ["max_tokens", "token_ratio"])
def test_retry_throttler_rejects_bad_numbers_naming_the_field(field: str, value: Any) -> None:
    args = {"max_tokens": 10, "token_ratio": 0.5, field: value}
    with pytest.raises((TypeError, ValueError), match=field):
        RetryThrottler(args["max_tokens"], args["token_ratio"])
    with pytest.raises((TypeError, ValueError), match=field):
        throttler_for_target("bad-numbers.invalid:1", args["max_tokens"], args["token_ratio"])


@pytest.mark.parametrize("ratio", [0.001, 1000, 10**6, 1e6])
def test_retry_throttler_repr_never_raises(ratio: float) -> None:
    assert "RetryThrottler(" in repr(RetryThrottler(1000, ratio))


@pytest.mark.parametrize(
    ("target", "name"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("dns:///127.0.0.1:50051", "127.0.0.1:50051"),
        ("dns://8.8.8.8/example.com:443", "example.com:443"),  # the authority is the resolver
        ("ipv4:127.0.0.1:50051", "127.0.0.1:50051"),
        ("unix:/tmp/s.sock", "tmp/s.sock"),
        ("unix:///tmp/s.sock", "tmp/s.sock"),
        ("xds:///svc:8000", "svc:8000"),
        ("localhost:50051", "localhost:50051"),  # another name: another bucket, as in C-core
    ],
)
def test_the_server_name_a_bucket_is_kept_under(target: str, name: str) -> None:
    from sdkcore.grpc._target import server_name

    assert server_name(target) == name


def test_token_ratio_the_throttler_refuses_is_refused_by_the_config_too() -> None:
    cfg = '{"retryThrottling": {"maxTokens": 10, "tokenRatio": 1e300}}'
    with pytest.raises(ServiceConfigError, match="tokenRatio"):
        ServiceConfig.from_json(cfg)


@pytest.mark.parametrize(
    "value", [float("inf"), float("nan"), True, pytest.param(-(10**5000), id="-10**5000"), 1.5]
)
@pytest.mark.parametrize(
    "field",
    [
        "max_attempts_cap",
        "transparent_retry_limit",
        "per_call_buffer_limit",
        "channel_buffer_limit",
    ],
)
def test_retry_controller_rejects_bad_numbers_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=field):
        RetryController("numbers.invalid:1", None, **{field: value})


# -- both paths: the channel helpers (direct) and a channel built with the interceptors ----
@pytest.mark.asyncio
async def test_hedging_through_the_interceptors_on_a_hand_built_channel(server: Server) -> None:
    from hedge_server import ok

    script = HedgeScript(server, "HI", {1: ok(body=b"from 1")})  # hedge 0 blocks
    cfg = hedging_config(max_attempts=2, delay="0.05s")
    controller = RetryController(server.target, cfg)
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(
            server.target,
            options=controller.channel_options(),
            interceptors=controller.interceptors(),
        ) as ch:
            call = ch.unary_unary(script.method)(b"x")
            assert await call == b"from 1"
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
    assert script.count == 2


@pytest.mark.asyncio
async def test_direct_call_readers_after_a_retry(server: Server) -> None:
    """code(), details(), metadata and done() of a direct call that was retried, never awaited."""
    method = server.unary_unary("RD", _unavailable_then_ok())
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(initial="0.001s", maximum="0.001s")
        ) as ch:
            call = ch.unary_unary(method)(b"x")
            assert await call.code() is grpc.StatusCode.OK
            assert call.done()
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
            assert await call == b"ok"
            seen: list[Any] = []
            call.add_done_callback(seen.append)
            assert seen == [call]
    assert server.count("RD") == 2


def _unavailable_then_ok() -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt == 1:
            await abort(context, UNAVAILABLE)
        return b"ok"

    return fn


@pytest.mark.asyncio
async def test_awaited_call_cancelled_during_the_backoff(server: Server) -> None:
    """The awaiting task runs the retry loop; call.cancel() in the backoff ends it at once."""
    import asyncio

    from grpc_server import wait_until

    method = server.unary_unary("CB", _always(UNAVAILABLE))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(  # a 16-24 s backoff: the call is surely waiting in it
            server.target,
            service_config=retry_config(initial="20s", maximum="20s"),
            backoff_jitter=BackoffJitter.PROPORTIONAL,
        ) as ch:
            orchestrator = retry_controller(ch).orchestrator
            call = ch.unary_unary(method)(b"x")
            waiter = asyncio.ensure_future(_await(call))
            await wait_until(lambda: orchestrator.requests_in_retry == 1)
            assert not call.done()
            assert call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert await call.code() is grpc.StatusCode.CANCELLED
            assert call.cancelled()
            assert orchestrator.requests_in_retry == 0
    assert server.count("CB") == 1


@pytest.mark.asyncio
async def test_awaited_call_and_a_concurrent_reader_agree(server: Server) -> None:
    import asyncio

    method = server.unary_unary("CR", _unavailable_then(NOT_FOUND))
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(initial="0.01s", maximum="0.01s")
        ) as ch:
            call = ch.unary_unary(method)(b"x")
            reader = asyncio.ensure_future(call.code())
            with pytest.raises(aio.AioRpcError) as info:
                await call
            assert await reader is NOT_FOUND
            assert info.value.code() is NOT_FOUND
            assert await call.details() == info.value.details()
            assert previous_rpc_attempts(await call.trailing_metadata()) == 1
            assert call.done()
    assert server.count("CR") == 2


async def _await(call: Any) -> Any:
    return await call


def _always(code: Any) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await abort(context, code)
        raise AssertionError("unreachable")

    return fn


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda v: RetryPolicy(v, SECOND, SECOND, 2.0, CODES), "max_attempts"),
        (lambda v: RetryPolicy(3, SECOND, SECOND, v, CODES), "backoff_multiplier"),
        (lambda v: HedgingPolicy(v), "max_attempts"),
        (lambda v: RetryThrottlingPolicy(v, 0.5), "max_tokens"),
        (lambda v: RetryThrottlingPolicy(10, v), "token_ratio"),
    ],
)
@pytest.mark.parametrize(
    "value",
    [
        float("inf"),
        float("nan"),
        pytest.param(10**5000, id="10**5000"),
        pytest.param(-(10**5000), id="-10**5000"),
        True,
        -1,
        "3",
    ],
)
def test_policy_values_reject_bad_numbers_naming_the_field(
    build: Any, field: str, value: Any
) -> None:
    with pytest.raises((TypeError, ValueError), match=field) as info:
        build(value)
    assert not isinstance(info.value, OverflowError)


def test_policy_values_built_by_hand_keep_a_working_repr() -> None:
    for value in (
        RetryPolicy(10**400, SECOND, SECOND, 1e300, CODES),
        HedgingPolicy(2, timedelta(0), frozenset()),
        RetryThrottlingPolicy(1000, 1_000_000),
    ):
        assert type(value).__name__ in repr(value)
    with pytest.raises(ValueError, match="initial_backoff"):
        RetryPolicy(3, timedelta(0), SECOND, 2.0, CODES)
    with pytest.raises(TypeError, match="retryable_status_codes"):
        RetryPolicy(3, SECOND, SECOND, 2.0, {14})  # type: ignore[arg-type]
