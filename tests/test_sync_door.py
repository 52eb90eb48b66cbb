"""The sync door: ``RetryOrchestrator.execute_sync`` for threaded callers."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    DocumentNotFoundException,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.testing import VirtualClock, capture_retry_events


class Scripted:
    """A blocking send failing ``fails`` times with ``reason``, then returning ``value``."""

    def __init__(self, fails: int, reason: RetryReason = RetryReason.KV_LOCKED) -> None:
        self.fails = fails
        self.reason = reason
        self.calls = 0

    def __call__(self, request: Request) -> str:
        self.calls += 1
        if self.calls <= self.fails:
            raise RetryableError(self.reason) from OSError(f"attempt {self.calls}")
        return f"value after {self.calls}"


def test_returns_the_value_after_retries_with_real_sleeps() -> None:
    slept: list[float] = []
    send = Scripted(3)
    req = Request(name="get", idempotent=True, timeout=5)
    orch = RetryOrchestrator()
    assert orch.execute_sync(req, send, sleep=slept.append) == "value after 4"
    assert slept == [0.001, 0.002, 0.004]  # the default best-effort backoff
    assert req.retry_attempts == 3
    assert req.state.value == "succeeded"
    assert orch.requests_in_retry == 0


def test_same_exceptions_and_context_as_execute() -> None:
    vc = VirtualClock()
    req = Request(name="kv.upsert", idempotent=False, timeout=0.3, clock=vc.clock)

    def send(request: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED) from OSError("locked")

    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.1))
    with pytest.raises(UnambiguousTimeoutException) as info:
        orch.execute_sync(req, send, sleep=vc.advance)
    assert isinstance(info.value.__cause__, OSError)
    ctx = info.value.context
    assert ctx is not None
    assert ctx.last_error == "OSError: locked"
    assert len(ctx.attempts) == 3


def test_fast_fail_and_refusals() -> None:
    req = Request(name="get", idempotent=True)

    def send(request: Request) -> str:
        raise RetryableError(RetryReason.AUTHENTICATION_ERROR)

    with pytest.raises(AuthenticationFailureException):
        RetryOrchestrator().execute_sync(req, send)

    upsert = Request(name="upsert", idempotent=False)
    with pytest.raises(RequestCanceledException, match="not idempotent"):
        RetryOrchestrator().execute_sync(
            upsert, Scripted(1, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
        )


def test_non_retryable_error_propagates_with_context() -> None:
    def send(request: Request) -> str:
        raise DocumentNotFoundException("gone")

    req = Request(name="get", idempotent=True)
    with pytest.raises(DocumentNotFoundException):
        RetryOrchestrator().execute_sync(req, send)
    assert req.state.value == "failed"
    assert req.last_error is not None


def test_an_attempt_failing_after_the_deadline_is_the_timeout() -> None:
    """A thread cannot be cancelled: ``send`` bounds itself by ``request.time_left``
    (e.g. a socket timeout); what it raises past the deadline becomes the timeout."""
    seen: list[float] = []

    def send(request: Request) -> str:
        left = request.time_left
        assert left is not None
        seen.append(left.total_seconds())
        time.sleep(left.total_seconds())  # the socket timeout expires
        raise TimeoutError("timed out")

    req = Request(name="upsert", idempotent=False, timeout=0.05)
    with pytest.raises(AmbiguousTimeoutException) as info:
        RetryOrchestrator().execute_sync(req, send)
    assert 0 < seen[0] <= 0.05
    assert isinstance(info.value.__cause__, TimeoutError)
    assert info.value.context is not None
    assert info.value.context.in_flight is True


def test_async_strategy_is_refused_clearly() -> None:
    class AsyncOne:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(0)

    req = Request(idempotent=True, retry_strategy=AsyncOne())
    with pytest.raises(TypeError, match="execute_sync needs a synchronous RetryStrategy"):
        RetryOrchestrator().execute_sync(req, Scripted(1))
    assert req.state is RequestState.FAILED


def test_async_strategy_on_a_write_that_may_have_been_applied_says_so() -> None:
    """The refusal names the request and what it did to it, and logs as a strategy's
    failure does: it comes at the first retryable failure, in an incident."""

    class AsyncOne:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(0)

    req = Request(name="kv.upsert", idempotent=False, retry_strategy=AsyncOne())
    send = Scripted(1, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    with capture_retry_events() as events, pytest.raises(TypeError) as info:
        RetryOrchestrator().execute_sync(req, send)
    text = str(info.value)
    assert f"request {req.id} ('kv.upsert') after SOCKET_CLOSED_WHILE_IN_FLIGHT" in text
    assert "not idempotent, and an attempt may have been applied" in text
    assert req.state is RequestState.FAILED
    assert req.maybe_applied
    [event] = events
    assert event["event"] == "retry.strategy_failed"
    assert event["log_level"] == "warning"
    assert event["request_id"] == req.id
    assert event["maybe_applied"] is True
    assert "execute_sync needs a synchronous RetryStrategy" in event["error"]


def test_sync_user_strategy_is_used() -> None:
    class Twice:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            if request.retry_attempts < 2:
                return RetryAction.with_duration(0)
            return RetryAction.no_retry()

    req = Request(idempotent=True, retry_strategy=Twice())
    send = Scripted(5)
    with pytest.raises(RequestCanceledException):
        RetryOrchestrator().execute_sync(req, send)
    assert send.calls == 3


def test_async_send_is_refused_clearly() -> None:
    async def send(request: Request) -> str:
        return "never"

    req = Request()
    with pytest.raises(TypeError, match="returned an awaitable"):
        RetryOrchestrator().execute_sync(req, send)  # type: ignore[unused-coroutine]


def test_same_log_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="sdkcore")
    RetryOrchestrator().execute_sync(Request(name="kv.get", idempotent=True), Scripted(1))
    (record,) = [r for r in caplog.records if r.name == "sdkcore"]
    fields = record.sdkcore  # type: ignore[attr-defined]
    assert record.getMessage().startswith("retry.scheduled ")
    assert fields["reason"] == "KV_LOCKED"
    assert fields["attempt"] == 1
    assert fields["caused_by"] == "OSError: attempt 1"


THREADS = 50
PER_THREAD = 200


def test_many_threads_counters_exact() -> None:
    """50 threads x 200 requests on one orchestrator: every count adds up exactly."""
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
    results: list[int] = [0] * THREADS
    retries: list[int] = [0] * THREADS
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(i: int) -> None:
        try:
            start.wait()
            for n in range(PER_THREAD):
                req = Request(name="get", idempotent=True, timeout=30)
                fails = (i + n) % 4  # 0..3 retries per request
                orch.execute_sync(req, Scripted(fails), sleep=lambda s: time.sleep(0))
                results[i] += 1
                retries[i] += req.retry_attempts
                assert req.retry_attempts == fails
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert sum(results) == THREADS * PER_THREAD
    expected = sum((i + n) % 4 for i in range(THREADS) for n in range(PER_THREAD))
    assert sum(retries) == expected
    assert orch.requests_in_retry == 0


def test_backpressure_across_threads_is_exact() -> None:
    """With room for 3 waiting requests, exactly 3 of 8 threads wait; the rest are refused."""
    orch = RetryOrchestrator(BestEffortRetryStrategy(), max_requests_in_retry=3)
    inside = threading.Semaphore(0)
    release = threading.Event()
    outcomes: list[str] = []
    lock = threading.Lock()
    five_refused = threading.Event()

    def sleep(_: float) -> None:
        inside.release()
        release.wait(10)

    def worker() -> None:
        try:
            orch.execute_sync(Request(idempotent=True, timeout=30), Scripted(1), sleep=sleep)
            outcome = "ok"
        except RequestCanceledException as exc:
            why = exc.context.cancellation_reason if exc.context is not None else None
            outcome = why.name if why is not None else "?"
        with lock:
            outcomes.append(outcome)
            if outcomes.count("TOO_MANY_REQUESTS_IN_RETRY") == 5:
                five_refused.set()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in range(3):
        assert inside.acquire(timeout=10)
    assert five_refused.wait(10)  # the 5 others are refused at once
    assert orch.requests_in_retry == 3
    release.set()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["TOO_MANY_REQUESTS_IN_RETRY"] * 5 + ["ok"] * 3
    assert orch.requests_in_retry == 0


def test_a_backoff_longer_than_threading_can_wait_is_still_a_wait() -> None:
    """A strategy's delay of 1e10 s (RetryAction accepts it) made Event.wait raise
    OverflowError; it is a wait that Request.cancel() ends, as on the async doors."""

    class Forever(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(1e10)

    def send(request: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED)

    request = Request(idempotent=True, timeout=None, retry_strategy=Forever())
    cancel = threading.Timer(0.1, request.cancel)
    cancel.start()
    try:
        with pytest.raises(RequestCanceledException):
            RetryOrchestrator().execute_sync(request, send)
    finally:
        cancel.cancel()
    assert request.retry_attempts == 1
