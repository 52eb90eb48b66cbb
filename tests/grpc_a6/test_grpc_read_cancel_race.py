"""A stream read past its end racing ``call.cancel()``: the cancellation, never CANCELLED.

grpc.aio's read, having reached the end of the response stream, checks whether the call
was cancelled locally, then waits for the server's status (``Call._raise_for_status``).
A ``call.cancel()`` landing in that wait returns True, and grpc.aio raises its local
CANCELLED status as ``AioRpcError(CANCELLED, "Locally cancelled by application!")``.
Seen once in the streaming fuzz under load; the same with plain grpc.aio. An sdkcore call
promises ``asyncio.CancelledError`` once ``cancel()`` returned True (rfc/0003), so the
read raises that. The interleaving is forced here by running the cancel at the moment
the read waits for the status (grpc.aio's private ``Call.code``, wrapped for the test).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc.aio import _call as aio_call  # noqa: E402

from sdkcore.grpc import insecure_channel  # noqa: E402

CONFIG = (
    '{"methodConfig": [{"name": [{"service": "race.Svc"}], "retryPolicy": {"maxAttempts": 3,'
    ' "initialBackoff": "0.01s", "maxBackoff": "0.01s", "backoffMultiplier": 2,'
    ' "retryableStatusCodes": ["UNAVAILABLE"]}}]}'
)

pytestmark = pytest.mark.skipif(
    not (hasattr(aio_call.Call, "_raise_for_status") and hasattr(aio_call.Call, "code")),
    reason="grpc.aio's Call changed: the interleaving cannot be forced",
)


async def _handler(request: bytes, context: Any) -> AsyncIterator[bytes]:
    await context.send_initial_metadata((("x-hdr", "1"),))
    await asyncio.sleep(0.005)
    await context.abort(grpc.StatusCode.NOT_FOUND, "scripted NOT_FOUND")
    yield b""  # never reached


class _Generic(grpc.GenericRpcHandler):  # type: ignore[misc,name-defined]
    def service(self, details: Any) -> Any:
        return grpc.unary_stream_rpc_method_handler(_handler)


@pytest.mark.asyncio
@pytest.mark.parametrize("style", ["read", "iterate"])
async def test_a_cancel_while_the_read_waits_for_the_status_is_the_cancellation(
    style: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    armed: list[Any] = []  # the cancel to run when the read waits for the status
    results: list[bool] = []
    reached: list[str] = []
    original_raise = aio_call.Call._raise_for_status
    original_code = aio_call.Call.code

    async def raise_for_status(self: Any) -> Any:
        self._test_in_raise = True
        try:
            return await original_raise(self)
        finally:
            self._test_in_raise = False

    async def code(self: Any) -> Any:
        if getattr(self, "_test_in_raise", False) and not self.done() and armed:
            reached.append("window")
            results.append(armed.pop()())
        return await original_code(self)

    monkeypatch.setattr(aio_call.Call, "_raise_for_status", raise_for_status)
    monkeypatch.setattr(aio_call.Call, "code", code)
    server = aio.server()
    server.add_generic_rpc_handlers((_Generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with insecure_channel(f"127.0.0.1:{port}", service_config=CONFIG) as channel:
            call = channel.unary_stream("/race.Svc/M")(b"x")
            await asyncio.wait_for(call.initial_metadata(), 10)
            armed.append(call.cancel)

            async def consume() -> None:
                if style == "read":
                    while await call.read() is not aio.EOF:
                        pass
                else:
                    async for _ in call:
                        pass

            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(consume(), 10)
            assert reached == ["window"]  # the race was forced, not missed
            assert results == [True]
            assert await call.code() is grpc.StatusCode.CANCELLED
    finally:
        await server.stop(None)
