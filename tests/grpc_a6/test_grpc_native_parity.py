"""Side by side: grpcio's native retries and sdkcore reach the same outcome for the same script."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import HEADERS_FLUSH, TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402

from sdkcore.grpc import insecure_channel  # noqa: E402

pytestmark = pytest.mark.asyncio
S = grpc.StatusCode


def script(steps: list[Any]) -> Any:
    """One step per attempt: a StatusCode, ("headers", code) or ("pushback", value, code)."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        step = steps[min(attempt, len(steps)) - 1]
        if isinstance(step, tuple) and step[0] == "headers":
            await context.send_initial_metadata((("x-h", "1"),))
            await asyncio.sleep(HEADERS_FLUSH)  # headers go out on their own
            await abort(context, step[1])
        elif isinstance(step, tuple) and step[0] == "pushback":
            await abort(context, step[2], trailing=(("grpc-retry-pushback-ms", step[1]),))
        elif step is not S.OK:
            await abort(context, step)
        return b"ok"

    return fn


SCRIPTS = {
    "once": [S.ABORTED, S.OK],
    "twice": [S.UNAVAILABLE, S.ABORTED, S.OK],
    "always": [S.ABORTED],
    "fatal": [S.INVALID_ARGUMENT, S.OK],
    "pushback_stop": [("pushback", "-1", S.UNAVAILABLE), S.OK],
    "pushback_wait": [("pushback", "20", S.UNAVAILABLE), S.OK],
    "headers": [("headers", S.ABORTED), S.OK],
}


async def outcome(channel: Any, method: str) -> tuple[str, bytes | None]:
    try:
        return ("OK", await channel.unary_unary(method)(b"x", timeout=10))
    except aio.AioRpcError as err:
        return (err.code().name, None)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_same_outcome_as_native(server: Server, name: str) -> None:
    steps = SCRIPTS[name]
    native_method = server.unary_unary(f"{name}_native", script(steps))
    ours_method = server.unary_unary(f"{name}_sdkcore", script(steps))
    cfg = retry_config(max_attempts=3, initial="0.01s", maximum="0.02s")
    with anyio.fail_after(TEST_TIMEOUT):
        async with aio.insecure_channel(
            server.target, options=[("grpc.service_config", cfg), ("grpc.enable_retries", 1)]
        ) as native:
            native_result = await outcome(native, native_method)
        async with insecure_channel(server.target, service_config=cfg) as ours:
            ours_result = await outcome(ours, ours_method)
    assert ours_result == native_result
    assert server.count(f"{name}_sdkcore") == server.count(f"{name}_native")
    native_headers = [
        a.get("grpc-previous-rpc-attempts") for a in server.attempts[f"{name}_native"]
    ]
    ours_headers = [a.get("grpc-previous-rpc-attempts") for a in server.attempts[f"{name}_sdkcore"]]
    assert ours_headers == native_headers
