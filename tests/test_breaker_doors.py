"""``with breaker.guard():`` in each door, on a virtual clock.

A refused dispatch fails its attempt with CIRCUIT_BREAKER_OPEN and a retry-after
hint (the time until the probe may go): nothing was sent, so BestEffort retries it
even for a non-idempotent request, waiting for the probe and never past the
deadline, and the request succeeds once the probe closes the breaker; FailFast
gives up at once.
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

    def answer(self) -> bytes:
        with self.breaker.guard():  # the one line: refused -> RetryableError, else reported
            self.sent += 1
            return b"stored"


@pytest.mark.anyio
async def test_execute_retries_a_non_idempotent_request_until_the_probe_closes_it() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> bytes:
        return endpoint.answer()

    request = Request(name="kv.set", idempotent=False, timeout=2.5, clock=clock.clock)
    assert await orchestrator.execute(request, send) == b"stored"
    assert endpoint.sent == 1  # refused attempts sent nothing
    assert set(request.retry_reasons) == {RetryReason.CIRCUIT_BREAKER_OPEN}
    assert request.retry_attempts == 1  # one wait: the hint, not a backoff ladder
    assert clock.now - 1000.0 == pytest.approx(SLEEP_WINDOW)  # waited for the probe
    assert endpoint.breaker.state is CircuitState.CLOSED


@pytest.mark.anyio
async def test_execute_never_waits_past_the_deadline() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> bytes:
        return endpoint.answer()

    request = Request(name="kv.get", idempotent=True, timeout=0.2, clock=clock.clock)
    with pytest.raises(UnambiguousTimeoutException, match=r"may go only in 0\.500 s") as caught:
        await orchestrator.execute(request, send)
    assert endpoint.sent == 0
    assert caught.value.context is not None
    assert caught.value.context.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    assert clock.now == 1000.0  # the probe is due past the deadline: no silent sleep


@pytest.mark.anyio
async def test_fail_fast_gives_up_at_once() -> None:
    clock = VirtualClock()
    endpoint = Endpoint(open_breaker(clock))
    orchestrator = RetryOrchestrator(FailFastRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> bytes:
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
        try:
            with orchestrator.attempt(request):
                reply = endpoint.answer()
        except RetryableError as failure:  # the hint travels with the failure
            await orchestrator.maybe_retry(request, failure.reason, cause=failure)
            continue
        orchestrator.succeed(request)
        break
    assert reply == b"stored"
    assert endpoint.sent == 1
    assert clock.now - 1000.0 == pytest.approx(SLEEP_WINDOW)


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


def test_a_dispatch_refused_while_the_probe_is_out_carries_no_hint() -> None:
    clock = VirtualClock()
    breaker = open_breaker(clock)
    clock.advance(SLEEP_WINDOW)
    assert breaker.admit() is CircuitState.HALF_OPEN  # the probe is out
    with pytest.raises(RetryableError) as refused, breaker.guard():
        pass
    assert refused.value.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    assert refused.value.retry_after is None  # the backoff polls; the probe answers soon
    assert "HALF_OPEN" in str(refused.value)


def test_a_refusal_names_the_failure_that_opened_the_breaker() -> None:
    """The refusal reaches an operator as a timeout's cause ("the next attempt may go only
    in 4.997 s (... is OPEN: nothing was sent)"): it says what the endpoint failed with."""
    clock = VirtualClock()
    breaker = CircuitBreaker(name="node1:11210", volume_threshold=1, clock=clock.clock)
    breaker.record_failure(ConnectionRefusedError("connect to node1:11210 refused"))
    with pytest.raises(RetryableError) as refused, breaker.guard():
        pass
    assert str(refused.value) == (
        "CIRCUIT_BREAKER_OPEN: circuit breaker node1:11210 is OPEN (last failure: "
        "ConnectionRefusedError: connect to node1:11210 refused): nothing was sent"
    )


def test_the_guard_reports_outcomes_and_gives_the_admitted_state() -> None:
    clock = VirtualClock()
    breaker = CircuitBreaker(volume_threshold=2, clock=clock.clock)
    with breaker.guard() as state:
        assert state is CircuitState.CLOSED
    assert breaker.counts == (1, 0)
    with pytest.raises(TimeoutError), breaker.guard():
        raise TimeoutError("no answer")
    assert breaker.state is CircuitState.OPEN  # 1 failure in 2 outcomes: 50 %
    with pytest.raises(RetryableError) as refused, breaker.guard():
        pass
    assert refused.value.retry_after == pytest.approx(5.0)  # the default sleep window
