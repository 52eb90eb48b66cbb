"""A6 transparent retries: what grpc C-core does, what the interceptor does, and what
neither may do (a server cannot make its own status look like a transparent case)."""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import (  # noqa: E402
    TEST_TIMEOUT,
    ReservedPort,
    Server,
    retry_config,
    wait_until,
)
from h2_server import RawH2Server  # noqa: E402

from sdkcore import AttemptEffect, ConcurrencyLimiter  # noqa: E402
from sdkcore.grpc import (  # noqa: E402
    CallState,
    RetryController,
    insecure_channel,
    previous_rpc_attempts,
    retry_controller,
    retry_stats,
)
from sdkcore.grpc._call import _Call  # noqa: E402

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
PREV = "grpc-previous-rpc-attempts"
#: What grpc C-core says when no connection could be made; a server can say it too.
CONNECT_FAILURE_TEXT = "failed to connect to all addresses; last error: upstream unreachable"
#: Fast reconnects, so tests that wait for a server to come up stay short.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def always_unavailable_like_a_proxy() -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        await context.abort(UNAVAILABLE, CONNECT_FAILURE_TEXT)
        return b""

    return fn


def ok() -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        return b"ok:" + request

    return fn


@pytest.mark.asyncio
async def test_server_sent_connection_failure_text_is_an_ordinary_status(server: Server) -> None:
    """The server's words do not make a transparent retry: maxAttempts and the throttle apply."""
    method = server.unary_unary("M", always_unavailable_like_a_proxy())
    cfg = retry_config(max_attempts=2, throttling={"maxTokens": 100, "tokenRatio": 0.1})
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            before = throttler.milli_tokens
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=5)
            spent = before - throttler.milli_tokens
            stats = retry_stats(ch).for_method(method)
    assert info.value.code() is UNAVAILABLE
    assert info.value.details() == CONNECT_FAILURE_TEXT
    assert previous_rpc_attempts(info.value) == 1
    assert server.count("M") == 2
    assert spent == 2000  # one token per failed attempt
    assert (stats.retry_attempts, stats.transparent_retries) == (1, 0)


@pytest.mark.asyncio
async def test_server_sent_connection_failure_text_without_service_config(server: Server) -> None:
    method = server.unary_unary("M", always_unavailable_like_a_proxy())
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=3)
    assert info.value.code() is UNAVAILABLE
    assert server.count("M") == 1


@pytest.mark.asyncio
async def test_no_connection_fails_fast_as_grpcio() -> None:
    """No connection can be made and the call does not wait for ready: UNAVAILABLE at once,
    as grpcio's own channel answers (rfc/0003, "Fail fast"). UNAVAILABLE is not retryable
    here, so no attempt follows."""
    cfg = retry_config(codes=("ABORTED",))
    codes: dict[str, str] = {}
    with ReservedPort() as port, anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(port.target, service_config=cfg) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary("/test.Svc/M")(b"x", timeout=30)
            codes["sdkcore"] = info.value.code().name
            stats = retry_stats(ch).for_method("/test.Svc/M")
        async with aio.insecure_channel(port.target) as plain:
            with pytest.raises(aio.AioRpcError) as info:
                await plain.unary_unary("/test.Svc/M")(b"x", timeout=30)
            codes["grpc.aio"] = info.value.code().name
    # (TEST_TIMEOUT is far below the calls' 30 s: neither waited for its deadline)
    assert codes == {"sdkcore": "UNAVAILABLE", "grpc.aio": "UNAVAILABLE"}
    assert (stats.retry_attempts, stats.transparent_retries) == (0, 0)


@pytest.mark.asyncio
async def test_no_connection_is_retried_by_the_policy() -> None:
    """With UNAVAILABLE retryable, each attempt that finds no connection is an A6 attempt
    (maxAttempts, a throttling token), as grpc C-core's retry filter counts it."""
    cfg = retry_config(max_attempts=3, throttling={"maxTokens": 10, "tokenRatio": 0.1})
    with ReservedPort() as port, anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(port.target, service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            before = throttler.milli_tokens
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary("/test.Svc/M")(b"x", timeout=30)
            stats = retry_stats(ch).for_method("/test.Svc/M")
            spent = before - throttler.milli_tokens
    assert info.value.code() is UNAVAILABLE
    assert info.value.debug_error_string().startswith("sdkcore: 3 attempts; ")
    assert (stats.retry_attempts, stats.transparent_retries) == (2, 0)
    assert spent == 3000  # one token per failed attempt with a retryable status


@pytest.mark.asyncio
async def test_wait_for_ready_waits_for_the_server() -> None:
    """wait_for_ready=True: grpc C-core holds the call until the channel is READY, as on a
    plain channel; no attempt fails, none is retried."""
    server = Server()
    method = server.unary_unary("M", ok())
    with ReservedPort() as port:
        try:
            with anyio.fail_after(TEST_TIMEOUT):
                async with insecure_channel(
                    port.target, service_config=retry_config(), options=FAST_RECONNECT
                ) as ch:
                    call = ch.unary_unary(method)(b"x", timeout=10, wait_for_ready=True)
                    pending = asyncio.ensure_future(call)
                    await asyncio.sleep(0.3)
                    assert not pending.done()
                    await server.start(port.port)
                    port.release()
                    assert await pending == b"ok:x"
                    stats = retry_stats(ch).for_method(method)
        finally:
            await server.stop()
    assert (stats.retry_attempts, stats.transparent_retries) == (0, 0)
    assert server.count("M") == 1


def _holds_one(limiter: ConcurrencyLimiter) -> bool:
    return limiter.in_flight == 1


@pytest.mark.asyncio
async def test_transparent_retries_can_be_switched_off(server: Server) -> None:
    """The transparent re-send of an attempt the channel's own limiter refused (it never
    left the client, A6 case 1): on, the call waits for the permit and succeeds; off, the
    refusal's UNAVAILABLE goes to the retry policy, which does not retry it here."""
    release = asyncio.Event()

    async def held(request: bytes, context: Any, attempt: int) -> bytes:
        if request == b"first":
            await release.wait()
        return b"ok:" + request

    method = server.unary_unary("M", held)
    cfg = retry_config(codes=("ABORTED",))  # UNAVAILABLE: only a transparent retry resends it
    outcomes: dict[bool, str] = {}
    with anyio.fail_after(TEST_TIMEOUT):
        for enabled in (True, False):
            release.clear()
            limiter = ConcurrencyLimiter(1)
            async with insecure_channel(
                server.target, service_config=cfg, limiter=limiter, transparent_retries=enabled
            ) as ch:
                first = asyncio.ensure_future(ch.unary_unary(method)(b"first"))
                await wait_until(functools.partial(_holds_one, limiter))
                second = asyncio.ensure_future(ch.unary_unary(method)(b"second", timeout=10))
                await asyncio.sleep(0.1)
                release.set()
                try:
                    outcomes[enabled] = (await second).decode()
                except aio.AioRpcError as err:
                    outcomes[enabled] = err.code().name
                assert await first == b"ok:first"
    assert outcomes == {True: "ok:second", False: "UNAVAILABLE"}


def goaway_first(n: int) -> str:
    return "goaway" if n == 1 else "respond"


#: The opt-in to grpc C-core's own transparent retries (see RetryController.channel_options).
NATIVE_TRANSPARENT = [("grpc.enable_retries", 1)]


@pytest.mark.asyncio
@pytest.mark.parametrize("native", [False, True], ids=["default", "native_transparent"])
async def test_stream_never_seen_by_the_server(native: bool) -> None:
    """GOAWAY for a stream the server never processed. By default grpc C-core's retry
    filter is off and the interceptor cannot prove the server did not see it, so it is an
    ordinary retry. With the opt-in, C-core re-sends it inside the same attempt and the
    interceptor never sees the failure."""
    h2 = RawH2Server(goaway_first)
    await h2.start()
    cfg = retry_config(throttling={"maxTokens": 10, "tokenRatio": 0.1})
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with insecure_channel(
                h2.target, service_config=cfg, options=NATIVE_TRANSPARENT if native else None
            ) as ch:
                throttler = retry_controller(ch).throttler
                assert throttler is not None
                throttler.record_failure()  # below the cap, so a success shows
                before = throttler.milli_tokens
                call = ch.unary_unary("/test.Svc/M")(b"x", timeout=5)
                assert await call == b"ok"
                previous = previous_rpc_attempts(await call.trailing_metadata())
                spent = before - throttler.milli_tokens
                stats = retry_stats(ch).for_method("/test.Svc/M")
    finally:
        await h2.stop()
    assert [(s.connection, s.ended) for s in h2.streams] == [(1, "end_stream"), (2, "end_stream")]
    if native:
        assert (previous, spent, stats.retry_attempts, stats.transparent_retries) == (
            0,
            -100,  # the success only
            0,
            0,
        )
    else:
        assert (previous, spent, stats.retry_attempts) == (1, 1000 - 100, 1)


@pytest.mark.asyncio
async def test_stream_never_seen_by_the_server_without_a_policy_fails() -> None:
    h2 = RawH2Server(goaway_first)
    await h2.start()
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with insecure_channel(h2.target) as ch:
                with pytest.raises(aio.AioRpcError) as info:
                    await ch.unary_unary("/test.Svc/M")(b"x", timeout=5)
    finally:
        await h2.stop()
    assert info.value.code() is UNAVAILABLE
    assert len(h2.streams) == 1


@pytest.mark.asyncio
async def test_native_transparent_opt_in_replaces_the_previous_attempts_header(
    server: Server,
) -> None:
    """Why grpc C-core's retry filter is off by default: when on, it replaces the
    grpc-previous-rpc-attempts header of every attempt (grpcio 1.85), so the server no
    longer sees sdkcore's retry count."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt == 1:
            await context.abort(grpc.StatusCode.ABORTED, "scripted")
        return b"ok"

    method = server.unary_unary("M", fn)
    headers: dict[bool, list[str | None]] = {}
    with anyio.fail_after(TEST_TIMEOUT):
        for native in (False, True):
            server.attempts.clear()
            async with insecure_channel(
                server.target,
                service_config=retry_config(),
                options=NATIVE_TRANSPARENT if native else None,
            ) as ch:
                call = ch.unary_unary(method)(b"x")
                assert await call == b"ok"
                assert (
                    previous_rpc_attempts(await call.trailing_metadata()) == 1
                )  # the client still knows
            headers[native] = [a.get(PREV) for a in server.attempts["M"]]
    assert headers == {False: [None, "1"], True: [None, None]}


@pytest.mark.asyncio
async def test_refused_stream_goes_to_the_retry_policy() -> None:
    """grpc C-core (grpcio 1.85) does not retry an RST_STREAM(REFUSED_STREAM) transparently
    even with its retry filter on, and the interceptor cannot tell it from a server
    status: it is an ordinary retry."""
    h2 = RawH2Server(lambda n: "refuse" if n == 1 else "respond")
    await h2.start()
    try:
        with anyio.fail_after(TEST_TIMEOUT):
            async with insecure_channel(h2.target, service_config=retry_config()) as ch:
                call = ch.unary_unary("/test.Svc/M")(b"x", timeout=5)
                assert await call == b"ok"
                assert previous_rpc_attempts(await call.trailing_metadata()) == 1
                stats = retry_stats(ch).for_method("/test.Svc/M")
    finally:
        await h2.stop()
    assert len(h2.streams) == 2
    assert (stats.retry_attempts, stats.transparent_retries) == (1, 0)


def test_grpc_service_config_option_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"grpc\.service_config.*service_config="):
        insecure_channel("127.0.0.1:1", options=[("grpc.service_config", "{}")])


@pytest.mark.parametrize(
    ("option", "kwargs"),
    [
        (("grpc.enable_retries", 1), {"retries_enabled": False}),
        (("grpc.enable_retries", 1), {"transparent_retries": False}),
        (("grpc.service_config_disable_resolution", 0), {}),
    ],
)
def test_conflicting_retry_channel_options_are_rejected(
    option: tuple[str, int], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=option[0].replace(".", r"\.")):
        insecure_channel("127.0.0.1:1", options=[option], **kwargs)


@pytest.mark.asyncio
async def test_matching_retry_channel_options_are_accepted(server: Server) -> None:
    method = server.unary_unary("M", ok())
    options = [("grpc.enable_retries", 0), ("grpc.service_config_disable_resolution", 1)]
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, options=options) as ch:
            assert await ch.unary_unary(method)(b"x") == b"ok:x"


class FakeChannel:
    """Just the connectivity state, which is all the interceptor reads from its channel."""

    def __init__(self) -> None:
        self.state = grpc.ChannelConnectivity.READY

    def get_state(self, try_to_connect: bool = False) -> Any:
        return self.state


def status(code: Any) -> Any:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), f"scripted {code.name}", "")


@pytest.mark.asyncio
async def test_a_retry_that_finds_no_connection_is_an_attempt_known_not_sent() -> None:
    """Retry 1 finds no connection: it fails fast and is an A6 attempt of its own (not a
    transparent re-send), booked as not sent; retry 2 then fails with a status."""
    from sdkcore.grpc._call import _Call

    cfg = retry_config(max_attempts=3, initial="0.001s", maximum="0.001s")
    controller = RetryController("resent-retry.invalid:1", cfg)
    channel = FakeChannel()
    controller.bind_channel(channel)
    method = "/test.Svc/M"
    plan = controller.plan(method)
    assert plan is not None
    c = _Call.from_details(controller, plan, aio.ClientCallDetails(method, None, None, None, None))
    with anyio.fail_after(TEST_TIMEOUT):
        c.next_details()  # attempt 1, connected
        await c.failed(status(grpc.StatusCode.ABORTED))
        channel.state = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        c.next_details()  # attempt 2 (retry 1), no connection
        await c.failed(status(UNAVAILABLE))
        channel.state = grpc.ChannelConnectivity.READY
        details = c.next_details()  # attempt 3 (retry 2)
        assert dict(details.metadata)[PREV] == "2"
        with pytest.raises(aio.AioRpcError):
            await c.failed(status(grpc.StatusCode.ABORTED))
    stats = controller.stats.for_method(method)
    assert (stats.retry_attempts, stats.failed_retry_attempts, stats.transparent_retries) == (
        2,
        2,
        0,
    )
    effects = [a.effect for a in c.request.attempts]
    assert effects == [
        AttemptEffect.MAYBE_APPLIED,
        AttemptEffect.NOT_SENT,
        AttemptEffect.MAYBE_APPLIED,
    ]


@pytest.mark.asyncio
async def test_server_status_on_a_connected_attempt_is_never_transparent() -> None:
    """UNAVAILABLE with nothing received, channel failing now, but it was READY when the
    attempt started (the request may have reached the server): an ordinary status."""
    from sdkcore.grpc._call import _Call

    cfg = retry_config(max_attempts=2, initial="0.001s", maximum="0.001s")
    controller = RetryController("connected-attempt.invalid:1", cfg)
    channel = FakeChannel()
    controller.bind_channel(channel)
    plan = controller.plan("/test.Svc/M")
    assert plan is not None
    c = _Call.from_details(
        controller, plan, aio.ClientCallDetails("/test.Svc/M", None, None, None, None)
    )
    with anyio.fail_after(TEST_TIMEOUT):
        c.next_details()
        channel.state = grpc.ChannelConnectivity.TRANSIENT_FAILURE
        await c.failed(status(UNAVAILABLE))
    stats = controller.stats.for_method("/test.Svc/M")
    assert (stats.retry_attempts, stats.transparent_retries) == (1, 0)


#: The debug string's note of a call the channel's limiter refused before it was sent.
REFUSED_NOTE = r"^sdkcore: 1 attempt, (\d+) local refusals? \(CONCURRENCY_LIMITED, not sent\); "


@pytest.mark.asyncio
async def test_local_refusals_are_not_called_transparent_re_sends(server: Server) -> None:
    """The error's debug string counts the attempts the channel's limiter refused as what
    they are, local refusals with nothing sent (until 2026-11-28: "1 attempts, N transparent
    re-send(s)", a re-send of what was never sent): one attempt, the refusals by reason."""
    release = asyncio.Event()

    async def held(request: bytes, context: Any, attempt: int) -> bytes:
        if request == b"first":
            await release.wait()
            return b"ok"
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such key")
        return b""

    method = server.unary_unary("M", held)
    limiter = ConcurrencyLimiter(1)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(codes=("ABORTED",)), limiter=limiter
        ) as ch:
            first = asyncio.ensure_future(ch.unary_unary(method)(b"first"))
            await wait_until(functools.partial(_holds_one, limiter))
            second = asyncio.ensure_future(ch.unary_unary(method)(b"second", timeout=10))
            await asyncio.sleep(0.1)  # refused (10, 20, 40 ms apart) while first holds it
            release.set()
            with pytest.raises(aio.AioRpcError) as info:
                await second
            assert await first == b"ok"
            refused = retry_stats(ch).for_method(method).transparent_retries
    note = info.value.debug_error_string()
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    found = re.match(REFUSED_NOTE, note)
    assert found is not None, note
    assert int(found.group(1)) == refused >= 2
    assert "re-send" not in note
    assert server.count("M") == 2  # first, and second once: nothing was sent while refused


@pytest.mark.asyncio
async def test_a_call_refused_until_its_deadline_says_so(server: Server) -> None:
    """Refused locally until the deadline: the DEADLINE_EXCEEDED's debug string says one
    attempt and its local refusals (none of them sent), then why it ended."""
    release = asyncio.Event()

    async def held(request: bytes, context: Any, attempt: int) -> bytes:
        await release.wait()
        return b"ok"

    method = server.unary_unary("M", held)
    limiter = ConcurrencyLimiter(1)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(codes=("ABORTED",)), limiter=limiter
        ) as ch:
            first = asyncio.ensure_future(ch.unary_unary(method)(b"first"))
            await wait_until(functools.partial(_holds_one, limiter))
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"second", timeout=0.2)
            release.set()
            assert await first == b"ok"
    note = info.value.debug_error_string()
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert re.match(
        REFUSED_NOTE + "deadline reached while waiting to retry after UNAVAILABLE", note
    ), note
    assert server.count("M") == 1


def test_real_transparent_re_sends_and_attempts_are_counted_in_words() -> None:
    """A6's transparent retry of a refused stream (``TransparentKind.REFUSED``: it reached
    the server's gRPC library) is a re-send, and keeps that name; counts are pluralised."""
    call = object.__new__(_Call)
    call.state = state = CallState()
    state.attempts, state.refused_retries = 1, 1
    assert call._note() == "sdkcore: 1 attempt, 1 transparent re-send; "
    state.attempts, state.refused_retries = 3, 0
    assert call._note() == "sdkcore: 3 attempts; "
    state.attempts = 1
    assert call._note() == ""  # not retried: nothing to say
