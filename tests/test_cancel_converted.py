"""A ``send`` that turns a cancellation into a RetryableError: the cancellation wins.

Cancellation is never a retryable failure (rfc/0001). A driver that catches the
cancellation of its read and raises its own "connection closed" RetryableError made
``execute`` ask the strategy and book a retry for a deadline that had already passed
(reporting the attempt as not in flight), and on asyncio lose the caller's
``task.cancel()``: the request was retried and returned an answer.
"""

from __future__ import annotations

import asyncio
import sys

import anyio
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore._context import CancellationReason

pytestmark = pytest.mark.anyio

_COUNTS = sys.version_info >= (3, 11)  # asyncio can tell a task is being cancelled


class _Driver:
    """Its read turns the cancellation into "connection closed" (retryable)."""

    def __init__(self) -> None:
        self.sends = 0
        self.entered = anyio.Event()

    async def send(self, request: Request) -> str:
        self.sends += 1
        if self.sends > 1:
            return "answer from a retry"
        self.entered.set()
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            raise RetryableError(
                RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT,
                "read cut",
                effect=AttemptEffect.NOT_APPLIED,
            ) from None
        return "first answer"


async def test_a_deadline_cut_turned_into_a_retryable_error_is_the_timeout_in_flight() -> None:
    driver = _Driver()
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=0.05)
    with anyio.fail_after(5), pytest.raises(AmbiguousTimeoutException) as info:
        await orchestrator.execute(request, driver.send)
    assert driver.sends == 1
    assert request.retry_attempts == 0  # no retry booked after the deadline
    assert request.cancellation_reason is CancellationReason.TIMEOUT
    assert info.value.context is not None
    assert info.value.context.in_flight
    assert request.maybe_applied  # cut in flight: its own "not applied" is not believed


async def test_a_limiter_refusal_at_the_deadline_stays_not_sent() -> None:
    """A send whose own wait before writing (a limiter's queue) was cut, and which says
    so with a NOT_SENT refusal: the timeout stays unambiguous."""

    async def send(request: Request) -> str:
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            raise RetryableError(
                RetryReason.CONCURRENCY_LIMITED, "queue cut", effect=AttemptEffect.NOT_SENT
            ) from None
        return "never"

    request = Request(name="kv.upsert", idempotent=False, timeout=0.05)
    with anyio.fail_after(5), pytest.raises(TimeoutError) as info:
        await RetryOrchestrator().execute(request, send)
    assert type(info.value).__name__ == "UnambiguousTimeoutException"
    assert not request.maybe_applied
    assert request.retry_attempts == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.skipif(not _COUNTS, reason="3.10 cannot tell a task is being cancelled")
async def test_the_callers_task_cancel_turned_into_a_retryable_error_is_not_retried() -> None:
    """On asyncio the cancellation is delivered once: swallowed by send, the request was
    retried and the caller's task.cancel() lost (it got an answer). Told apart with the
    request's deadline scope, which counts the task's cancellations since it opened
    (without a deadline ``execute`` arms none, and such a send is retried as before)."""
    driver = _Driver()
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)
    task = asyncio.ensure_future(orchestrator.execute(request, driver.send))
    with anyio.fail_after(5):
        await driver.entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert driver.sends == 1
    assert request.state is RequestState.CANCELLED
    assert request.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert request.maybe_applied
    assert request.retry_attempts == 0


async def test_maybe_retry_given_the_callers_cancellation_lets_it_through() -> None:
    """A hand-wired loop handing the cancellation itself to maybe_retry: the request
    ends cancelled, the cancellation goes on (and the request's trace ends)."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)
    reached: list[str] = []
    with anyio.CancelScope() as scope:
        with orchestrator.attempt(request):
            pass  # sent; its answer is lost as the caller is cancelled
        scope.cancel()
        try:
            await anyio.sleep(1)
        except anyio.get_cancelled_exc_class() as exc:
            try:
                await orchestrator.maybe_retry(
                    request, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, cause=exc
                )
            finally:
                reached.append("after")
    assert scope.cancelled_caught
    assert reached == ["after"]
    assert request.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert request.retry_attempts == 0
    assert request.maybe_applied


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_maybe_retry_given_a_helpers_cancellation_raised_as_retryable_retries() -> None:
    """``raise RetryableError(...) from exc`` for a helper task's CancelledError (the
    caller is not cancelled): maybe_retry unwrapped it to the cancellation and raised it
    into a caller nobody cancelled. It is the driver's retryable failure."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    helper = asyncio.ensure_future(asyncio.sleep(10))
    helper.cancel()
    try:
        with orchestrator.attempt(request):
            try:
                await helper
            except asyncio.CancelledError as exc:
                raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT) from exc
    except RetryableError as failure:
        await orchestrator.maybe_retry(request, failure.reason, cause=failure)
    assert request.retry_attempts == 1
    assert request.state is RequestState.PENDING


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.skipif(not _COUNTS, reason="3.10 cannot tell a task is being cancelled")
async def test_an_attempt_block_that_turns_the_callers_cancel_into_retryable_raises_it() -> None:
    """The hand-wired loop's own door: the block's RetryableError raised for the caller's
    task.cancel() was handed to maybe_retry and retried into an answer."""
    driver = _Driver()
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)

    async def dispatch() -> str:
        while True:
            try:
                with orchestrator.attempt(request):
                    answer = await driver.send(request)
            except RetryableError as failure:
                await orchestrator.maybe_retry(request, failure.reason, cause=failure)
                continue
            orchestrator.succeed(request)
            return answer

    task = asyncio.ensure_future(dispatch())
    with anyio.fail_after(5):
        await driver.entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert driver.sends == 1
    assert request.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert request.maybe_applied


async def test_a_block_that_ended_unbooked_is_booked_maybe_applied_before_the_next() -> None:
    """A loop that reconnects by itself after a reset following the write: the first
    attempt vanished (overwritten by the next block) and the write timed out "not
    applied (unambiguous)". It is booked as maybe applied when the next block opens."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=0.1)
    sent = 0

    async def dispatch() -> None:
        nonlocal sent
        while True:
            try:
                with orchestrator.attempt(request):
                    sent += 1
                    if sent == 1:
                        raise ConnectionResetError("reset after the write")
                    await anyio.sleep(10)  # the second one hangs until the deadline
            except ConnectionResetError:
                continue  # reconnect and try again, without asking maybe_retry

    with pytest.raises(AmbiguousTimeoutException):
        await dispatch()
    assert [a.effect for a in request.attempts] == [
        AttemptEffect.MAYBE_APPLIED,
        AttemptEffect.MAYBE_APPLIED,
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_cancelled_helper_task_turned_into_a_retryable_error_is_retried() -> None:
    """Not every CancelledError is the caller's: a send whose helper task was cancelled
    (the caller is not) and which reports that as retryable is retried as usual."""
    sends = 0

    async def send(request: Request) -> str:
        nonlocal sends
        sends += 1
        if sends == 1:
            helper = asyncio.ensure_future(asyncio.sleep(10))
            helper.cancel()
            try:
                await helper
            except asyncio.CancelledError:
                raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT) from None
        return "ok"

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    assert await RetryOrchestrator().execute(request, send) == "ok"
    assert sends == 2
    assert request.retry_attempts == 1


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_answer_raised_after_a_cut_it_never_met_keeps_its_effect() -> None:
    """trio runs a task already woken by its answer on, uncut: a driver's reader hands
    the answer ("locked": not applied) over, then Request.cancel() comes before the
    sender runs. The sender raises the answer without meeting the cut: it is the
    answer, booked with its own effect, and the cancellation says "not applied"."""
    answered = anyio.Event()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)

    async def reader() -> None:
        await anyio.sleep(0.01)
        answered.set()
        request.cancel()

    async def send(r: Request) -> str:
        await answered.wait()
        raise RetryableError(RetryReason.KV_LOCKED, "locked")

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        with anyio.fail_after(5), pytest.raises(RequestCanceledException) as info:
            await RetryOrchestrator().execute(request, send)
    assert "not applied" in str(info.value)
    assert [a.effect for a in request.attempts] == [AttemptEffect.NOT_APPLIED]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_cleanup_request_while_the_task_is_being_cancelled_is_retried() -> None:
    """A request made in an ``except CancelledError`` (releasing a lock at shutdown): its
    failures carry that cancellation as ``__context__``, which is no cut of theirs. They
    are retried as usual, and the cancellation being handled goes on afterwards."""
    sends = 0

    async def release(request: Request) -> str:
        nonlocal sends
        sends += 1
        if sends == 1:
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE, "busy")
        return "released"

    async def worker() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            request = Request(name="kv.unlock", idempotent=True, timeout=5.0)
            return await RetryOrchestrator().execute(request, release)
        return "not cancelled"

    task = asyncio.ensure_future(worker())
    await asyncio.sleep(0.01)
    task.cancel()
    assert await task == "released"
    assert sends == 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.skipif(not _COUNTS, reason="3.10 cannot tell a task is being cancelled")
async def test_request_cancel_and_the_callers_cancel_in_one_turn_the_callers_wins() -> None:
    """Both in one loop turn, and send turns the cut into a RetryableError: that error
    escaped ``execute`` raw, and the caller's cancellation was lost."""
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)

    async def send(r: Request) -> str:
        task = asyncio.current_task()
        assert task is not None

        def both() -> None:
            task.cancel()  # the caller's
            r.cancel()  # and Request.cancel(), in the same turn

        asyncio.get_running_loop().call_soon(both)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RetryableError(
                RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT,
                "closed",
                effect=AttemptEffect.NOT_APPLIED,
            ) from None
        return "answer"

    task = asyncio.ensure_future(RetryOrchestrator().execute(request, send))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert request.state is RequestState.CANCELLED
    assert request.maybe_applied  # cut in flight: its own "not applied" is not believed


async def test_a_cancellation_that_left_an_attempt_block_goes_through_maybe_retry() -> None:
    """The block ended the request TASK_CANCELLED; a loop whose ``except BaseException``
    hands the cancellation to maybe_retry got "request was cancelled"
    (RequestCanceledException), the conversion the rule forbids. It gets the
    cancellation back."""
    orchestrator = RetryOrchestrator()
    request = Request(name="kv.upsert", idempotent=False, timeout=5.0)
    with anyio.CancelScope() as scope:
        try:
            with orchestrator.attempt(request):
                scope.cancel()
                await anyio.sleep(1)
        except BaseException as exc:  # the loop under test does this
            await orchestrator.maybe_retry(
                request, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, cause=exc
            )
    assert scope.cancelled_caught
    assert request.cancellation_reason is CancellationReason.TASK_CANCELLED
