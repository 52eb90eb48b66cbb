"""A request that ends well leaves nothing to the garbage collector, on every door.

A failed attempt's traceback holds the frames it passed through, and those hold the
request, whose history holds the failure: a reference cycle per retried request
unless the request lets go of the traceback when it gets its answer
(``Request._succeeded``). Objects in a cycle wait for a collection instead of being
freed at once: CPU a client pays, and pauses, that a hand-written loop does not cost.
Only sdkcore's objects are counted (the test runner and the event loops may keep
garbage of their own).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

import anyio
import pytest
from gc_kit import sdkcore_garbage

from sdkcore import (
    BestEffortRetryStrategy,
    HedgePolicy,
    Request,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
)

pytestmark = pytest.mark.anyio
REASON = RetryReason.KV_TEMPORARY_FAILURE
CALLS = 20


def orchestrator() -> RetryOrchestrator:
    return RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda attempt: timedelta(0)))


def fails_twice() -> Callable[[Request], Awaitable[str]]:
    sent = [0]

    async def send(request: Request) -> str:
        sent[0] += 1
        if sent[0] % 3:
            raise RetryableError(REASON, "busy")
        return "ok"

    return send


def fails_twice_while_handling() -> Callable[[Request], Awaitable[str]]:
    """A send that maps a transport error inside its ``except`` block, without ``from``:
    the ``RetryableError``'s ``__context__`` keeps the transport error, whose traceback
    holds the send's frame and with it the request."""
    sent = [0]

    async def send(request: Request) -> str:
        sent[0] += 1
        if sent[0] % 3:
            try:
                raise ConnectionResetError("reset by peer")
            except OSError:
                raise RetryableError(REASON, "busy")  # noqa: B904 (the pattern under test)
        return "ok"

    return send


async def left_by(call: Callable[[], Awaitable[object]]) -> list[str]:
    """sdkcore's objects that ``CALLS`` calls left in reference cycles, after one warm-up
    call (first-use caches are not garbage)."""
    await call()
    return await sdkcore_garbage(lambda i: call(), CALLS)


@pytest.mark.parametrize("request_timeout", [None, 5.0], ids=["no deadline", "deadline"])
@pytest.mark.parametrize(
    "make_send",
    [fails_twice, fails_twice_while_handling],
    ids=["plain failure", "failure raised while handling another"],
)
async def test_a_retried_execute_leaves_nothing(
    request_timeout: float | None, make_send: Callable[[], Callable[[Request], Awaitable[str]]]
) -> None:
    orch = orchestrator()
    send = make_send()

    async def call() -> object:
        request = Request(idempotent=True, timeout=request_timeout)
        assert await orch.execute(request, send) == "ok"
        assert request.retry_attempts == 2
        return request

    assert await left_by(call) == []


async def test_a_hand_wired_loop_leaves_nothing() -> None:
    orch = orchestrator()
    send = fails_twice()

    async def call() -> object:
        request = Request(idempotent=True, timeout=5.0)
        while True:
            try:
                with orch.attempt(request):
                    result = await send(request)
            except RetryableError as failure:
                await orch.maybe_retry(request, failure.reason, cause=failure)
                continue
            orch.succeed(request)
            return result

    assert await left_by(call) == []


@pytest.mark.parametrize("traced", [False, True], ids=["untraced", "traced"])
async def test_a_hedged_request_leaves_nothing(traced: bool) -> None:
    """Traced, each copy runs in a wrapper: a local there holding the cut's exception
    (whose traceback holds that frame) left a cycle per hedged request."""
    orch = orchestrator()
    if traced:
        pytest.importorskip("opentelemetry")
        from sdkcore import Telemetry

        orch = RetryOrchestrator(
            BestEffortRetryStrategy(backoff=lambda attempt: timedelta(0)), telemetry=Telemetry()
        )

    async def send(request: Request, index: int) -> int:
        await anyio.sleep(0.02 if index == 0 else 0.0)  # the hedge answers first
        return index

    policy = HedgePolicy(delay=timedelta(milliseconds=1), max_attempts=2)

    async def call() -> object:
        return await orch.hedge(Request(idempotent=True, timeout=5.0), send, policy)

    assert await left_by(call) == []


async def test_a_retried_execute_sync_leaves_nothing() -> None:
    orch = orchestrator()
    sent = [0]

    def send(request: Request) -> str:
        sent[0] += 1
        if sent[0] % 3:
            raise RetryableError(REASON, "busy")
        return "ok"

    async def call() -> object:
        return orch.execute_sync(Request(idempotent=True, timeout=5.0), send)

    assert await left_by(call) == []


async def test_a_hedge_copy_raising_its_own_error_for_the_cut_leaves_nothing() -> None:
    orch = orchestrator()

    async def send(request: Request, index: int) -> int:
        if index == 0:  # the loser: its read cut by the winner's answer says "reset"
            try:
                await anyio.sleep(0.02)
            except anyio.get_cancelled_exc_class():
                raise ConnectionResetError("reset by the cut") from None
        return index

    policy = HedgePolicy(delay=timedelta(milliseconds=1), max_attempts=2)

    async def call() -> object:
        request = Request(idempotent=True, timeout=5.0)
        assert await orch.hedge(request, send, policy) == 1
        assert (request.attempts[0].error or "").startswith("ConnectionResetError")
        return request

    assert await left_by(call) == []


async def test_the_callers_own_exception_keeps_its_traceback() -> None:
    """A door called in an ``except`` block: the failures' chains reach the exception the
    caller handles, whose traceback is the caller's, not the request's to free."""
    orch = orchestrator()
    send = fails_twice()
    try:
        raise KeyError("the caller's")
    except KeyError as handled:
        result = await orch.execute(Request(idempotent=True, timeout=5.0), send)
        traceback = handled.__traceback__
    assert result == "ok"
    assert traceback is not None


async def test_an_exception_a_failure_was_raised_from_keeps_its_traceback() -> None:
    """Only the chain of what ``send`` was handling is freed: an explicit cause may be an
    exception the request does not own (a connection keeps the error that broke it and
    raises every later error ``from`` it), whose traceback is its keeper's."""
    try:
        raise ConnectionResetError("reset while reading")
    except ConnectionResetError as exc:
        broken = exc
    assert broken.__traceback__ is not None
    sent = [0]

    async def send(request: Request) -> str:
        sent[0] += 1
        if sent[0] == 1:
            try:
                raise ConnectionError("the connection is broken") from broken
            except OSError:
                raise RetryableError(REASON, "unusable")  # noqa: B904 (the pattern under test)
        return "ok"

    assert await orchestrator().execute(Request(idempotent=True, timeout=5.0), send) == "ok"
    assert broken.__traceback__ is not None
