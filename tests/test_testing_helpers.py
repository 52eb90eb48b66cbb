"""sdkcore.testing: instant retries, capture, scripted sends, scripted gRPC server, fixtures."""

from __future__ import annotations

import json
import threading
from collections.abc import MutableMapping
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import structlog

import sdkcore
from sdkcore import (
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    DocumentNotFoundException,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    _hooks,
)
from sdkcore.mapping import GrpcCode, KvOpcode, KvStatus
from sdkcore.testing import (
    Delay,
    ScriptedSend,
    VirtualClock,
    capture_retry_events,
    instant_retries,
)

pytestmark = pytest.mark.anyio


# -- ScriptedSend ----------------------------------------------------------------------------


async def test_scripted_send_plays_steps_then_repeats_the_last() -> None:
    boom = ValueError("boom")
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, boom, "ok"])
    req = Request()
    with pytest.raises(RetryableError) as info:
        await send(req)
    assert info.value.reason is RetryReason.KV_LOCKED
    with pytest.raises(ValueError, match="boom") as info2:
        await send(req)
    assert info2.value is boom
    assert await send(req) == "ok"
    assert await send(req) == "ok"
    assert send.calls == 4
    assert send.seen == [0, 0, 0, 0]
    assert send.indexes == [None, None, None, None]


async def test_kv_statuses_go_through_the_kv_mapping() -> None:
    send: ScriptedSend[Any] = ScriptedSend(
        [KvStatus.NOT_MY_VBUCKET, KvStatus.KEY_NOT_FOUND], kv_opcode=KvOpcode.GET
    )
    with pytest.raises(RetryableError) as info:
        await send(Request())
    assert info.value.reason is RetryReason.KV_NOT_MY_VBUCKET
    with pytest.raises(DocumentNotFoundException, match="KEY_NOT_FOUND on GET"):
        await send(Request())
    locked_on_unlock: ScriptedSend[Any] = ScriptedSend([KvStatus.LOCKED], kv_opcode=KvOpcode.UNLOCK)
    with pytest.raises(Exception, match="LOCKED on UNLOCK") as info3:
        await locked_on_unlock(Request())
    assert not isinstance(info3.value, RetryableError)  # RFC 0049: not retried on UNLOCK


async def test_grpc_codes_go_through_the_grpc_mapping() -> None:
    send: ScriptedSend[Any] = ScriptedSend([GrpcCode.UNAVAILABLE, GrpcCode.UNAUTHENTICATED])
    with pytest.raises(RetryableError) as info:
        await send(Request())
    assert info.value.reason is RetryReason.SERVICE_NOT_AVAILABLE
    with pytest.raises(AuthenticationFailureException):
        await send(Request())


async def test_delay_then_a_step() -> None:
    send: ScriptedSend[Any] = ScriptedSend([Delay(0, then=Delay(0.001, then=b"late")), Delay(0)])
    assert await send(Request()) == b"late"
    assert await send(Request()) is None


async def test_exception_classes_are_raised() -> None:
    send: ScriptedSend[Any] = ScriptedSend([KeyError])
    with pytest.raises(KeyError):
        await send(Request())


async def test_drives_execute_with_the_mapping() -> None:
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(sleep=clock.sleep)
    send: ScriptedSend[bytes] = ScriptedSend(
        [KvStatus.NOT_MY_VBUCKET, GrpcCode.UNAVAILABLE, RetryReason.KV_LOCKED, b"value"]
    )
    request = Request(name="get", idempotent=True, clock=clock.clock)
    assert await orchestrator.execute(request, send) == b"value"
    assert send.calls == 4
    assert send.seen == [0, 1, 2, 3]
    assert request.retry_reasons == (
        RetryReason.KV_NOT_MY_VBUCKET,
        RetryReason.SERVICE_NOT_AVAILABLE,
        RetryReason.KV_LOCKED,
    )


async def test_per_index_scripts_for_hedged_attempts() -> None:
    send: ScriptedSend[str] = ScriptedSend({0: [Delay(0.001, then="slow")], 1: ["fast"]})
    request = Request()
    assert await send(request, 1) == "fast"
    assert await send(request, 0) == "slow"
    assert await send(request, 1) == "fast"  # each index repeats its own last step
    assert send.indexes == [1, 0, 1]
    with pytest.raises(LookupError, match="no script for attempt index 2; scripts exist for 0, 1"):
        await send(request, 2)


async def test_one_script_shared_by_every_index() -> None:
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, "second"])
    with pytest.raises(RetryableError):
        await send(Request(), 0)
    assert await send(Request(), 1) == "second"


@pytest.mark.parametrize(
    ("script", "error", "match"),
    [
        ([], ValueError, r"ScriptedSend\(script\) needs at least one step"),
        ({}, ValueError, "needs at least one index"),
        ({0: []}, ValueError, r"ScriptedSend\(\{0: \.\.\.\}\) needs at least one step"),
        ({-1: ["x"]}, TypeError, "indexes must be ints >= 0"),
        ("abc", TypeError, "takes a list of steps"),
        ([KvStatus.SUCCESS], ValueError, r"\[0\]: KvStatus.SUCCESS is not a failure"),
        (["x", GrpcCode.OK], ValueError, r"\[1\]: GrpcCode.OK is not a failure"),
    ],
)
def test_bad_scripts_are_rejected(script: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ScriptedSend(script)


@pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), 10**400])
def test_bad_delays_are_rejected(seconds: Any) -> None:
    with pytest.raises(ValueError, match=r"Delay\(seconds\) must be a finite number"):
        Delay(seconds)


@pytest.mark.parametrize("seconds", ["1", True, None])
def test_delays_that_are_not_numbers_are_a_type_error(seconds: Any) -> None:
    with pytest.raises(TypeError, match=r"Delay\(seconds\) must be a number of seconds"):
        Delay(seconds)


# -- VirtualClock -----------------------------------------------------------------------------


async def test_virtual_clock() -> None:
    vc = VirtualClock(start=5.0)
    assert vc.clock() == 5.0
    vc.advance(1.5)
    assert vc.clock() == 6.5
    await vc.sleep(0.25)
    await vc.sleep(0)
    assert vc.clock() == 6.75
    assert vc.sleeps == [0.25, 0]


# -- instant_retries --------------------------------------------------------------------------


def test_instant_retries_sets_and_restores_the_switch() -> None:
    assert _hooks.INSTANT_DELAYS.get() is False
    with instant_retries():
        assert _hooks.INSTANT_DELAYS.get() is True
        with instant_retries():
            assert _hooks.INSTANT_DELAYS.get() is True
        assert _hooks.INSTANT_DELAYS.get() is True
    assert _hooks.INSTANT_DELAYS.get() is False


def test_instant_retries_is_not_seen_by_other_threads() -> None:
    seen: list[bool] = []
    with instant_retries():
        thread = threading.Thread(target=lambda: seen.append(_hooks.INSTANT_DELAYS.get()))
        thread.start()
        thread.join()
    assert seen == [False]


async def test_instant_retries_is_scoped_to_its_task() -> None:
    seen: dict[str, bool] = {}
    inside = anyio.Event()

    async def fast() -> None:
        with instant_retries():
            inside.set()
            await anyio.sleep(0.01)
            seen["fast"] = _hooks.INSTANT_DELAYS.get()

    async def other() -> None:
        await inside.wait()
        seen["other"] = _hooks.INSTANT_DELAYS.get()

    async with anyio.create_task_group() as tg:
        tg.start_soon(fast)
        tg.start_soon(other)
    assert seen == {"fast": True, "other": False}


async def test_instant_retries_skip_the_wait_but_not_the_decisions() -> None:
    orchestrator = RetryOrchestrator(default_strategy=BestEffortRetryStrategy(backoff=lambda n: 30))
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, RetryReason.KV_LOCKED, "ok"])
    request = Request(name="get", idempotent=True, timeout=None)
    with instant_retries(), capture_retry_events() as events:
        with anyio.fail_after(1):  # two 30 s backoffs, waited as zero
            assert await orchestrator.execute(request, send) == "ok"
    assert send.calls == 3
    assert request.retry_attempts == 2
    scheduled = [e for e in events if e["event"] == "retry.scheduled"]
    assert [e["delay_ms"] for e in scheduled] == [30000.0, 30000.0]


# -- capture_retry_events ---------------------------------------------------------------------


async def _one_refused_retry() -> None:
    orchestrator = RetryOrchestrator()
    request = Request(name="get", idempotent=True)
    with pytest.raises(AuthenticationFailureException):
        await orchestrator.maybe_retry(request, RetryReason.AUTHENTICATION_ERROR)


async def test_capture_sees_sdkcore_events_at_every_level() -> None:
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(sleep=clock.sleep)
    request = Request(name="get", idempotent=True, clock=clock.clock)
    with capture_retry_events() as events:
        await orchestrator.maybe_retry(request, RetryReason.KV_LOCKED)
        await _one_refused_retry()
    assert [(e["event"], e["log_level"]) for e in events] == [
        ("retry.scheduled", "debug"),
        ("retry.not_retried", "info"),
    ]
    assert events[0]["reason"] == "KV_LOCKED"
    assert events[0]["delay_ms"] == 1.0
    assert events[1]["cancellation_reason"] == "NO_MORE_RETRIES"


async def test_capture_ignores_other_loggers() -> None:
    with capture_retry_events() as events:
        structlog.get_logger("app").info("user.event", x=1)
    assert events == []


async def test_capture_leaves_structlog_configuration_alone() -> None:
    structlog.configure(processors=[structlog.processors.KeyValueRenderer()])
    try:
        before = structlog.get_config()
        with capture_retry_events():
            during = structlog.get_config()
        assert during == before
    finally:
        structlog.reset_defaults()


async def test_concurrent_captures_see_only_their_own_events() -> None:
    results: dict[str, list[str]] = {}

    async def run(name: str, reason: RetryReason) -> None:
        clock = VirtualClock()
        orchestrator = RetryOrchestrator(sleep=clock.sleep)
        with capture_retry_events() as events:
            for _ in range(3):
                request = Request(name=name, idempotent=True, clock=clock.clock)
                await orchestrator.maybe_retry(request, reason)
                await anyio.lowlevel.checkpoint()
        results[name] = [e["request_name"] for e in events]

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "a", RetryReason.KV_LOCKED)
        tg.start_soon(run, "b", RetryReason.KV_TEMPORARY_FAILURE)
    assert results == {"a": ["a"] * 3, "b": ["b"] * 3}


# -- the pytest plugin's fixtures ---------------------------------------------------------------


def test_instant_retries_fixture(sdkcore_instant_retries: None) -> None:
    assert _hooks.INSTANT_DELAYS.get() is True


async def test_instant_retries_fixture_reaches_async_tests(sdkcore_instant_retries: None) -> None:
    assert _hooks.INSTANT_DELAYS.get() is True


async def test_retry_events_fixture(sdkcore_retry_events: list[MutableMapping[str, Any]]) -> None:
    await _one_refused_retry()
    assert [e["event"] for e in sdkcore_retry_events] == ["retry.not_retried"]


def test_fixtures_reset_after_the_test() -> None:
    assert _hooks.INSTANT_DELAYS.get() is False


def test_public_names() -> None:
    import sdkcore.testing as testing

    assert set(testing.__all__) == {
        "Delay",
        "GrpcStatus",
        "ScriptedGrpcServer",
        "ScriptedSend",
        "VirtualClock",
        "capture_retry_events",
        "grpc_server",
        "instant_retries",
    }
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = testing.nope


# -- the scripted gRPC server (grpc.aio: asyncio only) -------------------------------------------

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])

SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "demo.Kv"}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.05s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


@asyncio_only
async def test_grpc_server_drives_an_sdkcore_channel() -> None:
    pytest.importorskip("grpc")
    import sdkcore.grpc
    from sdkcore.testing import grpc_server

    with anyio.fail_after(15):
        script = [GrpcCode.UNAVAILABLE, GrpcCode.UNAVAILABLE, b"value"]
        async with (
            grpc_server(script) as server,
            sdkcore.grpc.insecure_channel(server.target, service_config=SERVICE_CONFIG) as channel,
        ):
            reply = await channel.unary_unary("/demo.Kv/Get")(b"key", timeout=5)
    assert reply == b"value"
    assert server.calls == 3
    assert server.calls_by_method == {"/demo.Kv/Get": 3}
    assert server.requests == [b"key"] * 3
    assert [m.get("grpc-previous-rpc-attempts") for m in server.metadata] == [None, "1", "2"]


@asyncio_only
async def test_grpc_server_pushback_and_per_method_scripts() -> None:
    grpc = pytest.importorskip("grpc")
    import sdkcore.grpc
    from sdkcore.testing import GrpcStatus, grpc_server

    script = {
        "/demo.Kv/Get": [GrpcStatus("UNAVAILABLE", "overloaded", pushback_ms=-1)],
        "/demo.Kv/Set": [Delay(0.01, then=b"stored")],
    }
    with anyio.fail_after(15):
        async with (
            grpc_server(script) as server,
            sdkcore.grpc.insecure_channel(server.target, service_config=SERVICE_CONFIG) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/demo.Kv/Get")(b"k", timeout=5)
            assert await channel.unary_unary("/demo.Kv/Set")(b"k", timeout=5) == b"stored"
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await channel.unary_unary("/demo.Kv/Nope")(b"k", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "overloaded"
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert server.calls_by_method["/demo.Kv/Get"] == 1  # pushback -1: not retried


def test_grpc_server_rejects_bad_scripts() -> None:
    pytest.importorskip("grpc")
    from sdkcore.testing import GrpcStatus, grpc_server

    with pytest.raises(TypeError, match="a grpc_server step is reply bytes"):
        grpc_server(["text"])
    with pytest.raises(TypeError, match="keys are full method names"):
        grpc_server({"Get": [b"x"]})
    with pytest.raises(ValueError, match="needs at least one step"):
        grpc_server([])
    with pytest.raises(ValueError, match="OK is not a failure"):
        GrpcStatus(GrpcCode.OK)
    with pytest.raises(TypeError, match="pushback_ms"):
        GrpcStatus(GrpcCode.UNAVAILABLE, pushback_ms="10")  # type: ignore[arg-type]


def test_the_plugin_imports_the_helpers_only_when_used() -> None:
    import subprocess
    import sys

    code = (
        "import sys, sdkcore._pytest_plugin; print(sorted(m for m in sys.modules "
        "if m.startswith(('sdkcore.testing', 'sdkcore.mapping'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- the helpers together and at their edges -------------------------------------------------


async def test_instant_retries_on_a_virtual_clock_still_reaches_the_timeout() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(idempotent=True, timeout=2.5, clock=clock.clock)
    send: ScriptedSend[Any] = ScriptedSend([RetryReason.KV_TEMPORARY_FAILURE])
    with anyio.fail_after(10), instant_retries(), pytest.raises(sdkcore.TimeoutException):
        await orch.execute(request, send)
    assert clock.clock() >= 2.5  # the virtual sleeps ran: they are what reach the timeout
    assert send.calls < 100


async def test_a_capture_list_is_never_written_after_its_with() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: 0.0))
    request = Request(idempotent=True, timeout=5.0)
    with capture_retry_events() as events:
        await orch.maybe_retry(request, RetryReason.KV_LOCKED)  # its gate found here
    inside = len(events)
    assert inside >= 1
    await orch.maybe_retry(request, RetryReason.KV_LOCKED)  # after the with
    assert len(events) == inside


async def test_a_repeated_exception_instance_step_carries_each_requests_own_context() -> None:
    orch = RetryOrchestrator()
    send: ScriptedSend[Any] = ScriptedSend([DocumentNotFoundException("scripted")])
    seen = []
    for name in ("first", "second"):
        request = Request(name=name, timeout=1.0)
        with pytest.raises(DocumentNotFoundException) as info:
            await orch.execute(request, send)
        context = info.value.context
        assert context is not None
        seen.append((context.request_id, context.request_name))
    assert [n for _, n in seen] == ["first", "second"]
    assert seen[0][0] != seen[1][0]


def test_scripted_send_sync_plays_the_script_for_execute_sync() -> None:
    from sdkcore import RetryOrchestrator
    from sdkcore.mapping import KvStatus
    from sdkcore.testing import Delay, ScriptedSend, instant_retries

    script: ScriptedSend[bytes] = ScriptedSend(
        [KvStatus.LOCKED, Delay(0.01, then=RetryReason.KV_LOCKED), b"value"]
    )
    request = Request(name="get", idempotent=True)
    with instant_retries():
        assert RetryOrchestrator().execute_sync(request, script.sync) == b"value"
    assert script.calls == 3
    assert script.seen == [0, 1, 2]
    assert request.retry_reasons == (RetryReason.KV_LOCKED,)


# -- review fixes (an SDK maintainer's tests with these helpers) -----------------------------


def test_grpc_status_trailing_is_checked_when_built() -> None:
    """A bad trailer made the server's abort fail (UNKNOWN, INTERNAL at the client) or,
    a '-bin' key with a str value, hung the call until its deadline."""
    pytest.importorskip("grpc")
    from sdkcore.testing import GrpcStatus, grpc_server

    code = GrpcCode.UNAVAILABLE
    with pytest.raises(TypeError, match=r"\(key, value\) pairs, got the item 'a'"):
        GrpcStatus(code, trailing=("a", "b"))
    with pytest.raises(ValueError, match="'Bad Key' is not a gRPC metadata key"):
        GrpcStatus(code, trailing=(("Bad Key", "v"),))
    with pytest.raises(TypeError, match="binary key 'x-blob-bin' needs a bytes value"):
        GrpcStatus(code, trailing=(("x-blob-bin", "text"),))
    with pytest.raises(TypeError, match="needs a printable ASCII value"):
        GrpcStatus(code, trailing=(("x-reason", "caf\u00e9"),))
    kept = GrpcStatus(code, trailing=(("grpc-retry-pushback-ms", "abc"), ("x-blob-bin", b"\0")))
    assert kept.trailing[0] == ("grpc-retry-pushback-ms", "abc")  # a raw trailer, for parsers
    as_lists = GrpcStatus(code, trailing=[["x-reason", "busy"], ("x-raw", b"ascii")])
    assert as_lists.trailing == (("x-reason", "busy"), ("x-raw", b"ascii"))  # as grpc takes them
    with pytest.raises(TypeError, match=r"each method's script is a list of steps, got b'xy'"):
        grpc_server({"/a.B/C": b"xy"})
    with pytest.raises(TypeError, match=r"takes a list of steps, got <GrpcCode\.UNAVAILABLE"):
        grpc_server(GrpcCode.UNAVAILABLE)  # type: ignore[arg-type]


def test_scripted_send_checks_each_index_script_and_exception_classes() -> None:
    with pytest.raises(TypeError, match=r"each index's script is a list of steps, got b'fast'"):
        ScriptedSend({1: b"fast"})
    with pytest.raises(TypeError, match=r"got <RetryReason\.KV_LOCKED>"):
        ScriptedSend({0: RetryReason.KV_LOCKED})
    with pytest.raises(TypeError, match=r"cannot be raised without arguments .*RetryReason step"):
        ScriptedSend([RetryableError])
    ScriptedSend([ConnectionResetError, b"ok"])  # a class raisable as it is


def test_a_repeated_exception_step_does_not_grow_its_traceback() -> None:
    """The last step repeats: an instance raised again kept every earlier raise in its
    traceback (a test under instant_retries printed 15 MB for one failure)."""
    step = ConnectionResetError("reset")
    send: ScriptedSend[str] = ScriptedSend([step])
    depths = []
    for _ in range(5):
        with pytest.raises(ConnectionResetError) as info:
            send.sync(Request(idempotent=True))
        tb, depth = info.value.__traceback__, 0
        while tb is not None:
            depth, tb = depth + 1, tb.tb_next
        depths.append(depth)
    assert depths == [depths[0]] * 5


def test_instant_retries_with_execute_sync_on_a_virtual_clock_reaches_the_timeout() -> None:
    """The virtual clock's sleep still moves it under instant_retries(), as on the async
    doors: execute_sync retried for ever with the clock standing still."""
    for wiring in ("orchestrator", "argument"):
        clock = VirtualClock()
        start = clock.now
        send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED])
        request = Request(idempotent=True, timeout=2.5, clock=clock.clock)
        if wiring == "orchestrator":
            orch, kwargs = RetryOrchestrator(sleep=clock.sleep), {}
        else:
            orch, kwargs = RetryOrchestrator(), {"sleep": clock.sleep_sync}

        def bounded(r: Request, send: ScriptedSend[str] = send) -> str:
            if send.calls >= 1000:  # (the clock standing still: a failure, not a hang)
                raise RuntimeError("retried for ever on a virtual clock that never moved")
            return send.sync(r)

        with instant_retries(), pytest.raises(sdkcore.TimeoutException):
            orch.execute_sync(request, bounded, **kwargs)
        assert clock.now >= start + 2.5  # the virtual clock moved to the deadline
        assert send.calls < 100


async def test_an_inner_request_on_the_default_clock_still_answers_under_a_virtual_outer() -> None:
    """Library code builds its inner requests without knowing the test's clock: one with
    ``timeout=None`` inherits the outer deadline on ``time.monotonic`` and is not refused
    (rfc/0005, "VirtualClock"); its retry answers."""
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    inner_send: ScriptedSend[bytes] = ScriptedSend([RetryReason.KV_LOCKED, b"config"])

    async def outer_send(request: Request) -> bytes:
        inner = Request(idempotent=True, timeout=None)  # time.monotonic, deadline inherited
        return await orch.execute(inner, inner_send)

    with anyio.fail_after(10):
        outer = Request(idempotent=True, timeout=2.5, clock=clock.clock)
        assert await orch.execute(outer, outer_send) == b"config"
    assert inner_send.calls == 2


async def test_instant_retries_skips_an_injected_sleep_of_real_time() -> None:
    """Every delay is waited as zero: only a virtual clock's sleep still sleeps (it moves
    that clock); an injected real sleep slept the whole backoff on every door."""
    slept: list[float] = []

    async def real_sleep(seconds: float) -> None:
        slept.append(seconds)
        await anyio.sleep(seconds)

    def real_sleep_sync(seconds: float) -> None:
        slept.append(seconds)

    slow = BestEffortRetryStrategy(backoff=lambda n: 0.5)
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, RetryReason.KV_LOCKED, "ok"])
    with anyio.fail_after(10), instant_retries():
        orch = RetryOrchestrator(slow, sleep=real_sleep)
        assert await orch.execute(Request(idempotent=True, timeout=5.0), send) == "ok"
        sync_send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, "ok"])
        plain = RetryOrchestrator(slow)
        request = Request(idempotent=True, timeout=5.0)
        assert plain.execute_sync(request, sync_send.sync, sleep=real_sleep_sync) == "ok"
    assert slept == []


async def test_a_capture_ends_for_the_tasks_started_in_it_and_feeds_its_enclosing_one() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
    go = anyio.Event()

    async def retry_later() -> None:
        await go.wait()
        await orch.maybe_retry(Request(idempotent=True, timeout=5.0), RetryReason.KV_LOCKED)

    async with anyio.create_task_group() as tg:
        with capture_retry_events() as events:
            tg.start_soon(retry_later)
        go.set()  # the task logs after the with ended
    assert events == []  # "after the with, nothing is added"

    with capture_retry_events() as outer, capture_retry_events() as inner:
        await orch.maybe_retry(Request(idempotent=True, timeout=5.0), RetryReason.KV_LOCKED)
    assert [e["event"] for e in inner] == ["retry.scheduled"]
    assert [e["event"] for e in outer] == ["retry.scheduled"]  # the fixture's sees it too


async def test_nested_captures_see_what_is_logged_where_they_are_open() -> None:
    """A request that found its gate under the outer capture and retries inside an inner
    block is captured by both (the inner got nothing); a task started in an inner block
    that logs after it ended goes to the block around it, never to real logging; each
    list holds its own copy of an event."""
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
    request = Request(idempotent=True, timeout=5.0)
    go = anyio.Event()

    async def retry_later() -> None:
        await go.wait()
        await orch.maybe_retry(Request(idempotent=True, timeout=5.0), RetryReason.KV_LOCKED)

    with capture_retry_events() as outer:
        await orch.maybe_retry(request, RetryReason.KV_LOCKED)  # finds its gate here
        with capture_retry_events() as inner:
            await orch.maybe_retry(request, RetryReason.KV_LOCKED)
        async with anyio.create_task_group() as tg:
            with capture_retry_events() as ended:
                tg.start_soon(retry_later)
            go.set()
    assert [e["attempt"] for e in inner] == [2]
    assert [e["event"] for e in outer] == ["retry.scheduled"] * 3
    assert ended == []
    inner[0].clear()
    assert outer[1]["attempt"] == 2  # a copy of its own
