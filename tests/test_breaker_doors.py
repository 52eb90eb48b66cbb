"""The breaker guard in each door of today's core, on a virtual clock.

A refused dispatch fails its attempt with CIRCUIT_BREAKER_OPEN: nothing was sent,
so BestEffort retries it even for a non-idempotent request, and the request
succeeds once the probe closes the breaker; FailFast gives up at once.
"""

from __future__ import annotations

import threading

import pytest

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore._strategy import FailFastRetryStrategy
from sdkcore.testing import VirtualClock

SLEEP_WINDOW = 0.5


def open_breaker(clock: VirtualClock) -> CircuitBreaker:
    breaker = CircuitBreaker(
        name="node:11210", volume_threshold=1, sleep_window=SLEEP_WINDOW, clock=clock.clock
    )
    breaker.record_failure(TimeoutError("node did not answer"))
    assert breaker.state is CircuitState.OPEN
    return breaker


class Endpoint:
    """A healthy endpoint behind a breaker: counts what was really sent."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        self.breaker = breaker
        self.sent = 0

    def guard(self) -> None:
        if not self.breaker.try_acquire():  # the one line
            raise RetryableError(RetryReason.CIRCUIT_BREAKER_OPEN, "nothing was sent")

    def answer(self) -> bytes:
        self.sent += 1
        self.breaker.record_success()
        return b"stored"


@pytest.mark.anyio
async def test_execute_retries_a_non_idempotent_request_until_the_probe_closes_it() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> bytes:
        endpoint.guard()
        return endpoint.answer()

    request = Request(name="kv.set", idempotent=False, timeout=2.5, clock=clock.clock)
    assert await orchestrator.execute(request, send) == b"stored"
    assert endpoint.sent == 1  # refused attempts sent nothing
    assert set(request.retry_reasons) == {RetryReason.CIRCUIT_BREAKER_OPEN}
    assert clock.now - 1000.0 >= SLEEP_WINDOW  # it waited for the sleep window
    assert endpoint.breaker.state is CircuitState.CLOSED


@pytest.mark.anyio
async def test_execute_never_waits_past_the_deadline() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> bytes:
        endpoint.guard()
        return endpoint.answer()

    request = Request(name="kv.get", idempotent=True, timeout=0.2, clock=clock.clock)
    with pytest.raises(UnambiguousTimeoutException) as caught:
        await orchestrator.execute(request, send)
    assert endpoint.sent == 0
    assert caught.value.context is not None
    assert RetryReason.CIRCUIT_BREAKER_OPEN in caught.value.context.retry_reasons
    assert clock.now - 1000.0 <= 0.2 + 1e-9


@pytest.mark.anyio
async def test_fail_fast_gives_up_at_once() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(FailFastRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> bytes:
        endpoint.guard()
        return endpoint.answer()

    request = Request(name="kv.get", idempotent=True, clock=clock.clock)
    with pytest.raises(RequestCanceledException) as caught:
        await orchestrator.execute(request, send)
    assert caught.value.context is not None
    assert caught.value.context.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    assert caught.value.context.cancellation_reason is not None
    assert caught.value.context.cancellation_reason.name == "NO_MORE_RETRIES"


@pytest.mark.anyio
async def test_hand_wired_loop() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.set", idempotent=False, timeout=2.5, clock=clock.clock)
    while True:
        if not endpoint.breaker.try_acquire():
            await orchestrator.maybe_retry(request, RetryReason.CIRCUIT_BREAKER_OPEN)
            continue
        with orchestrator.attempt(request):
            reply = endpoint.answer()
        orchestrator.succeed(request)
        break
    assert reply == b"stored"
    assert endpoint.sent == 1


def test_sync_door_from_threads() -> None:
    # one breaker shared by 8 threads: refused ones retry until the probe closes it
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    lock = threading.Lock()
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy())
    clock.advance(SLEEP_WINDOW)  # the probe may go
    barrier = threading.Barrier(8)
    results: list[bytes] = []

    def send(request: Request) -> bytes:
        endpoint.guard()
        with lock:
            return endpoint.answer()

    def work() -> None:
        barrier.wait()
        request = Request(name="kv.set", timeout=10.0)
        reply = orchestrator.execute_sync(request, send)
        with lock:
            results.append(reply)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [b"stored"] * 8
    assert endpoint.sent == 8
    assert endpoint.breaker.state is CircuitState.CLOSED
