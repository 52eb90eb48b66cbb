"""A log handler, filter or structlog processor of the application's that raises as
sdkcore logs an event. sdkcore changes its state around its events (a retry counted and
paid for, a breaker's probe granted, a hedge copy booked, a call taken off the channel's
live set): an event that raised halfway left requests pending for ever, a hedge's
deadline armed, probes, permits and budget tokens held. An ``Exception`` from logging
is not sdkcore's to raise: the event is dropped, said once per event name as a
``RuntimeWarning``, and every request goes on as with working logging (rfc/0001, "Logging
that raises"). An interrupt (``KeyboardInterrupt``) raised in a handler still reaches the
caller, and what the interrupted step had taken is given back."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import anyio
import pytest
import structlog

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    ConcurrencyLimiter,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RequestState,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    _log,
)

pytestmark = pytest.mark.anyio
TEMP = RetryReason.KV_TEMPORARY_FAILURE


def _raising(event: str | None, error: BaseException) -> Iterator[None]:
    """structlog configured with a processor that raises ``error`` on ``event`` (None:
    on every event), after sdkcore's once-per-event warnings were reset."""

    def processor(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        if event is None or event_dict.get("event") == event:
            raise error
        raise structlog.DropEvent

    _log._DROPPED.clear()
    structlog.configure(processors=[processor], cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.reset_defaults()
        _log._DROPPED.clear()


@pytest.fixture
def raising_on(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from _raising(*request.param)


@pytest.fixture
def every_event_raises() -> Iterator[None]:
    yield from _raising(None, RuntimeError("the handler broke"))


def budget(**kwargs: Any) -> RetryBudget:
    kwargs.setdefault("min_retries_per_sec", 1)  # a reserve of 10
    return RetryBudget(ttl=10, retry_ratio=0.0, **kwargs)


def fails_then(answer: str, failures: int = 1) -> Callable[[Request], str]:
    sent = [0]

    def send(request: Request) -> str:
        sent[0] += 1
        if sent[0] <= failures:
            raise RetryableError(TEMP)
        return answer

    return send


# -- an Exception from logging: dropped, said once, every request goes on ------------------


@pytest.mark.parametrize("door", ["execute", "execute_sync", "maybe_retry"])
async def test_a_retry_whose_event_raised_goes_on(every_event_raises: None, door: str) -> None:
    shared = budget()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0), retry_budget=shared)
    request = Request(idempotent=True, timeout=5.0)
    send = fails_then("ok")

    async def send_async(r: Request) -> str:
        return send(r)

    async def by_hand() -> str:
        while True:
            try:
                with orch.attempt(request):
                    result = send(request)
            except RetryableError as failure:
                await orch.maybe_retry(request, failure.reason, cause=failure)
                continue
            orch.succeed(request)
            return result

    async def run() -> str:
        if door == "execute":
            return await orch.execute(request, send_async)
        if door == "execute_sync":
            return orch.execute_sync(request, send)
        return await by_hand()

    with pytest.warns(RuntimeWarning, match="dropped its log event 'retry.scheduled'"):
        assert await run() == "ok"
    assert request.state is RequestState.SUCCEEDED
    assert request.retry_attempts == 1
    assert orch.requests_in_retry == 0
    assert shared.balance == 9  # the retry that was sent paid for itself, once


async def test_every_event_raising_changes_no_outcome(every_event_raises: None) -> None:
    """Timeouts, refusals, hedges, a breaker's whole cycle, a limiter's refusal and a
    budget's exhaustion, every event of each raising: the outcomes of working logging."""
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.01))

    async def always_fails(r: Request) -> str:
        raise RetryableError(TEMP)

    async def scenarios() -> None:
        # a timeout after retries
        late = Request(idempotent=True, timeout=0.05)
        with pytest.raises(TimeoutException):
            await orch.execute(late, always_fails)
        assert late.state is RequestState.CANCELLED
        assert orch.requests_in_retry == 0

        # a hedge whose first copy loses (cut), and one whose first copy fails
        async def copies(r: Request, index: int) -> int:
            if index == 0:
                await anyio.sleep(1.0)
            return index

        async def first_fails(r: Request, index: int) -> int:
            if index == 0:
                raise RetryableError(TEMP)
            return index

        with anyio.fail_after(5):  # a hedge that waits for ever fails here, not the run
            policy = HedgePolicy(3, delay=timedelta(milliseconds=5))
            assert await orch.hedge(Request(idempotent=True, timeout=2.0), copies, policy) == 1
            assert await orch.hedge(Request(idempotent=True, timeout=2.0), first_fails, policy) == 1

        # a breaker: opened, refusing, its probe, closed
        breaker = CircuitBreaker(volume_threshold=1, sleep_window=0.02, name="node1")
        breaker.record_failure(TimeoutError("down"))
        assert breaker.state is CircuitState.OPEN
        with pytest.raises(RetryableError), breaker.guard():
            pass
        await anyio.sleep(0.03)
        with breaker.guard() as state:
            assert state is CircuitState.HALF_OPEN
        assert breaker.state is CircuitState.CLOSED  # type: ignore[comparison-overlap]  # stale narrowing

        # a limiter's refusal, retried
        limiter = ConcurrencyLimiter(1, name="pool")
        with limiter.guard(), pytest.raises(RetryableError) as refused, limiter.guard():
            pass
        assert refused.value.reason is RetryReason.CONCURRENCY_LIMITED
        assert limiter.in_flight == 0

        # an empty budget
        empty = RetryOrchestrator(retry_budget=budget(min_retries_per_sec=0, name="b"))
        with pytest.raises(RequestCanceledException):
            await empty.execute(Request(idempotent=True, timeout=1.0), always_fails)
        assert empty.requests_in_retry == 0

    with pytest.warns(RuntimeWarning):  # (once per event name)
        await scenarios()


# -- an interrupt from logging: it reaches the caller, what was taken is given back ---------


@pytest.mark.parametrize("raising_on", [("retry.scheduled", KeyboardInterrupt())], indirect=True)
def test_an_interrupted_retry_ends_the_request_and_refunds_its_token(raising_on: None) -> None:
    shared = budget()
    before = shared.balance
    orch = RetryOrchestrator(BestEffortRetryStrategy(), retry_budget=shared)
    request = Request(idempotent=True, timeout=5.0)
    sent = []

    def send(r: Request) -> str:
        sent.append(1)
        raise RetryableError(TEMP)  # reached the server: its retry pays

    with pytest.raises(KeyboardInterrupt):
        orch.execute_sync(request, send)
    assert sent == [1]
    assert request.state is RequestState.CANCELLED
    assert shared.balance == before  # the withdrawal for the retry that never went out
    assert orch.requests_in_retry == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("raising_on", [("breaker.half_open", KeyboardInterrupt())], indirect=True)
def test_a_breaker_whose_probe_grant_was_interrupted_lets_the_next_dispatch_probe(
    raising_on: None,
) -> None:
    """The probe was granted, then its event was interrupted: nothing was sent. Held, the
    probe cut the endpoint off until canary_timeout, then reopened the breaker for a probe
    that never went."""
    clock = Clock()
    breaker = CircuitBreaker(
        volume_threshold=1, sleep_window=5.0, canary_timeout=2.0, clock=clock, name="node1"
    )
    breaker.record_failure(TimeoutError("no answer"))
    assert breaker.state is CircuitState.OPEN
    clock.now += 6.0  # the sleep window is over: the next dispatch is the probe
    with pytest.raises(KeyboardInterrupt), breaker.guard():
        pass  # never runs: the grant's event was interrupted
    assert breaker.state is CircuitState.HALF_OPEN  # type: ignore[comparison-overlap]  # stale narrowing
    with breaker.guard() as state:  # not refused "a probe is out"
        assert state is CircuitState.HALF_OPEN
    assert breaker.state is CircuitState.CLOSED


@pytest.mark.parametrize("raising_on", [("budget.recovered", KeyboardInterrupt())], indirect=True)
def test_a_budget_whose_recovery_was_interrupted_keeps_the_retry_it_granted(
    raising_on: None,
) -> None:
    clock = Clock()
    shared = RetryBudget(ttl=10, min_retries_per_sec=0, retry_ratio=1.0, clock=clock)
    assert not shared.try_withdraw()  # empty: an exhaustion episode starts
    shared.deposit()
    clock.now += 2.0  # a quiet second after the refusal: the next grant ends the episode
    with pytest.raises(KeyboardInterrupt):
        shared.try_withdraw()  # granted, then its budget.recovered event was interrupted
    assert shared.balance == 1  # the door sends no retry for it: given back


async def test_a_stdlib_filter_that_raises_is_dropped_as_a_processor_is() -> None:
    """An application on the standard library's logging alone: a filter on the ``sdkcore``
    logger that raises (filters are not guarded by logging, handlers are)."""
    import logging

    class Raises(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise RuntimeError("the filter broke")

    std = logging.getLogger("sdkcore")
    old_level = std.level
    raising = Raises()
    std.setLevel(logging.DEBUG)
    std.addFilter(raising)
    _log._DROPPED.clear()
    try:
        orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
        send = fails_then("ok")

        async def send_async(r: Request) -> str:
            return send(r)

        with pytest.warns(RuntimeWarning, match="the filter broke"):
            assert await orch.execute(Request(idempotent=True, timeout=5.0), send_async) == "ok"
    finally:
        std.removeFilter(raising)
        std.setLevel(old_level)
        _log._DROPPED.clear()


async def test_where_warnings_are_errors_each_drop_goes_to_the_unraisable_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ``-W error`` the warning raised from the event's call left a hedge's deadline
    armed (the caller's task cancelled later) as the error itself did: it goes to
    ``sys.unraisablehook`` (which fails a pytest test, prints otherwise), every time, and
    the request goes on."""
    import sys
    import warnings

    hooked: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: hooked.append(args.exc_value))

    def raising(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        raise AssertionError(f"unexpected event {event_dict['event']}")

    _log._DROPPED.clear()
    structlog.configure(processors=[raising], cache_logger_on_first_use=False)
    try:

        async def copies(r: Request, index: int) -> int:
            if index == 0:
                await anyio.sleep(1.0)
            return index

        orch = RetryOrchestrator()
        policy = HedgePolicy(2, delay=timedelta(milliseconds=5))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                assert await orch.hedge(Request(idempotent=True, timeout=0.2), copies, policy) == 1
        await anyio.sleep(0.3)  # past the hedges' deadlines: nothing armed cancels this task
    finally:
        structlog.reset_defaults()
        _log._DROPPED.clear()
    assert hooked
    assert all(isinstance(e, RuntimeWarning) for e in hooked)
    assert any("AssertionError: unexpected event hedge.sent" in str(e) for e in hooked)
    assert sum("hedge.sent" in str(e) for e in hooked) >= 2  # each time, not once


async def test_drop_event_from_a_wrapper_class_is_a_drop_not_an_interrupt() -> None:
    """``structlog.DropEvent`` is a ``BaseException``: a wrapper class that lets it out
    meant "drop this event", and the retry goes on."""

    class Plain:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def bind(self, **kw: Any) -> Plain:
            return self

        def debug(self, event: str, **kw: Any) -> None:
            raise structlog.DropEvent

        info = warning = debug

    structlog.configure(
        wrapper_class=lambda *a, **k: Plain(),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    try:
        orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
        send = fails_then("ok")

        async def send_async(r: Request) -> str:
            return send(r)

        assert await orch.execute(Request(idempotent=True, timeout=5.0), send_async) == "ok"
    finally:
        structlog.reset_defaults()


async def test_a_structlog_logger_that_cannot_be_made_drops_every_event() -> None:
    """The application's logger factory raises (a log file that is missing): sdkcore's
    events are dropped, and a retry that would answer still answers."""

    def factory(*args: Any) -> Any:
        raise OSError("log file missing")

    _log._DROPPED.clear()
    structlog.configure(logger_factory=factory, cache_logger_on_first_use=False)
    try:
        orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
        send = fails_then("ok")
        with pytest.warns(RuntimeWarning, match="OSError: log file missing"):
            assert orch.execute_sync(Request(idempotent=True, timeout=5.0), send) == "ok"
    finally:
        structlog.reset_defaults()
        _log._DROPPED.clear()
