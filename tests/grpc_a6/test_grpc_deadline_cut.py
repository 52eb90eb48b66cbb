"""A deadline that cuts a grpc.aio attempt in flight gives the timeout, never a bare CancelledError.

grpc.aio runs the call in its own task and re-raises a fresh ``CancelledError`` (or a
DEADLINE_EXCEEDED error when the per-attempt timeout fires first), which anyio's cancel
scope does not recognise as its own. ``execute`` knows its deadline fired: whatever the
send raises at that moment, the caller gets the timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpc_server import Server

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    Request,
    RetryOrchestrator,
    UnambiguousTimeoutException,
)

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402

pytestmark = pytest.mark.asyncio

RUNS = 200
BATCH = 20  # concurrent requests per round, so 200 runs take a fraction of a second


async def _block(request: bytes, context: Any, attempt: int) -> bytes:
    await asyncio.Event().wait()  # never answers: the client's deadline must cut it
    return b""


@pytest.mark.parametrize(
    "per_attempt_timeout", [False, True], ids=["no-attempt-timeout", "attempt-timeout"]
)
@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "non-idempotent"])
async def test_deadline_cut_of_a_grpc_call_is_always_the_timeout(
    server: Server, per_attempt_timeout: bool, idempotent: bool
) -> None:
    method = server.unary_unary("Block", _block)
    orchestrator = RetryOrchestrator()
    outcomes: dict[str, int] = {}
    async with aio.insecure_channel(server.target) as channel:
        call = channel.unary_unary(method)

        async def send(request: Request) -> bytes:
            left = request.time_left
            timeout = left.total_seconds() if (per_attempt_timeout and left is not None) else None
            reply: bytes = await call(b"x", timeout=timeout)
            return reply

        async def one() -> None:
            request = Request(name="get", idempotent=idempotent, timeout=0.03)
            try:
                await orchestrator.execute(request, send)
            except BaseException as exc:  # counting every kind, leaks included
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                if isinstance(exc, (AmbiguousTimeoutException, UnambiguousTimeoutException)):
                    ctx = exc.context
                    good = (
                        ctx is not None
                        and ctx.in_flight
                        and ctx.attempts[-1].effect is AttemptEffect.MAYBE_APPLIED
                        and not isinstance(exc.__cause__, asyncio.CancelledError)
                    )
                    if not good:
                        outcomes["timeout without the in-flight report"] = 1
            else:
                outcomes["returned"] = outcomes.get("returned", 0) + 1

        for _ in range(RUNS // BATCH):
            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(BATCH))), 10)
    expected = "UnambiguousTimeoutException" if idempotent else "AmbiguousTimeoutException"
    assert outcomes == {expected: RUNS}
