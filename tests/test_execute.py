"""RetryOrchestrator.execute: the dispatch loop for SDK code."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import anyio
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    CancellationReason,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    UnambiguousTimeoutException,
)
from sdkcore.testing import ScriptedSend, VirtualClock

pytestmark = pytest.mark.anyio


def virtual(strategy: Any = None) -> tuple[RetryOrchestrator, VirtualClock]:
    vc = VirtualClock()
    return RetryOrchestrator(strategy, sleep=vc.sleep), vc


@pytest.mark.parametrize("failures", [0, 1, 5])
async def test_success_after_retryable_failures(failures: int) -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    send: ScriptedSend[str] = ScriptedSend([*[RetryReason.KV_LOCKED] * failures, "value"])
    req = Request(timeout=10, clock=vc.clock)
    assert await orch.execute(req, send) == "value"
    assert send.calls == failures + 1
    assert send.seen == list(range(failures + 1))
    assert req.retry_attempts == failures
    assert req.retry_reasons == ((RetryReason.KV_LOCKED,) if failures else ())
    assert req.state is RequestState.SUCCEEDED
    assert vc.sleeps == pytest.approx([0.001 * 2**n for n in range(failures)])


async def test_mixed_reasons_and_always_retry() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    send: ScriptedSend[int] = ScriptedSend(
        [
            RetryReason.KV_NOT_MY_VBUCKET,
            RetryReason.SOCKET_NOT_AVAILABLE,
            RetryReason.KV_NOT_MY_VBUCKET,
            7,
        ]
    )
    req = Request(timeout=10, clock=vc.clock)
    assert await orch.execute(req, send) == 7
    assert req.retry_reasons == (RetryReason.KV_NOT_MY_VBUCKET, RetryReason.SOCKET_NOT_AVAILABLE)
    # controlled 1 ms, best effort 2 ms at attempt 1, controlled 50 ms at attempt 2
    assert vc.sleeps == pytest.approx([0.001, 0.002, 0.05])


async def test_non_retryable_exception_propagates_unchanged() -> None:
    original = KeyError("document missing")
    orch, vc = virtual(BestEffortRetryStrategy())
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, original])
    req = Request(timeout=10, clock=vc.clock)
    with pytest.raises(KeyError) as info:
        await orch.execute(req, send)
    assert info.value is original
    assert info.value.__cause__ is None
    assert req.state is RequestState.FAILED
    assert req.retry_attempts == 1
    assert send.calls == 2


@pytest.mark.parametrize("seconds", [None, 10.0])
async def test_a_send_that_returns_no_awaitable_gets_a_clear_error(seconds: float | None) -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(idempotent=True, timeout=seconds)

    def send(request: Request) -> str:  # forgot async
        return "answer"

    expected = r"send returned str, not an awaitable.*execute_sync"
    with pytest.raises(TypeError, match=expected) as info:
        await orch.execute(req, send)  # type: ignore[arg-type]
    assert info.value.__cause__ is None
    assert req.state is RequestState.FAILED
    assert req.failed_attempts == 1  # the call was made: it counts as an attempt that failed


async def test_a_type_error_raised_by_send_itself_passes_unchanged() -> None:
    original = TypeError("bad argument inside send")
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(idempotent=True, timeout=10.0)

    async def send(request: Request) -> str:
        raise original

    with pytest.raises(TypeError) as info:
        await orch.execute(req, send)
    assert info.value is original  # not mistaken for a send that returned no awaitable
    assert req.state is RequestState.FAILED
    assert req.last_error is original


async def test_refusal_cause_is_the_original_failure() -> None:
    original = ConnectionResetError("peer reset")

    async def send(_: Request) -> str:
        try:
            raise original
        except ConnectionResetError as exc:
            raise RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT) from exc

    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(idempotent=False, timeout=10, clock=vc.clock)
    with pytest.raises(RequestCanceledException) as info:
        await orch.execute(req, send)
    assert info.value.__cause__ is original
    assert info.value.context is not None
    assert info.value.context.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    assert info.value.context.reason is RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT
    assert req.cancelled


async def test_refusal_cause_given_with_cause_keyword() -> None:
    original = OSError("tls handshake")

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.AUTHENTICATION_ERROR, cause=original)

    orch, vc = virtual()  # default: fast fail on terminal errors
    with pytest.raises(AuthenticationFailureException) as info:
        await orch.execute(Request(timeout=10, clock=vc.clock), send)
    assert info.value.__cause__ is original


async def test_refusal_cause_without_original_is_the_retryable_error() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    send: ScriptedSend[str] = ScriptedSend([RetryReason.UNKNOWN])
    with pytest.raises(RequestCanceledException) as info:
        await orch.execute(Request(timeout=10, clock=vc.clock), send)
    assert isinstance(info.value.__cause__, RetryableError)
    assert info.value.__cause__.reason is RetryReason.UNKNOWN


@pytest.mark.parametrize(
    ("idempotent", "expected"),
    [(False, AmbiguousTimeoutException), (True, UnambiguousTimeoutException)],
)
async def test_attempt_in_flight_at_deadline_is_cancelled(
    idempotent: bool, expected: type[TimeoutException]
) -> None:
    cancelled: list[bool] = []
    calls = 0

    async def send(_: Request) -> str:
        nonlocal calls
        calls += 1
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise
        return "never"

    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(idempotent=idempotent, timeout=0.05)
    with anyio.fail_after(10):  # a safety net, not an assertion on timing
        with pytest.raises(TimeoutException) as info:
            await orch.execute(req, send)
    assert type(info.value) is expected
    assert cancelled == [True]
    assert calls == 1
    assert req.cancellation_reason is CancellationReason.TIMEOUT
    assert req.reached_network is True
    assert info.value.context is not None
    assert info.value.context.cancellation_reason is CancellationReason.TIMEOUT


async def test_timeout_while_in_retry_before_dispatch_is_unambiguous() -> None:
    orch, vc = virtual(BestEffortRetryStrategy(backoff=lambda n: 1.0))
    send: ScriptedSend[str] = ScriptedSend([RetryReason.SOCKET_NOT_AVAILABLE])
    req = Request(idempotent=False, timeout=10, clock=vc.clock)
    with pytest.raises(UnambiguousTimeoutException):
        await orch.execute(req, send)
    assert send.calls == 10  # attempts at t = 0..9 s; the 10th backoff reaches the deadline
    assert sum(vc.sleeps) == pytest.approx(10.0)


async def test_timeout_after_answers_that_prove_nothing_applied_is_unambiguous() -> None:
    orch, vc = virtual(BestEffortRetryStrategy(backoff=lambda n: 1.0))
    send: ScriptedSend[str] = ScriptedSend(
        [RetryReason.SOCKET_NOT_AVAILABLE, RetryReason.KV_LOCKED]
    )
    req = Request(idempotent=False, timeout=10, clock=vc.clock)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(req, send)
    assert info.value.context is not None
    assert info.value.context.retry_reasons == (
        RetryReason.SOCKET_NOT_AVAILABLE,
        RetryReason.KV_LOCKED,
    )


async def test_outer_cancellation_propagates_and_is_not_a_timeout(anyio_backend: str) -> None:
    before = set(asyncio.all_tasks()) if anyio_backend == "asyncio" else set()
    entered = anyio.Event()
    calls = 0
    seen: list[type[BaseException]] = []

    async def send(_: Request) -> str:
        nonlocal calls
        calls += 1
        entered.set()
        await anyio.sleep_forever()
        return "never"

    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(timeout=60)

    async def caller() -> None:
        try:
            await orch.execute(req, send)
        except BaseException as exc:
            seen.append(type(exc))
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await entered.wait()
        tg.cancel_scope.cancel()
    assert seen == [anyio.get_cancelled_exc_class()]
    assert calls == 1
    assert req.cancelled
    assert req.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert orch.requests_in_retry == 0
    if anyio_backend == "asyncio":
        assert set(asyncio.all_tasks()) == before


async def test_outer_cancellation_during_backoff_is_not_retried() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 30.0))
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, "late"])
    req = Request(timeout=60)
    with anyio.move_on_after(0.05) as scope:
        await orch.execute(req, send)
    assert scope.cancelled_caught
    assert send.calls == 1
    assert req.cancellation_reason is CancellationReason.TASK_CANCELLED


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio.Task.cancel() is asyncio's
async def test_asyncio_task_cancel_propagates_without_leaking_tasks() -> None:
    before = set(asyncio.all_tasks())
    entered = asyncio.Event()

    async def send(_: Request) -> str:
        entered.set()
        await asyncio.sleep(3600)
        return "never"

    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(timeout=60)
    task = asyncio.create_task(orch.execute(req, send))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert req.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert set(asyncio.all_tasks()) == before


async def test_request_cancel_during_execute_backoff() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 30.0))
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, "late"])
    req = Request(timeout=60)
    outcome: list[BaseException] = []

    async def caller() -> None:
        try:
            await orch.execute(req, send)
        except RequestCanceledException as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        req.cancel()
    assert len(outcome) == 1
    assert send.calls == 1
    assert req.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT


async def test_request_cancel_while_in_flight_is_not_a_success() -> None:
    """Cancelled by the application while an attempt is in flight: the caller gets
    RequestCanceledException, not the late result of a request whose state is CANCELLED."""
    release = anyio.Event()

    async def send(_: Request) -> str:
        await release.wait()
        return "late"

    orch = RetryOrchestrator(BestEffortRetryStrategy())
    req = Request(timeout=60)
    outcome: list[object] = []

    async def caller() -> None:
        try:
            outcome.append(await orch.execute(req, send))
        except RequestCanceledException as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        req.cancel()
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert len(outcome) == 1
    assert isinstance(outcome[0], RequestCanceledException), outcome
    assert req.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT


async def test_request_expired_before_the_first_attempt_is_not_sent() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    send: ScriptedSend[str] = ScriptedSend(["ok"])
    req = Request(idempotent=False, timeout=0.5, clock=vc.clock)
    vc.advance(0.6)
    with pytest.raises(UnambiguousTimeoutException):
        await orch.execute(req, send)
    assert send.calls == 0
    assert req.cancellation_reason is CancellationReason.TIMEOUT


async def test_timeout_none_request_works() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    send: ScriptedSend[str] = ScriptedSend(
        [RetryReason.KV_LOCKED, RetryReason.KV_NOT_MY_VBUCKET, "ok"]
    )
    req = Request(timeout=None)
    assert await orch.execute(req, send) == "ok"
    assert req.retry_attempts == 2
    assert req.state is RequestState.SUCCEEDED


async def test_timeout_none_non_retryable_and_refusal() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    with pytest.raises(ValueError, match="bad"):
        await orch.execute(Request(timeout=None), ScriptedSend([ValueError("bad")]))
    req = Request(timeout=None)
    with pytest.raises(RequestCanceledException):
        await orch.execute(req, ScriptedSend([RetryReason.UNKNOWN]))
    assert req.cancellation_reason is CancellationReason.NO_MORE_RETRIES


async def test_execute_on_completed_request_fails_clearly() -> None:
    orch = RetryOrchestrator()
    req = Request()
    assert await orch.execute(req, ScriptedSend([1])) == 1
    with pytest.raises(RuntimeError, match="already succeeded"):
        await orch.execute(req, ScriptedSend([2]))


async def test_send_sees_increasing_attempts_and_same_request() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    got: list[tuple[int, int]] = []
    req = Request(timeout=10, clock=vc.clock)

    async def send(r: Request) -> timedelta:
        got.append((r.id, r.retry_attempts))
        if r.retry_attempts < 3:
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE)
        return r.elapsed

    assert await orch.execute(req, send) == timedelta(milliseconds=7)
    assert got == [(req.id, 0), (req.id, 1), (req.id, 2), (req.id, 3)]


async def test_strategy_exception_inside_execute_propagates_and_fails_the_request() -> None:
    class Broken(Exception):
        pass

    class Raising:
        def retry_after(self, request: Request, reason: RetryReason) -> Any:
            raise Broken("decision service unavailable")

    orch, vc = virtual(Raising())
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED, "never"])
    req = Request(timeout=10, clock=vc.clock)
    with pytest.raises(Broken, match="decision service unavailable"):
        await orch.execute(req, send)
    assert send.calls == 1
    assert req.state is RequestState.FAILED
    assert req.retry_attempts == 0


async def test_bad_arguments_are_type_errors_and_leave_the_request_pending() -> None:
    orch = RetryOrchestrator()
    req = Request(timeout=5)
    with pytest.raises(TypeError, match=r"send must be an async callable"):
        await orch.execute(req, "not callable")  # type: ignore[arg-type]
    assert req.state is RequestState.PENDING
    with pytest.raises(TypeError, match=r"request must be an sdkcore\.Request"):
        await orch.execute(object(), ScriptedSend(["ok"]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"request must be an sdkcore\.Request"):
        await orch.maybe_retry("req", RetryReason.KV_LOCKED)  # type: ignore[arg-type]
