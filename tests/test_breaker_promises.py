"""The breaker's promises (issue 21): it sees what the door sees, only the probe decides
while HALF_OPEN, its arithmetic is exact and survives a clock stepping back, and an
application can fail fast while it is OPEN.

The hanging endpoint's requests have 20 ms timeouts on the real clock (the doors' deadline
scopes run on the event loop's clock); nothing asserts a duration. The HALF_OPEN and
arithmetic tests run on a fake clock.
"""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
from typing import Any, NoReturn

import anyio
import pytest
import trio

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore._breaker import default_is_failure
from sdkcore._strategy import FailFastRetryStrategy

TIMEOUT = 0.02
REQUESTS = 12
VOLUME = 5


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Hanging:
    """An endpoint that accepts the write and never answers, behind ``breaker.guard()``."""

    def __init__(self, *, pass_request: bool = False) -> None:
        self.breaker = CircuitBreaker(name="hang:11210", volume_threshold=VOLUME)
        self.pass_request = pass_request
        self.sent = 0

    async def send(self, request: Request) -> NoReturn:
        breaker = self.breaker
        with breaker.guard(request) if self.pass_request else breaker.guard():
            self.sent += 1
            await anyio.sleep_forever()
        raise AssertionError("unreachable")


def opened_by_the_cuts(endpoint: Hanging) -> None:
    assert endpoint.breaker.state is CircuitState.OPEN
    assert endpoint.sent == VOLUME  # then refused: nothing sent
    assert endpoint.breaker.counts == (VOLUME, VOLUME)


# -- 1. A breaker sees what the door sees ----------------------------------------------


@pytest.mark.anyio
async def test_hanging_endpoint_opens_the_breaker_under_execute() -> None:
    endpoint = Hanging()
    orchestrator = RetryOrchestrator()
    for _ in range(REQUESTS):
        request = Request(name="kv.get", idempotent=True, timeout=TIMEOUT)
        with pytest.raises(UnambiguousTimeoutException):
            await orchestrator.execute(request, endpoint.send)
    opened_by_the_cuts(endpoint)


async def hand_wired(orchestrator: RetryOrchestrator, request: Request, endpoint: Hanging) -> Any:
    """README "…or wire maybe_retry into your own loop", the breaker inside the attempt."""
    while True:
        try:
            with orchestrator.attempt(request):  # cut at the deadline: raises the timeout
                return await endpoint.send(request)
        except RetryableError as failure:  # refused by the breaker: nothing was sent
            await orchestrator.maybe_retry(request, failure.reason, cause=failure)


@pytest.mark.anyio
async def test_hanging_endpoint_opens_the_breaker_under_a_hand_wired_loop() -> None:
    endpoint = Hanging()
    orchestrator = RetryOrchestrator()
    for _ in range(REQUESTS):
        request = Request(name="kv.get", idempotent=True, timeout=TIMEOUT)
        with pytest.raises(UnambiguousTimeoutException):
            await hand_wired(orchestrator, request, endpoint)
    opened_by_the_cuts(endpoint)


async def own_bound(orchestrator: RetryOrchestrator, request: Request, endpoint: Hanging) -> Any:
    """A loop that bounds the dispatch itself (no attempt()): the guard needs the request."""
    while True:
        left = request.time_left
        try:
            with anyio.fail_after(None if left is None else left.total_seconds()):
                return await endpoint.send(request)
        except RetryableError as failure:
            await orchestrator.maybe_retry(request, failure.reason, cause=failure)
        except TimeoutError as exc:
            raise orchestrator.fail(request, UnambiguousTimeoutException("cut")) from exc


@pytest.mark.anyio
async def test_guard_request_lets_a_loop_with_its_own_bound_open_the_breaker() -> None:
    endpoint = Hanging(pass_request=True)
    orchestrator = RetryOrchestrator()
    for _ in range(REQUESTS):
        request = Request(name="kv.get", idempotent=True, timeout=TIMEOUT)
        with pytest.raises(UnambiguousTimeoutException):
            await own_bound(orchestrator, request, endpoint)
    opened_by_the_cuts(endpoint)


@pytest.mark.anyio
async def test_a_cancellation_with_no_request_known_is_no_outcome() -> None:
    endpoint = Hanging()  # guard() outside any door: it cannot tell a cut from a cancel
    orchestrator = RetryOrchestrator()
    for _ in range(VOLUME + 1):
        request = Request(name="kv.get", idempotent=True, timeout=TIMEOUT)
        with pytest.raises(UnambiguousTimeoutException):
            await own_bound(orchestrator, request, endpoint)
    assert endpoint.breaker.counts == (0, 0)
    assert endpoint.breaker.state is CircuitState.CLOSED


@pytest.mark.anyio
async def test_the_caller_cancelling_leaves_the_counts_unchanged() -> None:
    endpoint = Hanging()
    orchestrator = RetryOrchestrator()
    for _ in range(REQUESTS):
        request = Request(name="kv.get", idempotent=True, timeout=30.0)
        with anyio.move_on_after(TIMEOUT) as scope:  # the caller gives up, not the deadline
            await orchestrator.execute(request, endpoint.send)
        assert scope.cancelled_caught
    assert endpoint.sent == REQUESTS
    assert endpoint.breaker.counts == (0, 0)
    assert endpoint.breaker.state is CircuitState.CLOSED


@pytest.mark.anyio
async def test_request_cancel_leaves_the_counts_unchanged() -> None:
    endpoint = Hanging()
    orchestrator = RetryOrchestrator()
    for _ in range(VOLUME + 1):
        request = Request(name="kv.get", idempotent=True, timeout=30.0)

        async def cancel_soon(request: Request = request) -> None:
            await anyio.sleep(TIMEOUT)
            request.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_soon)
            with pytest.raises(RequestCanceledException):
                await orchestrator.execute(request, endpoint.send)
    assert endpoint.breaker.counts == (0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize("mapped", [False, True], ids=["raw", "mapped"])
async def test_a_refusing_endpoint_counts_failures(mapped: bool) -> None:
    breaker = CircuitBreaker(name="refused:11210", volume_threshold=VOLUME)
    orchestrator = RetryOrchestrator(FailFastRetryStrategy())

    async def send(request: Request) -> bytes:
        with breaker.guard():
            try:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
            except ConnectionRefusedError as exc:
                if mapped:  # what a driver's mapping raises: counted by its cause
                    raise RetryableError(RetryReason.SOCKET_NOT_AVAILABLE) from exc
                raise

    for _ in range(REQUESTS):
        with pytest.raises((ConnectionRefusedError, RequestCanceledException)):
            await orchestrator.execute(Request(idempotent=True, timeout=TIMEOUT), send)
    assert breaker.state is CircuitState.OPEN
    assert breaker.counts == (VOLUME, VOLUME)


def test_a_refusing_endpoint_counts_failures_on_the_sync_door() -> None:
    breaker = CircuitBreaker(name="refused:11210", volume_threshold=VOLUME)

    def send(request: Request) -> bytes:
        with breaker.guard():
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    for _ in range(VOLUME):
        with pytest.raises(ConnectionResetError):
            RetryOrchestrator().execute_sync(Request(idempotent=True), send)
    assert breaker.state is CircuitState.OPEN


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError(),
        asyncio.TimeoutError(),
        ConnectionRefusedError(),
        ConnectionResetError(),
        ConnectionAbortedError(),
        BrokenPipeError(),
        EOFError(),
        asyncio.IncompleteReadError(b"", 24),
        OSError(errno.EHOSTUNREACH, "No route to host"),
        OSError(errno.ENETUNREACH, "Network is unreachable"),
        anyio.BrokenResourceError(),
        anyio.ClosedResourceError(),
        anyio.EndOfStream(),
        trio.BrokenResourceError(),
        trio.ClosedResourceError(),
    ],
    ids=lambda error: type(error).__name__,
)
def test_the_default_rule_counts_timeouts_and_unreachable_endpoints(error: Exception) -> None:
    assert default_is_failure(error)
    mapped = RetryableError(RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    mapped.__cause__ = error
    assert default_is_failure(mapped)  # raise RetryableError(...) from error


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad frame"),
        OSError(errno.EACCES, "Permission denied"),
        RetryableError(RetryReason.KV_LOCKED),
        KeyError("k1"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_the_default_rule_takes_an_answer_for_a_live_server(error: Exception) -> None:
    assert not default_is_failure(error)
    wrapped = RetryableError(RetryReason.KV_LOCKED)
    wrapped.__cause__ = error
    assert not default_is_failure(wrapped)


def test_the_default_rule_imports_no_event_loop() -> None:
    code = (
        "import sys\n"
        "from sdkcore._breaker import default_is_failure\n"
        "assert not default_is_failure(ValueError())\n"
        "assert default_is_failure(ConnectionRefusedError())\n"
        "loaded = [m for m in ('asyncio', 'anyio', 'trio') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_guard_takes_a_request_or_none() -> None:
    breaker = CircuitBreaker()
    assert breaker.guard() is breaker.guard()  # shared: no allocation per dispatch
    with pytest.raises(TypeError, match=r"guard\(request\) must be a sdkcore.Request or None"):
        breaker.guard("kv.get")  # type: ignore[arg-type]


# -- 2. While HALF_OPEN, only the probe decides ------------------------------------------


class Dispatch:
    """One guarded dispatch in its own task: entered, then held until told how to end."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        self.breaker = breaker
        self.entered = anyio.Event()
        self.release = anyio.Event()
        self.done = anyio.Event()
        self.admitted: CircuitState | None = None
        self.outcome = "success"

    async def run(self) -> None:
        try:
            with self.breaker.guard() as admitted:
                self.admitted = admitted
                self.entered.set()
                await self.release.wait()
                if self.outcome == "timeout":
                    raise TimeoutError("no answer")
        except TimeoutError:
            pass
        finally:
            self.done.set()

    async def end(self, outcome: str) -> None:
        self.outcome = outcome
        self.release.set()
        await self.done.wait()


async def started(tg: Any, breaker: CircuitBreaker) -> Dispatch:
    dispatch = Dispatch(breaker)
    tg.start_soon(dispatch.run)
    await dispatch.entered.wait()
    return dispatch


def half_open_breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(
        name="node1:11210",
        volume_threshold=4,
        sleep_window=5.0,
        canary_timeout=2.0,
        clock=clock,
    )


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(4):
        breaker.record_failure(TimeoutError("no answer"))
    assert breaker.state is CircuitState.OPEN


@pytest.mark.anyio
@pytest.mark.parametrize("late", ["success", "timeout"])
@pytest.mark.parametrize("probe", ["success", "timeout"])
async def test_a_dispatch_let_through_before_the_trip_does_not_decide(
    late: str, probe: str
) -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    async with anyio.create_task_group() as tg:
        old = await started(tg, breaker)
        assert old.admitted is CircuitState.CLOSED
        trip(breaker)
        clock.now += 5.0
        prober = await started(tg, breaker)
        assert prober.admitted is CircuitState.HALF_OPEN
        await old.end(late)  # in flight since before the trip
        assert breaker.state is CircuitState.HALF_OPEN
        await prober.end(probe)
    expected = CircuitState.CLOSED if probe == "success" else CircuitState.OPEN
    assert breaker.state is expected
    if probe == "timeout":  # the new sleep window starts at the probe's failure
        assert breaker.probe_after() == 5.0


@pytest.mark.anyio
@pytest.mark.parametrize("probe", ["success", "timeout"])
async def test_an_expired_probe_does_not_decide_the_next_one(probe: str) -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    trip(breaker)
    async with anyio.create_task_group() as tg:
        clock.now += 5.0
        first = await started(tg, breaker)
        assert first.admitted is CircuitState.HALF_OPEN
        clock.now += 2.0  # canary_timeout ran out: OPEN again
        assert breaker.state is CircuitState.OPEN
        clock.now += 5.0
        second = await started(tg, breaker)
        assert second.admitted is CircuitState.HALF_OPEN
        await first.end("success")  # late: it decides nothing now
        assert breaker.state is CircuitState.HALF_OPEN  # type: ignore[comparison-overlap]  # stale narrowing
        await second.end(probe)
    expected = CircuitState.CLOSED if probe == "success" else CircuitState.OPEN
    assert breaker.state is expected


@pytest.mark.anyio
async def test_direct_reports_from_another_task_do_not_decide() -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    trip(breaker)
    clock.now += 5.0
    async with anyio.create_task_group() as tg:
        prober = await started(tg, breaker)
        breaker.record_success()  # this task holds no probe
        breaker.record_failure(TimeoutError())
        assert breaker.state is CircuitState.HALF_OPEN
        await prober.end("success")
    assert breaker.state is CircuitState.CLOSED


def test_the_probe_granted_to_this_thread_decides_by_direct_calls() -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    trip(breaker)
    clock.now += 5.0
    assert breaker.admit() is CircuitState.HALF_OPEN  # as the memcached example's canary
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED


# -- 3. Arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize("percentage", [16.1, 0.1, 33.3, 57.7, 99.9, 50, 12.5])
def test_the_percentage_is_exact(percentage: float) -> None:
    failures = round(percentage * 10)  # of 1,000 outcomes: exactly the percentage
    for fail, state in ((failures - 1, CircuitState.CLOSED), (failures, CircuitState.OPEN)):
        breaker = CircuitBreaker(volume_threshold=1000, error_threshold_percentage=percentage)
        for _ in range(1000 - fail):
            breaker.record_success()
        for _ in range(fail):
            breaker.record_failure(TimeoutError())
        assert breaker.counts == (1000, fail)
        assert breaker.state is state, (percentage, fail)


def test_a_clock_stepping_back_never_stretches_the_sleep_window() -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    trip(breaker)
    clock.now -= 3600.0
    assert breaker.probe_after() == 5.0  # a full window from the clock's new reading
    assert not breaker.try_acquire()
    clock.now += 5.0
    assert breaker.try_acquire()
    assert breaker.state is CircuitState.HALF_OPEN


def test_a_clock_stepping_back_never_stretches_the_canary_timeout() -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    trip(breaker)
    clock.now += 5.0
    assert breaker.try_acquire()
    clock.now -= 3600.0
    assert breaker.state is CircuitState.HALF_OPEN
    clock.now += 2.0  # canary_timeout from the new reading
    assert breaker.state is CircuitState.OPEN  # type: ignore[comparison-overlap]  # stale narrowing
    assert breaker.probe_after() == 5.0


def test_a_clock_stepping_back_never_stretches_the_counting_window() -> None:
    clock = Clock()
    breaker = half_open_breaker(clock)
    breaker.record_failure(TimeoutError())
    clock.now -= 3600.0
    breaker.record_failure(TimeoutError())  # the window goes on, its counts stay
    assert breaker.counts == (2, 2)
    clock.now += 60.0  # rolling_window from the new reading: over
    breaker.record_success()
    assert breaker.counts == (1, 0)


# -- 4. Failing fast while the breaker is OPEN (the README's recipe) ---------------------


class FailFastWhileOpen(BestEffortRetryStrategy):
    """BestEffort, except that a dispatch refused by an OPEN breaker is not retried."""

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        if reason is RetryReason.CIRCUIT_BREAKER_OPEN:
            return RetryAction.no_retry()  # RequestCanceledException (NO_MORE_RETRIES)
        return super().decide(request, reason)


@pytest.mark.anyio
async def test_the_readme_recipe_fails_fast_while_open() -> None:
    breaker = CircuitBreaker(name="10.0.0.1:11210", volume_threshold=1)
    breaker.record_failure(TimeoutError("no answer"))  # OPEN for the next 5 s
    orchestrator = RetryOrchestrator(FailFastWhileOpen())

    async def send(request: Request) -> bytes:
        with breaker.guard():
            return b"value"

    request = Request(idempotent=True, timeout=2.5)
    with anyio.fail_after(1.0):  # at once, not after the sleep window or the timeout
        with pytest.raises(RequestCanceledException) as caught:
            await orchestrator.execute(request, send)
    context = caught.value.context
    assert context is not None
    assert context.reason is RetryReason.CIRCUIT_BREAKER_OPEN
    assert context.cancellation_reason is not None
    assert context.cancellation_reason.name == "NO_MORE_RETRIES"
    assert request.retry_attempts == 0
    assert isinstance(caught.value.__cause__, RetryableError)


def test_the_readme_recipe_keeps_best_effort_for_other_reasons() -> None:
    request = Request(idempotent=True)
    strategy = FailFastWhileOpen()
    assert strategy.decide(request, RetryReason.KV_LOCKED).retries
    assert not strategy.decide(request, RetryReason.CIRCUIT_BREAKER_OPEN).retries
