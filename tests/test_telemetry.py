"""Telemetry metrics (issue 22 item 2, rfc/0008), on every door, asyncio and trio.

Every instrument's name, unit, kind and attribute set is checked against the issue's
table, through the OpenTelemetry SDK's ``InMemoryMetricReader``; each outcome
(success; failure: a non-retryable error, the strategy's, the budget's or the
breaker's refusal; timeout; cancelled: ``Request.cancel()`` and the caller's own
cancellation) on ``execute``, the hand-wired loop (``attempt()`` + ``maybe_retry`` +
``succeed``/``fail``), ``hedge`` and ``execute_sync`` (32 threads too). Virtual
clocks for backoffs; small real delays only where a deadline or a cancellation must
cut something in flight.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics.export import HistogramDataPoint
from telemetry_kit import Fatal, Otel, attr, hand_wired

from sdkcore import (
    BestEffortRetryStrategy,
    CircuitBreaker,
    CircuitState,
    CouchbaseException,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryBudget,
    RetryOrchestrator,
    RetryReason,
    Telemetry,
    UnambiguousTimeoutException,
)
from sdkcore._strategy import FailFastRetryStrategy
from sdkcore.testing import VirtualClock

LOCKED = RetryReason.KV_LOCKED
SAFETY = 10.0  # every async test fails instead of hanging after this long

NAME = "sdkcore.request.name"
OUTCOME = "sdkcore.request.outcome"
REASON = "sdkcore.retry.reason"
ENDPOINT = "sdkcore.endpoint"
STATE = "sdkcore.circuit_breaker.state"

# The table: name -> (unit, kind).
INSTRUMENTS = {
    "sdkcore.request.duration": ("s", "histogram"),
    "sdkcore.request.retries": ("{retry}", "histogram"),
    "sdkcore.retries": ("{retry}", "counter"),
    "sdkcore.retry.delay": ("s", "histogram"),
    "sdkcore.hedges": ("{hedge}", "counter"),
    # units the issue leaves open, as rfc/0008's table fixes them
    "sdkcore.hedge.wins": ("{request}", "counter"),
    "sdkcore.circuit_breaker.state": ("1", "gauge"),
    "sdkcore.circuit_breaker.transitions": ("{transition}", "counter"),
    "sdkcore.circuit_breaker.rejections": ("{dispatch}", "counter"),
    "sdkcore.retry_budget.balance": ("{retry}", "gauge"),
    "sdkcore.retry_budget.rejections": ("{retry}", "counter"),
}


@pytest.fixture
def otel() -> Iterator[Otel]:
    kit = Otel()
    yield kit
    kit.shutdown()


def check_instruments(got: dict[str, Any]) -> None:
    """Every reported metric is one of the issue's, with its unit and kind."""
    for name, metric in got.items():
        assert name in INSTRUMENTS, f"unexpected instrument {name}"
        unit, kind = INSTRUMENTS[name]
        assert metric.kind == kind, (name, metric.kind)
        if unit is not None:
            assert metric.unit == unit, (name, metric.unit)


def check_finished(
    otel: Otel, name: str, outcome: str, error_type: str | None, retries: int
) -> dict[str, Any]:
    """One finished request ``name``: its duration and retries, with exact attributes."""
    got = otel.metrics()
    check_instruments(got)
    duration = got["sdkcore.request.duration"]
    expected = {NAME: name, OUTCOME: outcome}
    if error_type is not None:
        expected["error.type"] = error_type
    assert duration.attribute_sets() == [expected]
    [(_, (count, seconds))] = duration.points
    assert count == 1
    assert seconds >= 0.0
    retried = got["sdkcore.request.retries"]
    assert retried.points == [({NAME: name}, (1, retries))]
    return got


# -- the doors, as a test drives them ---------------------------------------------------

Send = Callable[[Request], Awaitable[Any]]


async def through(door: str, orchestrator: RetryOrchestrator, request: Request, send: Send) -> Any:
    if door == "execute":
        return await orchestrator.execute(request, send)
    if door == "hedge":  # one copy: the hedge door with nothing to hedge

        async def copy(r: Request, index: int) -> Any:
            return await send(r)

        return await orchestrator.hedge(request, copy, HedgePolicy(1))
    return await hand_wired(orchestrator, request, send)


ASYNC_DOORS = ["execute", "hand_wired", "hedge"]
RETRYING_DOORS = ["execute", "hand_wired"]


def scripted(*outcomes: Any) -> Send:
    """A send answering ``outcomes`` in turn (an exception is raised); then the last."""
    answers = list(outcomes)

    async def send(request: Request) -> Any:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        await anyio.lowlevel.checkpoint()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return send


async def hang(request: Request) -> Any:
    await anyio.sleep_forever()


def cancelled_name() -> str:
    return anyio.get_cancelled_exc_class().__name__


# -- success ---------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("door", RETRYING_DOORS)
async def test_success_after_retries(otel: Otel, door: str) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, timeout=2.5, clock=clock.clock)
    send = scripted(RetryableError(LOCKED), RetryableError(LOCKED), "v")
    with anyio.fail_after(SAFETY):
        assert await through(door, orchestrator, request, send) == "v"
    got = check_finished(otel, "kv.get", "success", None, retries=2)
    [(_, (count, seconds))] = got["sdkcore.request.duration"].points
    assert seconds == pytest.approx(sum(clock.sleeps))  # virtual: the backoffs alone
    assert got["sdkcore.retries"].points == [({NAME: "kv.get", REASON: "KV_LOCKED"}, 2)]
    delay = got["sdkcore.retry.delay"]
    [(delay_attributes, (count, total))] = delay.points
    assert NAME in delay_attributes  # the request's name, and the reason
    assert delay_attributes[NAME] == "kv.get"
    assert count == 2
    assert total == pytest.approx(sum(clock.sleeps))
    assert "sdkcore.hedges" not in got
    assert "sdkcore.hedge.wins" not in got


@pytest.mark.anyio
@pytest.mark.parametrize("door", ASYNC_DOORS)
async def test_success_first_time_records_zero_retries(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True)
    with anyio.fail_after(SAFETY):
        assert await through(door, otel.orchestrator(), request, scripted("v")) == "v"
    got = check_finished(otel, "kv.get", "success", None, retries=0)
    assert "sdkcore.retries" not in got
    assert "sdkcore.retry.delay" not in got


def test_zero_retries_fall_in_a_bucket_of_their_own(otel: Otel) -> None:
    """0 retries is a bucket ([..0]): a dashboard tells calls without retry apart."""
    orchestrator = otel.orchestrator()
    for _ in range(3):
        orchestrator.execute_sync(Request(name="op"), lambda r: "v")
    data = otel.reader.get_metrics_data()
    assert data is not None
    [point] = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "sdkcore.request.retries"
        for p in m.data.data_points
    ]
    assert isinstance(point, HistogramDataPoint)
    assert point.explicit_bounds[0] == 0
    assert point.bucket_counts[0] == 3


# -- failure -------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("door", ASYNC_DOORS)
async def test_non_retryable_error_is_a_failure(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True)
    with anyio.fail_after(SAFETY), pytest.raises(Fatal):
        await through(door, otel.orchestrator(), request, scripted(Fatal("no such bucket")))
    check_finished(otel, "kv.get", "failure", "Fatal", retries=0)


@pytest.mark.anyio
@pytest.mark.parametrize("door", RETRYING_DOORS)
async def test_strategy_refusal_is_a_failure(otel: Otel, door: str) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(FailFastRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, clock=clock.clock)
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException):
        await through(door, orchestrator, request, scripted(RetryableError(LOCKED)))
    got = check_finished(otel, "kv.get", "failure", "RequestCanceledException", retries=0)
    assert "sdkcore.retries" not in got  # refused: not scheduled


@pytest.mark.anyio
@pytest.mark.parametrize("door", RETRYING_DOORS)
async def test_budget_refusal_is_a_failure_and_counted(otel: Otel, door: str) -> None:
    clock = VirtualClock()
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0, name="kv", clock=clock.clock)
    orchestrator = otel.orchestrator(
        BestEffortRetryStrategy(), sleep=clock.sleep, retry_budget=budget
    )  # the orchestrator watches its own budget: no Telemetry.watch needed
    request = Request(name="kv.get", idempotent=True, clock=clock.clock)
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException) as caught:
        await through(door, orchestrator, request, scripted(RetryableError(LOCKED)))
    assert caught.value.context is not None
    assert caught.value.context.cancellation_reason is not None
    got = check_finished(otel, "kv.get", "failure", "RequestCanceledException", retries=0)
    assert got["sdkcore.retry_budget.rejections"].points == [({ENDPOINT: "kv"}, 1)]
    assert got["sdkcore.retry_budget.balance"].points == [({ENDPOINT: "kv"}, 0)]


def open_breaker(clock: VirtualClock, telemetry: Telemetry, name: str = "node:11210") -> Any:
    breaker = CircuitBreaker(name=name, volume_threshold=1, sleep_window=0.5, clock=clock.clock)
    telemetry.watch(breaker)
    breaker.record_failure(TimeoutError("node did not answer"))
    assert breaker.state is CircuitState.OPEN
    return breaker


@pytest.mark.anyio
@pytest.mark.parametrize("door", RETRYING_DOORS)
async def test_breaker_refusal_is_a_failure_and_counted(otel: Otel, door: str) -> None:
    clock = VirtualClock()
    breaker = open_breaker(clock, otel.telemetry)
    orchestrator = otel.orchestrator(FailFastRetryStrategy(), sleep=clock.sleep)

    async def send(request: Request) -> str:
        with breaker.guard():
            return "sent"

    request = Request(name="kv.set", clock=clock.clock)
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException):
        await through(door, orchestrator, request, send)
    got = check_finished(otel, "kv.set", "failure", "RequestCanceledException", retries=0)
    assert got["sdkcore.circuit_breaker.rejections"].points == [({ENDPOINT: "node:11210"}, 1)]


# -- timeout --------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("door", ASYNC_DOORS)
async def test_deadline_cutting_an_attempt_is_a_timeout(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=0.05)
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await through(door, otel.orchestrator(), request, hang)
    check_finished(otel, "kv.get", "timeout", "UnambiguousTimeoutException", retries=0)


@pytest.mark.anyio
@pytest.mark.parametrize("door", RETRYING_DOORS)
async def test_deadline_while_retrying_is_a_timeout(otel: Otel, door: str) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, timeout=0.05, clock=clock.clock)
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await through(door, orchestrator, request, scripted(RetryableError(LOCKED)))
    retries = request.retry_attempts
    assert retries > 1
    got = check_finished(otel, "kv.get", "timeout", "UnambiguousTimeoutException", retries)
    assert got["sdkcore.retries"].total() == retries


# -- cancelled ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("door", ASYNC_DOORS)
async def test_request_cancel_is_cancelled(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=30.0)
    caught: list[BaseException] = []

    async def run() -> None:
        try:
            await through(door, otel.orchestrator(), request, hang)
        except Exception as exc:
            caught.append(exc)

    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.02)
            request.cancel()
    [exc] = caught
    assert isinstance(exc, RequestCanceledException)
    check_finished(otel, "kv.get", "cancelled", "RequestCanceledException", retries=0)


@pytest.mark.anyio
@pytest.mark.parametrize("door", ["execute", "hand_wired", "hedge"])
async def test_callers_cancellation_is_cancelled(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=30.0)
    with anyio.fail_after(SAFETY):
        with anyio.move_on_after(0.02) as scope:
            await through(door, otel.orchestrator(), request, hang)
    assert scope.cancelled_caught
    check_finished(otel, "kv.get", "cancelled", cancelled_name(), retries=0)


@pytest.mark.anyio
@pytest.mark.parametrize("door", RETRYING_DOORS)
async def test_callers_cancellation_in_a_backoff_is_cancelled(otel: Otel, door: str) -> None:
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(backoff=lambda n: 30.0))
    request = Request(name="kv.get", idempotent=True, timeout=60.0)
    with anyio.fail_after(SAFETY):
        with anyio.move_on_after(0.05) as scope:
            await through(door, orchestrator, request, scripted(RetryableError(LOCKED)))
    assert scope.cancelled_caught
    got = check_finished(otel, "kv.get", "cancelled", cancelled_name(), retries=1)
    assert got["sdkcore.retries"].points == [({NAME: "kv.get", REASON: "KV_LOCKED"}, 1)]
    [(_, (count, total))] = got["sdkcore.retry.delay"].points
    assert (count, total) == (1, 30.0)  # the wait scheduled, not the part waited


# -- the hand-wired loop's own shapes --------------------------------------------------------


@pytest.mark.anyio
async def test_loop_without_attempt_records_from_its_first_failure(otel: Otel) -> None:
    """maybe_retry + succeed, no attempt(): the request is recorded from maybe_retry on."""
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, clock=clock.clock)
    for _ in range(2):
        await orchestrator.maybe_retry(request, LOCKED)
    orchestrator.succeed(request)
    got = check_finished(otel, "kv.get", "success", None, retries=2)
    assert got["sdkcore.retries"].total() == 2


@pytest.mark.anyio
async def test_loop_without_attempt_records_a_first_time_success(otel: Otel) -> None:
    orchestrator = otel.orchestrator()
    request = Request(name="kv.get", idempotent=True)
    orchestrator.succeed(request)
    check_finished(otel, "kv.get", "success", None, retries=0)


@pytest.mark.anyio
async def test_loop_whose_deadline_passes_between_attempts_is_a_timeout(otel: Otel) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, timeout=1.0, clock=clock.clock)
    with pytest.raises(RetryableError), orchestrator.attempt(request):
        raise RetryableError(LOCKED)
    await orchestrator.maybe_retry(request, LOCKED)
    clock.advance(5.0)  # the application was slow between two attempts
    with pytest.raises(UnambiguousTimeoutException), orchestrator.attempt(request):
        pass  # pragma: no cover - refused on entry
    check_finished(otel, "kv.get", "timeout", "UnambiguousTimeoutException", retries=1)


@pytest.mark.anyio
async def test_fail_names_the_error_the_application_gives(otel: Otel) -> None:
    orchestrator = otel.orchestrator()
    request = Request(name="kv.get")
    with orchestrator.attempt(request):
        pass
    error = orchestrator.fail(request, Fatal("gone"))
    assert isinstance(error, Fatal)
    check_finished(otel, "kv.get", "failure", "Fatal", retries=0)
    orchestrator.fail(request, Fatal("twice"))  # once finished, never recorded again
    orchestrator.succeed(request)
    check_finished(otel, "kv.get", "failure", "Fatal", retries=0)


# -- hedge ------------------------------------------------------------------------------------


class Copies:
    """send(request, index): ``plan[index]`` = (seconds, answer); None seconds: hang."""

    def __init__(self, plan: dict[int, tuple[float | None, Any]]) -> None:
        self.plan = plan

    async def __call__(self, request: Request, index: int) -> Any:
        delay, answer = self.plan.get(index, (None, None))
        if delay is None:
            await anyio.sleep_forever()
        await anyio.sleep(delay)  # type: ignore[arg-type]
        if isinstance(answer, BaseException):
            raise answer
        return answer


@pytest.mark.anyio
@pytest.mark.parametrize("refused", ["cancelled request", "bad policy", "not idempotent"])
async def test_hedge_refused_before_sending_records_nothing(otel: Otel, refused: str) -> None:
    orchestrator = otel.orchestrator(BestEffortRetryStrategy())
    request = Request(name="h", idempotent=refused != "not idempotent", timeout=5.0)
    policy: Any = HedgePolicy(max_attempts=2)
    if refused == "cancelled request":
        request.cancel()
    elif refused == "bad policy":
        policy = "not a policy"

    async def send(r: Request, index: int) -> str:
        return "ok"

    with pytest.raises((TypeError, RequestCanceledException, CouchbaseException)):
        await orchestrator.hedge(request, send, policy)
    assert "sdkcore.request.duration" not in otel.metrics()
    assert otel.spans() == []


@pytest.mark.anyio
async def test_hedge_won_by_a_later_copy(otel: Otel) -> None:
    send = Copies({0: (None, None), 1: (None, None), 2: (0.0, "r2")})
    request = Request(name="kv.get", idempotent=True, timeout=None)
    with anyio.fail_after(SAFETY):
        result = await otel.orchestrator().hedge(request, send, HedgePolicy(4, delay=0.02))
    assert result == "r2"
    got = otel.metrics()
    check_instruments(got)
    assert got["sdkcore.hedges"].points == [({NAME: "kv.get"}, 2)]
    assert got["sdkcore.hedge.wins"].points == [({NAME: "kv.get"}, 1)]
    duration = got["sdkcore.request.duration"]
    assert duration.attribute_sets() == [{NAME: "kv.get", OUTCOME: "success"}]
    # the copies are counted by sdkcore.hedges, not as retries (sdkcore.retries has none)
    assert got["sdkcore.request.retries"].points == [({NAME: "kv.get"}, (1, 0))]
    assert "sdkcore.retries" not in got


@pytest.mark.asyncio
async def test_a_losing_hedge_copy_s_span_names_the_hedge_s_end(otel: Otel) -> None:
    """rfc/0008: a copy cut because another won ends ERROR with sdkcore's cut, whose text
    names a hedge's end (it named only the deadline and Request.cancel(), neither of
    which happened). asyncio: trio's cancellation carries no message."""
    send = Copies({0: (None, None), 1: (0.0, "r1")})
    request = Request(name="kv.get", idempotent=True, timeout=None)
    with anyio.fail_after(SAFETY):
        assert await otel.orchestrator().hedge(request, send, HedgePolicy(2, delay=0.02)) == "r1"
    lost = [
        s
        for s in otel.spans()
        if s.name == "sdkcore.attempt" and (s.attributes or {}).get("sdkcore.hedge.index") == 0
    ]
    assert len(lost) == 1
    assert "the end of a hedge another copy decided" in (lost[0].status.description or "")


@pytest.mark.anyio
async def test_hedge_won_by_the_first_copy_is_no_win(otel: Otel) -> None:
    send = Copies({0: (0.05, "r0"), 1: (None, None)})
    request = Request(name="kv.get", idempotent=True)
    with anyio.fail_after(SAFETY):
        result = await otel.orchestrator().hedge(request, send, HedgePolicy(2, delay=0.0))
    assert result == "r0"
    got = otel.metrics()
    assert got["sdkcore.hedges"].points == [({NAME: "kv.get"}, 1)]
    assert "sdkcore.hedge.wins" not in got


@pytest.mark.anyio
async def test_hedge_every_copy_failing_is_a_failure(otel: Otel) -> None:
    send = Copies({0: (0.0, Fatal("bad")), 1: (None, None)})
    request = Request(name="kv.get", idempotent=True)
    with anyio.fail_after(SAFETY), pytest.raises(Fatal):
        await otel.orchestrator().hedge(request, send, HedgePolicy(2, delay=5.0))
    check_finished(otel, "kv.get", "failure", "Fatal", retries=0)


@pytest.mark.anyio
async def test_hedge_refusing_a_reason_is_a_failure(otel: Otel) -> None:
    send = Copies({0: (0.0, RetryableError(LOCKED))})
    request = Request(name="kv.get", idempotent=True)
    policy = HedgePolicy(2, delay=5.0, non_fatal={RetryReason.KV_TEMPORARY_FAILURE})
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException):
        await otel.orchestrator().hedge(request, send, policy)
    check_finished(otel, "kv.get", "failure", "RequestCanceledException", retries=0)


@pytest.mark.anyio
async def test_hedge_deadline_with_copies_in_flight_is_a_timeout(otel: Otel) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=0.05)
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await otel.orchestrator().hedge(request, Copies({}), HedgePolicy(3, delay=0.0))
    got = check_finished(otel, "kv.get", "timeout", "UnambiguousTimeoutException", retries=0)
    assert got["sdkcore.hedges"].points == [({NAME: "kv.get"}, 2)]


@pytest.mark.anyio
async def test_hedge_refused_by_the_budget_counts_a_rejection_not_a_hedge(otel: Otel) -> None:
    budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0, name="kv")
    orchestrator = otel.orchestrator(retry_budget=budget)
    send = Copies({0: (0.05, "r0")})
    request = Request(name="kv.get", idempotent=True)
    with anyio.fail_after(SAFETY):
        assert await orchestrator.hedge(request, send, HedgePolicy(3, delay=0.0)) == "r0"
    got = check_finished(otel, "kv.get", "success", None, retries=0)
    assert "sdkcore.hedges" not in got
    assert got["sdkcore.retry_budget.rejections"].points == [({ENDPOINT: "kv"}, 1)]


# -- the sync door ----------------------------------------------------------------------------


def sync_scripted(*outcomes: Any) -> Callable[[Request], Any]:
    answers = list(outcomes)

    def send(request: Request) -> Any:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return send


def virtual_sleep(clock: VirtualClock) -> Callable[[float], None]:
    def sleep(seconds: float) -> None:
        clock.sleeps.append(seconds)
        clock.advance(seconds)

    return sleep


def test_sync_success_after_retries(otel: Otel) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy())
    request = Request(name="kv.get", idempotent=True, clock=clock.clock)
    send = sync_scripted(RetryableError(LOCKED), RetryableError(LOCKED), "v")
    assert orchestrator.execute_sync(request, send, sleep=virtual_sleep(clock)) == "v"
    got = check_finished(otel, "kv.get", "success", None, retries=2)
    assert got["sdkcore.retries"].points == [({NAME: "kv.get", REASON: "KV_LOCKED"}, 2)]
    [(_, (count, total))] = got["sdkcore.retry.delay"].points
    assert (count, total) == (2, pytest.approx(sum(clock.sleeps)))


@pytest.mark.parametrize(
    ("case", "outcome", "error_type"),
    [
        ("non_retryable", "failure", "Fatal"),
        ("strategy", "failure", "RequestCanceledException"),
        ("budget", "failure", "RequestCanceledException"),
        ("breaker", "failure", "RequestCanceledException"),
        ("timeout", "timeout", "UnambiguousTimeoutException"),
        ("cancel", "cancelled", "RequestCanceledException"),
    ],
)
def test_sync_outcomes(otel: Otel, case: str, outcome: str, error_type: str) -> None:
    clock = VirtualClock()
    strategy: Any = BestEffortRetryStrategy()
    budget = None
    send = sync_scripted(RetryableError(LOCKED))
    timeout = 2.5
    if case == "non_retryable":
        send = sync_scripted(Fatal("no such bucket"))
    elif case == "strategy":
        strategy = FailFastRetryStrategy()
    elif case == "budget":
        budget = RetryBudget(min_retries_per_sec=0, retry_ratio=0, name="kv", clock=clock.clock)
    elif case == "breaker":
        strategy = FailFastRetryStrategy()
        breaker = open_breaker(clock, otel.telemetry)

        def send(request: Request) -> Any:
            with breaker.guard():
                return "sent"

    elif case == "timeout":
        timeout = 0.05  # BestEffort retries until the (virtual) deadline
    elif case == "cancel":

        def send(request: Request) -> Any:
            request.cancel()  # as another thread would, while send runs
            return "discarded"

    orchestrator = otel.orchestrator(strategy, retry_budget=budget)
    request = Request(name="kv.get", idempotent=True, timeout=timeout, clock=clock.clock)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked by name
        orchestrator.execute_sync(request, send, sleep=virtual_sleep(clock))
    assert type(caught.value).__name__ == error_type
    check_finished(otel, "kv.get", outcome, error_type, retries=request.retry_attempts)
    got = otel.metrics()
    if case == "budget":
        assert got["sdkcore.retry_budget.rejections"].points == [({ENDPOINT: "kv"}, 1)]
    if case == "breaker":
        assert got["sdkcore.circuit_breaker.rejections"].total() == 1


def test_sync_door_from_32_threads(otel: Otel) -> None:
    """Every thread's requests counted exactly: nothing lost or doubled between threads."""
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
    threads, per_thread = 32, 20
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                send = sync_scripted(RetryableError(LOCKED), "v")
                name = f"op{t % 4}"
                if i % 5 == 4:
                    send = sync_scripted(RetryableError(LOCKED), Fatal("x"))
                request = Request(name=name, idempotent=True)
                with contextlib.suppress(Fatal):
                    orchestrator.execute_sync(request, send)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(SAFETY * 3)
    assert not errors
    total = threads * per_thread
    got = otel.metrics()
    duration = got["sdkcore.request.duration"]
    assert duration.total() == total
    assert duration.total(sdkcore__request__outcome="failure") == total // 5
    for n in range(4):
        assert duration.total(sdkcore__request__name=f"op{n}") == total // 4
    assert got["sdkcore.retries"].total() == total
    assert got["sdkcore.request.retries"].points == [
        ({NAME: f"op{n}"}, (total // 4, total // 4)) for n in range(4)
    ] or sorted(got["sdkcore.request.retries"].points, key=lambda p: p[0][NAME]) == [
        ({NAME: f"op{n}"}, (total // 4, total // 4)) for n in range(4)
    ]
    spans = otel.spans()
    requests = {s.context.span_id: s for s in spans if s.name.startswith("op")}
    attempts = [s for s in spans if s.name == "sdkcore.attempt"]
    assert len(requests) == total
    assert len(attempts) == 2 * total
    for span in attempts:  # each attempt under its own request, never another thread's
        assert span.parent is not None
        assert span.parent.span_id in requests
    per_request: dict[int, list[int]] = {}
    for span in attempts:
        assert span.parent is not None
        per_request.setdefault(span.parent.span_id, []).append(attr(span, "sdkcore.attempt.number"))
    assert all(sorted(numbers) == [1, 2] for numbers in per_request.values())


# -- breakers and budgets ------------------------------------------------------------------------


def test_breaker_state_gauge_and_transitions(otel: Otel) -> None:
    clock = VirtualClock()
    breaker = CircuitBreaker(
        name="10.0.0.1:11210", volume_threshold=1, sleep_window=0.5, clock=clock.clock
    )
    assert otel.telemetry.watch(breaker) is breaker

    def state() -> Any:
        got = otel.metrics()
        check_instruments(got)
        [(attributes, value)] = got["sdkcore.circuit_breaker.state"].points
        assert attributes == {ENDPOINT: "10.0.0.1:11210"}
        return value

    def transitions() -> dict[str, int]:
        metric = otel.metrics().get("sdkcore.circuit_breaker.transitions")
        if metric is None:
            return {}
        for attributes, _ in metric.points:
            assert set(attributes) == {ENDPOINT, STATE}
            assert attributes[ENDPOINT] == "10.0.0.1:11210"
        return {a[STATE]: v for a, v in metric.points}

    assert state() == 0
    zero = {"closed": 0, "open": 0, "half_open": 0}  # each series there from the watch
    assert transitions() == zero
    breaker.record_failure(TimeoutError("down"))
    assert state() == 1
    assert transitions() == {**zero, "open": 1}
    with pytest.raises(RetryableError), breaker.guard():
        pass  # pragma: no cover - refused
    assert otel.metrics()["sdkcore.circuit_breaker.rejections"].points == [
        ({ENDPOINT: "10.0.0.1:11210"}, 1)
    ]
    clock.advance(0.5)
    assert breaker.admit() is CircuitState.HALF_OPEN  # the probe goes
    assert state() == 2
    assert transitions() == {**zero, "open": 1, "half_open": 1}
    breaker.record_success()
    assert state() == 0
    assert transitions() == {"open": 1, "half_open": 1, "closed": 1}


def test_budget_balance_gauge_follows_the_budget(otel: Otel) -> None:
    clock = VirtualClock()
    budget = RetryBudget(min_retries_per_sec=1, ttl=10, retry_ratio=0.5, clock=clock.clock)
    otel.orchestrator(retry_budget=budget)  # watched by the orchestrator it serves

    def balance() -> Any:
        [(attributes, value)] = otel.metrics()["sdkcore.retry_budget.balance"].points
        return attributes, value

    attributes, before = balance()
    assert attributes == {ENDPOINT: "unnamed-1"}  # an unnamed budget: labelled in watch order
    assert before == budget.balance == 10
    for _ in range(4):
        budget.deposit()
    assert balance()[1] == budget.balance == 12


def test_watched_objects_are_held_weakly(otel: Otel) -> None:
    import gc

    clock = VirtualClock()
    otel.telemetry.watch(CircuitBreaker(name="gone", clock=clock.clock))
    otel.telemetry.watch(RetryBudget(name="gone", clock=clock.clock))
    gc.collect()
    got = otel.metrics()
    assert "sdkcore.circuit_breaker.state" not in got
    assert "sdkcore.retry_budget.balance" not in got


def test_watch_reports_to_the_last_telemetry_only(otel: Otel) -> None:
    other = Otel()
    try:
        clock = VirtualClock()
        breaker = CircuitBreaker(name="b", volume_threshold=1, clock=clock.clock)
        other.telemetry.watch(breaker)
        otel.telemetry.watch(breaker)
        breaker.record_failure(TimeoutError("down"))
        assert otel.metrics()["sdkcore.circuit_breaker.state"].points == [({ENDPOINT: "b"}, 1)]
        # The first telemetry keeps the counter series it started at 0, and nothing more.
        left = other.metrics()
        assert set(left) == {
            "sdkcore.circuit_breaker.transitions",
            "sdkcore.circuit_breaker.rejections",
        }
        assert [value for metric in left.values() for _, value in metric.points] == [0] * 4
    finally:
        other.shutdown()


# -- configuration ----------------------------------------------------------------------------


def test_bad_arguments_are_refused_naming_the_field() -> None:
    with pytest.raises(TypeError, match=r"RetryOrchestrator\(telemetry=\.\.\.\) must be"):
        RetryOrchestrator(telemetry="otel")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Telemetry\(meter_provider=\.\.\.\) must be"):
        Telemetry(meter_provider=object())
    with pytest.raises(TypeError, match=r"Telemetry\(tracer_provider=\.\.\.\) must be"):
        Telemetry(tracer_provider=object())
    with pytest.raises(TypeError, match=r"Telemetry.watch\(target\): target must be"):
        Telemetry(meter_provider=None).watch(object())


def test_orchestrator_exposes_its_telemetry(otel: Otel) -> None:
    assert otel.orchestrator().telemetry is otel.telemetry
    assert RetryOrchestrator().telemetry is None
