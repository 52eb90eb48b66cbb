"""``sdkcore.dispatch_unsent()``: a ``send`` says its attempt was cut before anything was
written, so a write's timeout stays unambiguous (rfc/0001, "Dispatch not sent").

A driver's ``send`` often waits before it writes (a connection's write lock, a pool):
cut there by the request's deadline, the attempt was booked cut in flight, "may have been
applied (ambiguous)", though nothing went out. On asyncio and trio.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
    dispatch_unsent,
)

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def lock_wait(say_unsent: bool) -> AsyncIterator[None]:
    """A wait for a lock nobody releases, as a driver's before its write."""
    try:
        await anyio.Event().wait()
        yield
    except BaseException:
        if say_unsent:
            dispatch_unsent()
        raise


@pytest.mark.parametrize("say_unsent", [True, False])
async def test_a_write_cut_before_it_was_written_times_out_unambiguous(say_unsent: bool) -> None:
    async def send(request: Request) -> None:
        async with lock_wait(say_unsent):
            raise AssertionError("never reached")

    request = Request(name="kv.upsert", idempotent=False, timeout=0.1)
    expected = UnambiguousTimeoutException if say_unsent else AmbiguousTimeoutException
    with anyio.fail_after(5), pytest.raises(expected) as info:
        await RetryOrchestrator().execute(request, send)
    effect = AttemptEffect.NOT_SENT if say_unsent else AttemptEffect.MAYBE_APPLIED
    assert [a.effect for a in request.attempts] == [effect]
    if say_unsent:
        assert "it was not applied on the server (unambiguous)" in str(info.value)


async def test_in_an_attempt_block_too() -> None:
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=0.1)

    async def block() -> None:
        with orchestrator.attempt(request):
            async with lock_wait(True):
                pass

    with anyio.fail_after(5), pytest.raises(UnambiguousTimeoutException):
        await block()
    assert [a.effect for a in request.attempts] == [AttemptEffect.NOT_SENT]


async def test_an_error_after_the_mark_is_booked_as_itself() -> None:
    """Only a cancellation reads the mark: send that caught its own cut and went on to
    fail otherwise is booked with that failure."""

    async def send(request: Request) -> None:
        with anyio.move_on_after(0.01):
            async with lock_wait(True):
                pass
        raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)  # then: one more attempt

    calls = []

    async def counted(request: Request) -> str:
        calls.append(request.retry_attempts)
        if len(calls) == 1:
            await send(request)
        return "ok"

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    with anyio.fail_after(5):
        assert await RetryOrchestrator().execute(request, counted) == "ok"
    # booked with what the RetryableError says (its reason's default effect), not NOT_SENT
    assert [(a.reason, a.effect) for a in request.attempts] == [
        (RetryReason.KV_TEMPORARY_FAILURE, AttemptEffect.NOT_APPLIED)
    ]


def test_outside_any_door_it_does_nothing() -> None:
    dispatch_unsent()  # no mark: nothing to say it to, and no error
