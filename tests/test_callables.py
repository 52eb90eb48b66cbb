"""Callables of the wrong kind: refused where they are given or awaited, naming the field;
the right kinds in every shape (a lambda returning an awaitable, a callable object, a
partial) still work."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import pytest

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    HedgePolicy,
    Request,
    RequestState,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore._callables import is_async, sync_callable

KL = RetryReason.KV_LOCKED


async def _coroutine_function(*args: Any) -> float:
    return 1.0


class _AsyncCall:
    async def __call__(self) -> float:
        return 1.0


class _SyncCall:
    def __call__(self) -> float:
        return 1.0


@pytest.mark.parametrize(
    "value",
    [_coroutine_function, functools.partial(_coroutine_function, 1), _AsyncCall()],
    ids=["async def", "partial", "async __call__"],
)
def test_async_shapes_are_refused_naming_the_field(value: object) -> None:
    assert is_async(value)
    with pytest.raises(TypeError, match=r"Thing\(clock\) must be a callable \(\) -> seconds"):
        sync_callable(value, "Thing(clock)", "() -> seconds")


@pytest.mark.parametrize(
    "value",
    [time.monotonic, lambda: 1.0, _SyncCall(), functools.partial(max, 1), _SyncCall, print],
    ids=["builtin", "lambda", "object", "partial", "a class", "print"],
)
def test_sync_shapes_pass(value: object) -> None:
    assert not is_async(value)
    sync_callable(value, "Thing(clock)", "() -> seconds")


def test_optional_none_passes_and_required_none_is_refused() -> None:
    sync_callable(None, "Thing(clock)", "() -> seconds", optional=True)
    with pytest.raises(TypeError, match=r"Thing\(clock\) must be a callable \(\) -> seconds, got"):
        sync_callable(None, "Thing(clock)", "() -> seconds")


def test_breaker_with_an_async_callable_object_as_clock_is_refused() -> None:
    with pytest.raises(TypeError, match=r"CircuitBreaker\(clock\)"):
        CircuitBreaker(clock=_AsyncCall())  # type: ignore[arg-type]


def test_request_clock_object_returning_seconds_is_kept() -> None:
    request = Request(clock=_SyncCall(), timeout=5.0)
    assert request.deadline == 6.0


def test_request_clock_returning_text_is_refused_and_names_the_clock() -> None:
    with pytest.raises(TypeError, match=r"Request.clock must be .* returned '1'"):
        Request(clock=lambda: "1")  # type: ignore[arg-type,return-value]


def _flaky(count: dict[str, int], fails: int = 1) -> Any:
    async def send(request: Request) -> str:
        count["n"] += 1
        if count["n"] <= fails:
            raise RetryableError(KL)
        return "ok"

    return send


def _sync_flaky(count: dict[str, int]) -> Any:
    def send(request: Request) -> str:
        count["n"] += 1
        if count["n"] < 2:
            raise RetryableError(KL)
        return "ok"

    return send


def test_sleep_as_a_plain_function_returning_an_awaitable_still_waits() -> None:
    waited: list[float] = []

    def sleep(seconds: float) -> Any:
        waited.append(seconds)
        return asyncio.sleep(0)

    count = {"n": 0}
    orchestrator = RetryOrchestrator(sleep=sleep)
    result = asyncio.run(orchestrator.execute(Request(idempotent=True), _flaky(count)))
    assert result == "ok"
    assert count["n"] == 2
    assert len(waited) == 1


def test_sleep_that_returns_nothing_fails_the_request_naming_sleep() -> None:
    count = {"n": 0}
    request = Request(idempotent=True)
    orchestrator = RetryOrchestrator(sleep=lambda seconds: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"RetryOrchestrator\(sleep=.*not an awaitable"):
        asyncio.run(orchestrator.execute(request, _flaky(count)))
    assert count["n"] == 1  # the retry was never sent
    assert request.state is RequestState.FAILED


def test_sleep_that_raises_type_error_itself_keeps_its_error() -> None:
    async def sleep(seconds: float) -> None:
        raise TypeError("the sleep's own")

    with pytest.raises(TypeError, match="the sleep's own"):
        asyncio.run(
            RetryOrchestrator(sleep=sleep).execute(Request(idempotent=True), _flaky({"n": 0}))
        )


def test_execute_sync_with_an_async_sleep_sends_no_retry() -> None:
    count = {"n": 0}
    send = _sync_flaky(count)

    async def sleep(seconds: float) -> None:
        raise AssertionError("never awaited")

    request = Request(idempotent=True)
    with pytest.raises(TypeError, match=r"execute_sync\(\.\.\., sleep=.*never waited"):
        RetryOrchestrator().execute_sync(request, send, sleep=sleep)
    assert count["n"] == 1  # before: the retry went out at once, without its backoff
    assert request.state is not RequestState.PENDING


def test_execute_sync_with_a_sleep_returning_a_value_is_fine() -> None:
    count = {"n": 0}
    send = _sync_flaky(count)

    result = RetryOrchestrator().execute_sync(
        Request(idempotent=True), send, sleep=lambda seconds: seconds
    )
    assert result == "ok"
    assert count["n"] == 2


def test_hedge_send_returning_a_value_fails_naming_send() -> None:
    request = Request(idempotent=True)

    async def main() -> object:
        return await RetryOrchestrator().hedge(
            request,
            lambda r, index: "ok",  # type: ignore[arg-type,return-value]
            HedgePolicy(2, delay=0.5),
        )

    with pytest.raises(TypeError, match=r"hedge\(request, send, policy\): send returned str"):
        asyncio.run(main())
    assert request.state is RequestState.FAILED


def test_hedge_send_raising_type_error_itself_keeps_its_error() -> None:
    async def send(request: Request, index: int) -> str:
        raise TypeError("send's own")

    async def main() -> object:
        return await RetryOrchestrator().hedge(Request(idempotent=True), send, HedgePolicy(2))

    with pytest.raises(TypeError, match="send's own"):
        asyncio.run(main())


@pytest.mark.parametrize("attempt", [0, 1, 63, 64, 10_000])
def test_backoff_takes_every_int(attempt: int) -> None:
    from sdkcore import best_effort_backoff

    assert best_effort_backoff(attempt).total_seconds() > 0


def test_decide_names_the_reason_member_for_its_name() -> None:
    with pytest.raises(TypeError, match=r"use RetryReason.KV_LOCKED"):
        BestEffortRetryStrategy().decide(Request(idempotent=True), "KV_LOCKED")  # type: ignore[arg-type]
