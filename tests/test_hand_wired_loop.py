"""The hand-wired loop (README "…or wire maybe_retry into your own loop") on a real TCP server.

A line protocol on 127.0.0.1: the client writes ``<op> <key>``; the server answers as
scripted per connection: ``OK <value>``, ``LOCKED``, ``MISSING``, or nothing (hangs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    DocumentNotFoundException,
    Request,
    RequestCanceledException,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)

pytestmark = pytest.mark.anyio


class Locked(Exception):
    pass


class Missing(Exception):
    pass


@asynccontextmanager
async def line_server(script: list[str]) -> AsyncIterator[tuple[int, list[str]]]:
    """Serve ``script`` one answer per request ("hang": never answer); yields (port, seen)."""
    seen: list[str] = []
    answers = iter(script)

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            while True:
                try:
                    data = await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                seen.append(data.decode().strip())
                answer = next(answers, script[-1])
                if answer == "hang":
                    await anyio.sleep_forever()
                await stream.send(answer.encode() + b"\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        try:
            yield port, seen
        finally:
            tg.cancel_scope.cancel()


class Connection:
    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream

    async def send(self, op: str, key: str) -> str:
        await self.stream.send(f"{op} {key}\n".encode())
        answer = (await self.stream.receive()).decode().strip()
        if answer == "LOCKED":
            raise Locked(f"{key} is locked")
        if answer == "MISSING":
            raise Missing(f"{key} does not exist")
        return answer.removeprefix("OK ")


# The loop as README shows it.
async def dispatch(
    orchestrator: RetryOrchestrator, connection: Connection, request: Request, key: str
) -> str:
    while True:
        try:
            with orchestrator.attempt(request):  # cancels the attempt at the deadline
                value = await connection.send(request.name, key)
        except Locked as exc:
            await orchestrator.maybe_retry(request, RetryReason.KV_LOCKED, cause=exc)
            continue
        except Missing as exc:
            raise orchestrator.fail(request, DocumentNotFoundException(str(exc))) from exc
        orchestrator.succeed(request)
        return value


async def run(script: list[str], request: Request) -> tuple[str | BaseException, list[str]]:
    orchestrator = RetryOrchestrator()
    async with line_server(script) as (port, seen):
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            try:
                return await dispatch(orchestrator, Connection(stream), request, "k1"), seen
            except Exception as exc:
                return exc, seen


async def test_retries_then_succeeds() -> None:
    request = Request(name="GET", idempotent=True, timeout=2)
    outcome, seen = await run(["LOCKED", "LOCKED", "OK v1"], request)
    assert outcome == "v1"
    assert seen == ["GET k1"] * 3
    assert request.retry_attempts == 2
    assert [a.duration is not None for a in request.attempts] == [True, True]
    assert request.state.value == "succeeded"


async def test_deadline_cuts_the_attempt_in_flight_ambiguous_for_a_write() -> None:
    request = Request(name="UPSERT", idempotent=False, timeout=0.1)
    with anyio.fail_after(5):
        outcome, seen = await run(["hang"], request)
    assert isinstance(outcome, AmbiguousTimeoutException)
    assert seen == ["UPSERT k1"]
    ctx = outcome.context
    assert ctx is not None
    assert ctx.in_flight is True
    assert ctx.attempts[-1].effect is AttemptEffect.MAYBE_APPLIED
    assert outcome.__cause__ is None  # no failure before the cut; never the cancellation


async def test_deadline_after_a_locked_answer_keeps_it_as_cause() -> None:
    request = Request(name="GET", idempotent=True, timeout=0.1)
    with anyio.fail_after(5):
        outcome, _ = await run(["LOCKED", "hang"], request)
    assert isinstance(outcome, UnambiguousTimeoutException)
    assert isinstance(outcome.__cause__, Locked)
    assert outcome.context is not None
    assert outcome.context.last_error == "Locked: k1 is locked"


async def test_fail_completes_the_request_with_its_context() -> None:
    request = Request(name="GET", idempotent=True, timeout=2)
    outcome, _ = await run(["LOCKED", "MISSING"], request)
    assert isinstance(outcome, DocumentNotFoundException)
    assert outcome.context is not None
    assert outcome.context.request_id == request.id
    assert outcome.context.last_error == "DocumentNotFoundException: k1 does not exist"
    assert request.state.value == "failed"


def test_fail_with_the_callers_cancellation_ends_the_request_cancelled() -> None:
    """A loop cancelled outside sdkcore's calls hands sdkcore the cancellation: the request
    ends CANCELLED (TASK_CANCELLED) as when the cancellation cuts execute, no attempt booked."""
    import asyncio

    from sdkcore import CancellationReason, RetryableError

    orchestrator = RetryOrchestrator()
    request = Request(name="GET", idempotent=True, timeout=2)
    cancelled = asyncio.CancelledError()
    assert orchestrator.fail(request, cancelled) is cancelled
    assert request.state.value == "cancelled"
    assert request.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert request.attempts == ()
    # an error is still the attempt's answer: FAILED, recorded
    request = Request(name="GET", idempotent=True, timeout=2)
    orchestrator.fail(request, RetryableError(RetryReason.KV_LOCKED))
    assert request.state.value == "failed"
    assert len(request.attempts) == 1


async def test_request_cancel_cuts_the_attempt() -> None:
    request = Request(name="GET", idempotent=True, timeout=5)
    orchestrator = RetryOrchestrator()
    async with line_server(["hang"]) as (port, _):
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream, anyio.create_task_group() as tg:
            tg.start_soon(_cancel_soon, request)
            with anyio.fail_after(5), pytest.raises(RequestCanceledException):
                await dispatch(orchestrator, Connection(stream), request, "k1")


async def _cancel_soon(request: Request) -> None:
    await anyio.sleep(0.05)
    request.cancel()


async def test_attempt_on_an_expired_request_sends_nothing() -> None:
    request = Request(name="GET", idempotent=True, timeout=0.01)
    await anyio.sleep(0.02)
    with pytest.raises(UnambiguousTimeoutException):  # noqa: SIM117 - the body must not run
        with RetryOrchestrator().attempt(request):
            raise AssertionError("sent after the deadline")
