"""The effect decides: a non-idempotent request that may have been applied is never sent again.

A reason's RFC 0049 flag says what a failure usually means; the attempt's effect says
what happened to this one. gRPC UNAVAILABLE answered by a server maps to
SERVICE_NOT_AVAILABLE (whose flag allows a non-idempotent retry: it is usually raised
before sending) with the effect MAYBE_APPLIED. The effect wins, on every door
(rfc/0001, "Which wins: the effect or the flag").
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from sdkcore import (
    AttemptEffect,
    CancellationReason,
    HedgePolicy,
    InvalidArgumentException,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
)
from sdkcore.mapping import grpc_failure, raise_failure
from sdkcore.testing import VirtualClock

pytestmark = pytest.mark.anyio

SNA = RetryReason.SERVICE_NOT_AVAILABLE


def _assert_refused_once(info: pytest.ExceptionInfo[RequestCanceledException], sends: int) -> None:
    assert sends == 1, "a maybe-applied, non-idempotent request was sent again"
    message = str(info.value)
    assert "may have been applied" in message
    assert "SERVICE_NOT_AVAILABLE" in message
    assert "MAYBE_APPLIED" in message
    context = info.value.context
    assert context is not None
    assert context.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    assert [a.effect for a in context.attempts] == [AttemptEffect.MAYBE_APPLIED]


async def test_execute_sends_an_unavailable_upsert_once() -> None:
    """The issue's reproduction: before, it was sent 6 times, then timed out ambiguously."""
    sends = 0

    async def send(request: Request) -> None:
        nonlocal sends
        sends += 1
        raise_failure(grpc_failure("UNAVAILABLE", "node restarting"))

    request = Request(name="upsert", timeout=0.05)
    with pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().execute(request, send)
    _assert_refused_once(info, sends)
    assert isinstance(info.value.__cause__, Exception)  # the server's answer is in the traceback


async def test_execute_keeps_the_effect_over_an_always_retry_reason() -> None:
    """Whatever the flags: an always-retry reason does not re-send a maybe-applied write."""
    sends = 0

    async def send(request: Request) -> None:
        nonlocal sends
        sends += 1
        raise RetryableError(RetryReason.KV_NOT_MY_VBUCKET, effect=AttemptEffect.MAYBE_APPLIED)

    with pytest.raises(RequestCanceledException, match="may have been applied"):
        await RetryOrchestrator().execute(Request(timeout=1.0), send)
    assert sends == 1


@pytest.mark.parametrize("effect", [AttemptEffect.NOT_APPLIED, AttemptEffect.NOT_SENT])
async def test_not_applied_and_not_sent_attempts_keep_retrying(effect: AttemptEffect) -> None:
    sends = 0

    async def send(request: Request) -> str:
        nonlocal sends
        sends += 1
        if sends < 3:
            raise RetryableError(SNA, effect=effect)
        return "ok"

    assert await RetryOrchestrator().execute(Request(timeout=1.0), send) == "ok"
    assert sends == 3


@pytest.mark.parametrize("effect", [AttemptEffect.NOT_APPLIED, AttemptEffect.NOT_SENT])
async def test_a_flags_refusal_of_an_attempt_known_not_applied_says_it_was_not_applied(
    effect: AttemptEffect,
) -> None:
    """The reason's flag refuses alone (UNKNOWN forbids a non-idempotent retry, whatever the
    effect): the message says the write was not applied, not that it may have reached the
    server (an operator would reconcile a write that never happened)."""

    async def send(request: Request) -> str:
        raise RetryableError(RetryReason.UNKNOWN, effect=effect)

    request = Request(name="kv.upsert", timeout=1.0)
    with pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().execute(request, send)
    message = str(info.value)
    assert "may have" not in message.split(";")[0]
    assert "reason UNKNOWN does not allow retrying a non-idempotent request" in message
    assert f"recorded {effect.name}, so it was not applied" in message
    assert "idempotent=True" in message
    assert not request.maybe_applied


async def test_an_idempotent_request_keeps_retrying_after_maybe_applied() -> None:
    sends = 0

    async def send(request: Request) -> str:
        nonlocal sends
        sends += 1
        if sends < 3:
            raise_failure(grpc_failure("UNAVAILABLE"))
        return "ok"

    assert await RetryOrchestrator().execute(Request(idempotent=True, timeout=1.0), send) == "ok"
    assert sends == 3


async def test_maybe_retry_refuses_at_once_without_waiting() -> None:
    clock = VirtualClock()
    orchestrator = RetryOrchestrator(sleep=clock.sleep)
    request = Request(name="upsert", timeout=5.0, clock=clock.clock)
    started = clock.now
    with pytest.raises(RequestCanceledException) as info:
        await orchestrator.maybe_retry(request, SNA, effect=AttemptEffect.MAYBE_APPLIED)
    _assert_refused_once(info, 1)
    assert clock.now == started
    assert request.retry_attempts == 0


async def test_hand_wired_loop_with_attempt_sends_once() -> None:
    orchestrator = RetryOrchestrator()
    request = Request(name="upsert", timeout=1.0)
    sends = 0

    async def loop() -> None:
        nonlocal sends
        while True:
            try:
                with orchestrator.attempt(request):
                    sends += 1
                    await anyio.lowlevel.checkpoint()
                    raise_failure(grpc_failure("UNAVAILABLE"))
            except RetryableError as failure:
                await orchestrator.maybe_retry(
                    request, failure.reason, cause=failure, effect=failure.effect
                )

    with pytest.raises(RequestCanceledException) as info:
        await loop()
    _assert_refused_once(info, sends)


async def test_hedge_never_sends_a_non_idempotent_request() -> None:
    """Hedging sends copies at once: only idempotent requests are hedged at all."""
    sends = 0

    async def send(request: Request, index: int) -> None:
        nonlocal sends
        sends += 1

    policy = HedgePolicy(max_attempts=3, delay=0.001)
    with pytest.raises(InvalidArgumentException, match="not idempotent"):
        await RetryOrchestrator().hedge(Request(timeout=1.0), send, policy)
    assert sends == 0


def test_execute_sync_sends_an_unavailable_upsert_once() -> None:
    sends = 0

    def send(request: Request) -> Any:
        nonlocal sends
        sends += 1
        raise_failure(grpc_failure("UNAVAILABLE"))

    with pytest.raises(RequestCanceledException) as info:
        RetryOrchestrator().execute_sync(Request(name="upsert", timeout=0.05), send)
    _assert_refused_once(info, sends)
