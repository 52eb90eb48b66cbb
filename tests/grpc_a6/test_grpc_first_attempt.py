"""A method without a retryPolicy: a call that cannot be retried is grpc.aio's own.

sdkcore re-sends such a call only transparently, and only when the channel had no
connection as the call started (A6 case 1). A call that starts on a READY channel (or
with transparent retries off) is grpc.aio's call, with what sdkcore owes it: the method
config's timeout, an outer request's deadline, the retry budget's deposit, no
application-set ``grpc-previous-rpc-attempts`` (rfc/0003, "The direct path").
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, config_json  # noqa: E402

from sdkcore import Request, RetryBudget, RetryOrchestrator  # noqa: E402
from sdkcore.grpc import insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio
READY = grpc.ChannelConnectivity.READY
PREV = "grpc-previous-rpc-attempts"


def grpc_own(call: Any) -> bool:
    """True for grpc.aio's own call object, False for one sdkcore made around it."""
    return type(call).__module__.startswith("grpc.aio")


def remembers_time_left(seen: list[float]) -> Any:
    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        seen.append(context.time_remaining())
        return b"ok:" + request

    return fn


async def ok(request: bytes, context: Any, attempt: int) -> bytes:
    return b"ok:" + request


async def connect(ch: Any, method: str) -> None:
    """One call, so that the channel is READY for the next."""
    assert await ch.unary_unary(method)(b"warm") == b"ok:warm"
    assert ch.get_state() is READY


async def test_a_call_on_a_ready_channel_is_grpc_aio_own(server: Server) -> None:
    method = server.unary_unary("M", ok)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target) as ch:
            await connect(ch, method)
            call = ch.unary_unary(method)(b"x")
            assert grpc_own(call)
            assert await call == b"ok:x"


async def test_a_call_before_the_channel_connected_is_grpc_aio_own(server: Server) -> None:
    """No transparent retry can follow a connection failure (it fails fast, rfc/0003): a
    call made before the channel connected is grpc.aio's own call, as on a READY one."""
    method = server.unary_unary("M", ok)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target) as ch:
            assert ch.get_state() is not READY
            call = ch.unary_unary(method)(b"x")
            assert grpc_own(call)
            assert await call == b"ok:x"


async def test_with_transparent_retries_off_every_call_is_grpc_aio_own(server: Server) -> None:
    method = server.unary_unary("M", ok)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, transparent_retries=False) as ch:
            call = ch.unary_unary(method)(b"x")
            assert grpc_own(call)
            assert await call == b"ok:x"


async def test_the_method_config_timeout_bounds_the_call(server: Server) -> None:
    seen: list[float] = []
    method = server.unary_unary("M", remembers_time_left(seen))
    cfg = config_json({"name": [{"service": "test.Svc"}]}, timeout="1.5s", throttling=None)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, service_config=cfg) as ch:
            await connect(ch, method)
            seen.clear()
            call = ch.unary_unary(method)(b"x")
            assert grpc_own(call)
            assert await call == b"ok:x"
            assert await ch.unary_unary(method)(b"y", timeout=30) == b"ok:y"
            assert await ch.unary_unary(method)(b"z", timeout=0.5) == b"ok:z"
    # (the server reads its deadline from the grpc-timeout header: a few ms of slack)
    assert 0 < seen[0] < 1.6  # no timeout of its own: the method's (None without one)
    assert 0 < seen[1] < 1.6  # the method's timeout is the shorter of 1.5 s and 30 s
    assert 0 < seen[2] < 0.6  # the call's own is the shorter


async def test_an_outer_request_bounds_the_call(server: Server) -> None:
    seen: list[float] = []
    method = server.unary_unary("M", remembers_time_left(seen))
    orchestrator = RetryOrchestrator()
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target) as ch:
            await connect(ch, method)
            seen.clear()

            async def send(request: Request) -> Any:
                call = ch.unary_unary(method)(b"x", timeout=30)
                assert grpc_own(call)
                return await call

            outer = Request(name="outer", idempotent=True, timeout=1.0)
            assert await orchestrator.execute(outer, send) == b"ok:x"
    assert 0 < seen[0] < 1.1  # the outer request's 1 s, not the call's 30 s


async def test_every_call_pays_into_the_retry_budget(server: Server) -> None:
    method = server.unary_unary("M", ok)
    budget = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=0.5)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target, retry_budget=budget) as ch:
            await connect(ch, method)  # 0.5
            assert budget.balance == 0
            for _ in range(5):
                call = ch.unary_unary(method)(b"x")
                assert grpc_own(call)
                assert await call == b"ok:x"
    assert budget.balance == 3  # six first attempts at 0.5 retries each


async def test_an_application_set_previous_attempts_header_is_not_sent(server: Server) -> None:
    method = server.unary_unary("M", ok)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target) as ch:
            await connect(ch, method)
            call = ch.unary_unary(method)(b"x", metadata=((PREV, "5"), ("k", "v")))
            assert grpc_own(call)
            assert await call == b"ok:x"
    sent = server.attempts["M"][-1]
    assert PREV not in sent
    assert sent["k"] == "v"


async def test_a_server_sent_previous_attempts_header_is_the_server_s(server: Server) -> None:
    """Not retried, not intercepted: its metadata is the server's (as for a method
    without a plan; rfc/0003)."""

    async def says_seven(request: bytes, context: Any, attempt: int) -> bytes:
        context.set_trailing_metadata(((PREV, "7"),))
        return b"ok:" + request

    method = server.unary_unary("M", says_seven)
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(server.target) as ch:
            await connect(ch, method)
            call = ch.unary_unary(method)(b"x")
            assert await call == b"ok:x"
            trailing = await call.trailing_metadata()
    assert isinstance(call, aio.Call)
    assert trailing.get_all(PREV) == ["7"]
