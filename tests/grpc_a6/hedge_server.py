"""A scripted unary-unary method for hedging tests, served by grpc_server.Server.

Each attempt is told apart by its ``grpc-previous-rpc-attempts`` header (the hedge
index) and plays the step scripted for that index. The server records, per
attempt, when it started (server loop time), its header, when it ended and
whether it saw the client's cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_server import HEADERS_FLUSH, Server, config_json

PREV = "grpc-previous-rpc-attempts"

Step = Callable[[Any], Awaitable[bytes]]


class Attempt:
    def __init__(self, index: int, header: str | None, start: float) -> None:
        self.index = index
        self.header = header
        self.start = start
        self.end: float | None = None
        self.cancelled = False


def ok(delay: float = 0.0, body: bytes = b"ok") -> Step:
    async def step(context: Any) -> bytes:
        await asyncio.sleep(delay)
        return body

    return step


def fail(code: Any, delay: float = 0.0, pushback: str | None = None) -> Step:
    async def step(context: Any) -> bytes:
        await asyncio.sleep(delay)
        if pushback is not None:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback),))
        await context.abort(code, f"scripted {code.name}")
        raise AssertionError("unreachable")

    return step


def block() -> Step:
    async def step(context: Any) -> bytes:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return step


def headers_then(then: Step, delay: float = 0.0) -> Step:
    """Send response headers (with an entry the client sees) after ``delay``, then ``then``."""

    async def step(context: Any) -> bytes:
        await asyncio.sleep(delay)
        await context.send_initial_metadata((("x-hedge", "headers"),))
        await asyncio.sleep(HEADERS_FLUSH)
        return await then(context)

    return step


class HedgeScript:
    """Registers method ``name`` on ``server``; ``steps[index]`` (else ``default``) per attempt."""

    def __init__(
        self,
        server: Server,
        name: str,
        steps: dict[int, Step],
        default: Step | None = None,
    ) -> None:
        self.steps = steps
        self.default = default or block()
        self.attempts: list[Attempt] = []
        self.t0 = asyncio.get_running_loop().time()
        self.method = server.unary_unary(name, self._handle)

    async def _handle(self, request: bytes, context: Any, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        md = dict(context.invocation_metadata())
        header = md.get(PREV)
        index = int(header) if header is not None else 0
        attempt = Attempt(index, header, loop.time() - self.t0)
        self.attempts.append(attempt)
        try:
            return await self.steps.get(index, self.default)(context)
        except asyncio.CancelledError:
            attempt.cancelled = True
            raise
        finally:
            attempt.end = loop.time() - self.t0

    def by_index(self) -> dict[int, Attempt]:
        return {a.index: a for a in self.attempts}

    def start(self, index: int) -> float:
        return self.by_index()[index].start

    @property
    def count(self) -> int:
        return len(self.attempts)

    def cancelled(self) -> set[int]:
        return {a.index for a in self.attempts if a.cancelled}

    def cancelled_attempts(self) -> list[Attempt]:
        """Every attempt the server saw cancelled (attempts without the header included)."""
        return [a for a in self.attempts if a.cancelled]


def hedging_config(
    *,
    max_attempts: int = 3,
    delay: str | None = "0.1s",
    non_fatal: tuple[str, ...] | None = ("UNAVAILABLE", "ABORTED"),
    throttling: dict[str, Any] | None = None,
    timeout: str | None = None,
) -> str:
    policy: dict[str, Any] = {"maxAttempts": max_attempts}
    if delay is not None:
        policy["hedgingDelay"] = delay
    if non_fatal is not None:
        policy["nonFatalStatusCodes"] = list(non_fatal)
    mc: dict[str, Any] = {"name": [{"service": "test.Svc"}], "hedgingPolicy": policy}
    return config_json(mc, timeout=timeout, throttling=throttling)


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
ABORTED = grpc.StatusCode.ABORTED
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
