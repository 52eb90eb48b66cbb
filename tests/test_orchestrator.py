"""RetryOrchestrator.maybe_retry (RFC 0049 "Retry Orchestration", "Capping the Retry Duration")."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdkcore import (
    DEFAULT_MAX_REQUESTS_IN_RETRY,
    AttemptEffect,
    BestEffortRetryStrategy,
    CancellationReason,
    CouchbaseException,
    ErrorContext,
    FailFastRetryStrategy,
    Request,
    RequestCanceledException,
    RequestState,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    ScopeNotFoundException,
    TimeoutException,
    UnambiguousTimeoutException,
    controlled_backoff,
)
from sdkcore.testing import ScriptedSend, VirtualClock

pytestmark = pytest.mark.anyio


def ms(n: float) -> timedelta:
    return timedelta(milliseconds=n)


class Fixed:
    """Retries after a fixed delay (seconds), or refuses with the given action."""

    def __init__(self, delay: float | None = None, refusal: RetryAction | None = None) -> None:
        self.delay = delay
        self.refusal = refusal

    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        if self.delay is None:
            return self.refusal or RetryAction.no_retry()
        return RetryAction.with_duration(self.delay)


def virtual(strategy: Any = None, **kwargs: Any) -> tuple[RetryOrchestrator, VirtualClock]:
    vc = VirtualClock()
    return RetryOrchestrator(strategy, sleep=vc.sleep, **kwargs), vc


# -- retry bookkeeping ---------------------------------------------------------------


async def test_retry_increments_attempts_and_records_reasons_in_order_without_duplicates() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(idempotent=True, timeout=None, clock=vc.clock)
    sequence = [
        RetryReason.KV_LOCKED,
        RetryReason.SOCKET_NOT_AVAILABLE,
        RetryReason.KV_LOCKED,
        RetryReason.KV_NOT_MY_VBUCKET,
        RetryReason.SOCKET_NOT_AVAILABLE,
        RetryReason.UNKNOWN,
    ]
    waited = []
    for n, reason in enumerate(sequence, start=1):
        waited.append(await orch.maybe_retry(req, reason))
        assert req.retry_attempts == n
    assert req.retry_reasons == (
        RetryReason.KV_LOCKED,
        RetryReason.SOCKET_NOT_AVAILABLE,
        RetryReason.KV_NOT_MY_VBUCKET,
        RetryReason.UNKNOWN,
    )
    # BestEffort 1, 2, 4 ms; controlled backoff at attempt 3 is 100 ms; then 16, 32 ms.
    assert waited == [ms(1), ms(2), ms(4), ms(100), ms(16), ms(32)]
    assert all(isinstance(w, timedelta) for w in waited)
    assert vc.sleeps == pytest.approx([0.001, 0.002, 0.004, 0.1, 0.016, 0.032])
    assert req.state is RequestState.PENDING


async def test_returns_the_delay_actually_waited_with_real_sleep() -> None:
    orch = RetryOrchestrator(Fixed(0.002))
    req = Request(timeout=5)
    before = anyio.current_time()
    assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == ms(2)
    assert anyio.current_time() - before >= 0.0015  # it did wait (generous lower bound only)


async def test_action_built_with_the_constructor_waits_its_duration() -> None:
    """RetryAction's constructor is public (an attrs class): its duration must be honoured."""

    class Direct:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction(timedelta(milliseconds=30))

    orch, vc = virtual(Direct())
    req = Request(timeout=10, clock=vc.clock)
    assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == ms(30)
    assert vc.sleeps == [pytest.approx(0.03)]


async def test_zero_delay_retry() -> None:
    orch = RetryOrchestrator(Fixed(0.0))
    req = Request(timeout=5)
    assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == timedelta(0)
    assert req.retry_attempts == 1


# -- refusal -----------------------------------------------------------------------


async def test_refusal_raises_request_canceled_no_more_retries() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(name="kv.insert", timeout=None, clock=vc.clock)
    await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(req, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT)
    ctx = info.value.context
    assert ctx is not None
    assert ctx.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    assert ctx.reason is RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT
    assert ctx.retry_attempts == 1
    assert ctx.retry_reasons == (RetryReason.KV_LOCKED,)
    assert ctx.request_name == "kv.insert"
    # attempts and reasons unchanged by the refusal
    assert req.retry_attempts == 1
    assert req.retry_reasons == (RetryReason.KV_LOCKED,)
    assert req.cancelled
    assert req.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    assert len(vc.sleeps) == 1
    assert "SOCKET_CLOSED_WHILE_IN_FLIGHT" in str(info.value)


async def test_no_retry_with_exception_class() -> None:
    orch, vc = virtual(Fixed(refusal=RetryAction.no_retry(ScopeNotFoundException)))
    req = Request(clock=vc.clock)
    with pytest.raises(ScopeNotFoundException) as info:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert info.value.context is not None
    assert info.value.context.request_id == req.id
    assert info.value.context.reason is RetryReason.KV_LOCKED
    assert req.retry_attempts == 0
    assert req.completed


async def test_no_retry_with_callable() -> None:
    contexts: list[ErrorContext] = []

    class AppError(Exception):
        pass

    def translate(ctx: ErrorContext) -> BaseException:
        contexts.append(ctx)
        return AppError(f"request {ctx.request_id} gave up")

    orch, vc = virtual(Fixed(refusal=RetryAction.no_retry(translate)))
    req = Request(clock=vc.clock)
    with pytest.raises(AppError, match=f"request {req.id} gave up"):
        await orch.maybe_retry(req, RetryReason.UNKNOWN)
    assert len(contexts) == 1
    assert contexts[0].reason is RetryReason.UNKNOWN
    assert contexts[0].cancellation_reason is CancellationReason.NO_MORE_RETRIES


# -- capping -----------------------------------------------------------------------


async def test_capping_waits_the_time_left_then_times_out() -> None:
    """0.25 s timeout, 0.2 s elapsed, 0.1 s asked: waits about 0.05 s, then times out."""
    orch, vc = virtual(Fixed(0.1))
    req = Request(idempotent=True, timeout=0.25, clock=vc.clock)
    start = vc.now
    vc.advance(0.2)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert vc.sleeps == [pytest.approx(0.05)]
    assert vc.now - start == pytest.approx(0.25)
    assert req.completed
    assert req.cancellation_reason is CancellationReason.TIMEOUT
    ctx = info.value.context
    assert ctx is not None
    assert ctx.cancellation_reason is CancellationReason.TIMEOUT
    assert ctx.timeout == ms(250)
    assert abs(ctx.elapsed - ms(250)) < timedelta(microseconds=10)
    # never handed back for dispatch: a further retry is refused
    with pytest.raises(CouchbaseException):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)


async def test_uncapped_when_delay_fits() -> None:
    orch, vc = virtual(Fixed(0.04))
    req = Request(timeout=0.25, clock=vc.clock)
    vc.advance(0.2)
    assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == ms(40)
    assert req.state is RequestState.PENDING


async def test_already_past_deadline_times_out_without_waiting() -> None:
    orch, vc = virtual(Fixed(0.1))
    req = Request(idempotent=True, timeout=0.25, clock=vc.clock)
    vc.advance(1.0)
    with pytest.raises(UnambiguousTimeoutException):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert all(s <= 0.0 for s in vc.sleeps)


async def test_controlled_backoff_is_capped_too() -> None:
    orch, vc = virtual(FailFastRetryStrategy())
    req = Request(idempotent=True, timeout=0.3, clock=vc.clock)
    for expected in (1, 10, 50, 100):
        assert await orch.maybe_retry(req, RetryReason.KV_NOT_MY_VBUCKET) == ms(expected)
    # 161 ms used; the next controlled backoff (500 ms) is capped to the 139 ms left.
    with pytest.raises(TimeoutException):
        await orch.maybe_retry(req, RetryReason.KV_NOT_MY_VBUCKET)
    assert vc.sleeps[-1] == pytest.approx(0.139)
    assert sum(vc.sleeps) == pytest.approx(0.3)


async def test_no_timeout_is_never_capped() -> None:
    orch, vc = virtual(Fixed(3600.0))
    req = Request(timeout=None, clock=vc.clock)
    for _ in range(3):
        assert await orch.maybe_retry(req, RetryReason.KV_LOCKED) == timedelta(hours=1)
    assert req.state is RequestState.PENDING


# -- ambiguous vs unambiguous ------------------------------------------------------------


async def _time_out(req: Request, reasons: list[RetryReason], vc: VirtualClock) -> TimeoutException:
    orch = RetryOrchestrator(Fixed(0.1), sleep=vc.sleep)
    for reason in reasons:
        await orch.maybe_retry(req, reason)
    for _ in range(100):
        try:
            await orch.maybe_retry(req, reasons[-1])
        except TimeoutException as exc:
            return exc
    raise AssertionError("no timeout after 100 retries")


@pytest.mark.parametrize(
    "reasons",
    [[RetryReason.KV_LOCKED], [RetryReason.UNKNOWN], [RetryReason.SOCKET_NOT_AVAILABLE]],
    ids=lambda rs: "+".join(r.name for r in rs),
)
async def test_idempotent_timeout_is_unambiguous(reasons: list[RetryReason]) -> None:
    vc = VirtualClock()
    req = Request(idempotent=True, timeout=0.35, clock=vc.clock)
    exc = await _time_out(req, reasons, vc)
    assert type(exc) is UnambiguousTimeoutException


@pytest.mark.parametrize(
    "reasons",
    [
        [RetryReason.SOCKET_NOT_AVAILABLE],
        [RetryReason.SERVICE_NOT_AVAILABLE, RetryReason.NODE_NOT_AVAILABLE],
        [RetryReason.CIRCUIT_BREAKER_OPEN, RetryReason.SOCKET_NOT_AVAILABLE],
    ],
    ids=lambda rs: "+".join(r.name for r in rs),
)
async def test_non_idempotent_never_dispatched_timeout_is_unambiguous(
    reasons: list[RetryReason],
) -> None:
    vc = VirtualClock()
    req = Request(idempotent=False, timeout=0.35, clock=vc.clock)
    exc = await _time_out(req, reasons, vc)
    assert type(exc) is UnambiguousTimeoutException
    assert req.reached_network is False


@pytest.mark.parametrize(
    "reasons",
    [
        [RetryReason.KV_LOCKED],
        [RetryReason.KV_TEMPORARY_FAILURE],
        [RetryReason.SOCKET_NOT_AVAILABLE, RetryReason.KV_LOCKED, RetryReason.SOCKET_NOT_AVAILABLE],
        [RetryReason.KV_NOT_MY_VBUCKET, RetryReason.SOCKET_NOT_AVAILABLE],
    ],
    ids=lambda rs: "+".join(r.name for r in rs),
)
async def test_non_idempotent_answers_that_prove_nothing_applied_time_out_unambiguous(
    reasons: list[RetryReason],
) -> None:
    """Reached the server, but every answer proves nothing was applied (rfc/0001 Ambiguity)."""
    vc = VirtualClock()
    req = Request(idempotent=False, timeout=0.35, clock=vc.clock)
    exc = await _time_out(req, reasons, vc)
    assert type(exc) is UnambiguousTimeoutException
    assert req.reached_network is True
    assert req.maybe_applied is False
    assert exc.context is not None
    assert exc.context.idempotent is False
    assert {a.effect for a in exc.context.attempts} <= {
        AttemptEffect.NOT_APPLIED,
        AttemptEffect.NOT_SENT,
    }


async def test_a_maybe_applied_attempt_ends_a_non_idempotent_request_at_once() -> None:
    """gRPC UNAVAILABLE from the server maps to SERVICE_NOT_AVAILABLE, whose flag allows a
    non-idempotent retry (it is usually raised before sending): the adapter's effect says
    the attempt may have been applied, and the effect wins. Nothing is sent again."""
    vc = VirtualClock()
    req = Request(idempotent=False, timeout=0.35, clock=vc.clock)
    orch = RetryOrchestrator(Fixed(0.1), sleep=vc.sleep)
    await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(
            req, RetryReason.SERVICE_NOT_AVAILABLE, effect=AttemptEffect.MAYBE_APPLIED
        )
    assert vc.now == pytest.approx(1000.1)  # no wait after the maybe-applied attempt
    assert req.retry_attempts == 1
    assert req.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    message = str(info.value)
    assert "may have been applied" in message
    assert "SERVICE_NOT_AVAILABLE" in message
    assert "MAYBE_APPLIED" in message
    ctx = info.value.context
    assert ctx is not None
    assert [a.effect for a in ctx.attempts] == [
        AttemptEffect.NOT_APPLIED,
        AttemptEffect.MAYBE_APPLIED,
    ]


async def test_an_idempotent_request_is_never_ambiguous() -> None:
    vc = VirtualClock()
    req = Request(idempotent=True, timeout=0.35, clock=vc.clock)
    orch = RetryOrchestrator(Fixed(0.1), sleep=vc.sleep)

    async def until_timeout() -> None:
        for _ in range(10):
            await orch.maybe_retry(req, RetryReason.UNKNOWN)

    with pytest.raises(UnambiguousTimeoutException):
        await until_timeout()
    assert req.maybe_applied is True


# -- backpressure ------------------------------------------------------------------


def test_default_backpressure_limit() -> None:
    assert DEFAULT_MAX_REQUESTS_IN_RETRY == 32768
    assert RetryOrchestrator().max_requests_in_retry == 32768


@pytest.mark.parametrize("limit", [1, 3])
async def test_backpressure_limit(limit: int) -> None:
    orch = RetryOrchestrator(Fixed(30.0), max_requests_in_retry=limit)
    waiting = [Request(timeout=60) for _ in range(limit)]
    outcomes: dict[int, BaseException | timedelta] = {}

    async def retry(req: Request, reason: RetryReason) -> None:
        try:
            outcomes[req.id] = await orch.maybe_retry(req, reason)
        except CouchbaseException as exc:
            outcomes[req.id] = exc

    async with anyio.create_task_group() as tg:
        for req in waiting:
            tg.start_soon(retry, req, RetryReason.KV_LOCKED)
        await anyio.wait_all_tasks_blocked()
        assert orch.requests_in_retry == limit
        assert outcomes == {}

        # the N+1th fails at once, always-retry reasons included
        for reason in (RetryReason.KV_LOCKED, RetryReason.KV_NOT_MY_VBUCKET):
            extra = Request(timeout=60)
            with anyio.fail_after(5), pytest.raises(RequestCanceledException) as info:
                await orch.maybe_retry(extra, reason)
            ctx = info.value.context
            assert ctx is not None
            assert ctx.cancellation_reason is CancellationReason.TOO_MANY_REQUESTS_IN_RETRY
            assert ctx.reason is reason
            assert extra.retry_attempts == 0
            assert extra.cancellation_reason is CancellationReason.TOO_MANY_REQUESTS_IN_RETRY

        # free one slot: the next request is accepted again
        waiting[0].cancel()
        await anyio.wait_all_tasks_blocked()
        assert orch.requests_in_retry == limit - 1
        late = Request(timeout=60)
        tg.start_soon(retry, late, RetryReason.KV_LOCKED)
        await anyio.wait_all_tasks_blocked()
        assert orch.requests_in_retry == limit
        assert late.id not in outcomes
        for req in [*waiting[1:], late]:
            req.cancel()
    assert orch.requests_in_retry == 0
    assert all(isinstance(o, RequestCanceledException) for o in outcomes.values())
    assert len(outcomes) == limit + 1


# -- cancellation ------------------------------------------------------------------------


async def test_outer_cancellation_during_backoff_propagates(anyio_backend: str) -> None:
    before = set(asyncio.all_tasks()) if anyio_backend == "asyncio" else set()
    strategy_calls: list[RetryReason] = []

    class Slow:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            strategy_calls.append(reason)
            return RetryAction.with_duration(30.0)

    orch = RetryOrchestrator(Slow())
    req = Request(timeout=60)
    seen: list[type[BaseException]] = []
    after_wait: list[str] = []

    async def caller() -> None:
        try:
            await orch.maybe_retry(req, RetryReason.KV_LOCKED)
            after_wait.append("returned")  # must not happen
        except BaseException as exc:
            seen.append(type(exc))
            raise

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        assert orch.requests_in_retry == 1
        tg.cancel_scope.cancel()

    assert seen == [anyio.get_cancelled_exc_class()]
    assert after_wait == []
    assert strategy_calls == [RetryReason.KV_LOCKED]  # cancellation was not fed to the strategy
    assert orch.requests_in_retry == 0
    assert req.cancelled
    assert req.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert req.retry_attempts == 1
    # not retried after
    with pytest.raises(RequestCanceledException):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert strategy_calls == [RetryReason.KV_LOCKED]
    if anyio_backend == "asyncio":
        assert set(asyncio.all_tasks()) == before


async def test_cancel_scope_around_maybe_retry() -> None:
    orch = RetryOrchestrator(Fixed(30.0))
    req = Request(timeout=60)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert scope.cancelled_caught
    assert req.cancellation_reason is CancellationReason.TASK_CANCELLED
    assert orch.requests_in_retry == 0


async def test_cancellation_while_an_async_strategy_decides() -> None:
    gate = anyio.Event()

    class Waits:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            await gate.wait()
            return RetryAction.with_duration(0)

    orch = RetryOrchestrator(Waits())
    req = Request(timeout=60)
    async with anyio.create_task_group() as tg:
        tg.start_soon(orch.maybe_retry, req, RetryReason.KV_LOCKED)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert req.cancelled
    assert req.retry_attempts == 0
    assert req.cancellation_reason is CancellationReason.TASK_CANCELLED


async def test_request_cancel_during_backoff_wakes_the_waiter() -> None:
    orch = RetryOrchestrator(Fixed(30.0))
    req = Request(timeout=60)
    outcome: list[BaseException] = []

    async def caller() -> None:
        try:
            await orch.maybe_retry(req, RetryReason.KV_LOCKED)
        except RequestCanceledException as exc:
            outcome.append(exc)

    start = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        req.cancel()
    assert anyio.current_time() - start < 20  # woke long before the 30 s backoff ended
    assert len(outcome) == 1
    ctx = outcome[0].context  # type: ignore[attr-defined]
    assert ctx.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    assert req.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    assert orch.requests_in_retry == 0


async def test_request_cancel_during_async_strategy_decision() -> None:
    gate = anyio.Event()

    class Waits:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            await gate.wait()
            return RetryAction.with_duration(0)

    orch, vc = virtual(Waits())
    req = Request(timeout=60, clock=vc.clock)
    outcome: list[BaseException] = []

    async def caller() -> None:
        try:
            await orch.maybe_retry(req, RetryReason.KV_LOCKED)
        except RequestCanceledException as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(caller)
        await anyio.wait_all_tasks_blocked()
        req.cancel()
        gate.set()
    assert len(outcome) == 1
    assert req.retry_attempts == 0
    assert vc.sleeps == []


async def test_maybe_retry_on_cancelled_request() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(clock=vc.clock)
    req.cancel()
    with pytest.raises(RequestCanceledException) as info:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert info.value.context is not None
    assert info.value.context.cancellation_reason is CancellationReason.CANCELLED_VIA_CONTEXT
    assert req.retry_attempts == 0


async def test_maybe_retry_on_completed_request_fails_clearly() -> None:
    async def send(_: Request) -> int:
        return 1

    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(name="kv.get", clock=vc.clock)
    await orch.execute(req, send)
    assert req.state is RequestState.SUCCEEDED
    with pytest.raises(
        RuntimeError, match=r"has already succeeded; it cannot be sent again"
    ) as info:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert str(req.id) in str(info.value)
    assert "kv.get" in str(info.value)
    assert req.retry_attempts == 0
    assert req.state is RequestState.SUCCEEDED


async def test_maybe_retry_on_failed_request_fails_clearly() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())

    async def send(_: Request) -> int:
        raise KeyError("x")

    req = Request(clock=vc.clock)
    with pytest.raises(KeyError):
        await orch.execute(req, send)
    with pytest.raises(RuntimeError, match="already failed"):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)


class LooksLikeAReason:
    """Has the flags of a RetryReason but is not one."""

    name = "FAKE"
    always_retry = True
    allows_non_idempotent_retry = True
    after_dispatch = False


@pytest.mark.parametrize(
    "bad",
    ["KV_LOCKED", None, 5, CancellationReason.TIMEOUT, LooksLikeAReason()],
    ids=["str", "none", "int", "other-enum", "duck-typed"],
)
async def test_bad_reason_is_a_type_error(bad: object) -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(clock=vc.clock)
    with pytest.raises(TypeError, match=r"reason must be a RetryReason"):
        await orch.maybe_retry(req, bad)  # type: ignore[arg-type]
    assert req.retry_attempts == 0
    assert req.state is RequestState.PENDING


# -- property: who gets retried ---------------------------------------------------------


def _best_effort_ms(attempt: int) -> float:
    return min(2**attempt, 256) if attempt < 9 else 500


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=150, deadline=None)
@given(
    reasons=st.lists(st.sampled_from(list(RetryReason)), min_size=1, max_size=25),
    idempotent=st.booleans(),
)
def test_property_retried_iff_safe_under_best_effort(
    backend: str, reasons: list[RetryReason], idempotent: bool
) -> None:
    async def scenario() -> None:
        vc = VirtualClock()
        orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=vc.sleep)
        req = Request(idempotent=idempotent, timeout=None, clock=vc.clock)
        recorded: list[RetryReason] = []
        expected_sleeps: list[float] = []
        for n, reason in enumerate(reasons):
            should_retry = reason.always_retry or idempotent or reason.allows_non_idempotent_retry
            if should_retry:
                waited = await orch.maybe_retry(req, reason)
                expected = (
                    controlled_backoff(n).total_seconds() * 1000
                    if reason.always_retry
                    else _best_effort_ms(n)
                )
                assert waited.total_seconds() * 1000 == pytest.approx(expected)
                expected_sleeps.append(expected / 1000)
                if reason not in recorded:
                    recorded.append(reason)
                assert req.retry_attempts == n + 1
                assert req.retry_reasons == tuple(recorded)
                assert req.state is RequestState.PENDING
            else:
                with pytest.raises(RequestCanceledException) as info:
                    await orch.maybe_retry(req, reason)
                assert info.value.context is not None
                assert info.value.context.cancellation_reason is CancellationReason.NO_MORE_RETRIES
                assert req.retry_attempts == n
                assert req.retry_reasons == tuple(recorded)
                assert req.cancelled
                break
        assert vc.sleeps == pytest.approx(expected_sleeps)
        assert orch.requests_in_retry == 0

    anyio.run(scenario, backend=backend)


async def test_succeed_marks_a_hand_wired_request_done() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(name="kv.get", idempotent=True, clock=vc.clock)
    await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    orch.succeed(req)
    assert req.state is RequestState.SUCCEEDED
    assert req.completed
    assert not req.cancelled
    assert req.retry_attempts == 1  # retry state is kept
    with pytest.raises(RuntimeError, match="already succeeded"):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    cancelled = Request(clock=vc.clock)
    cancelled.cancel()
    orch.succeed(cancelled)  # a completed request stays as it ended
    assert cancelled.state is RequestState.CANCELLED


# -- safety: a non-idempotent request that may have reached the server ---------------


class RetryEverything:
    """A custom strategy that would retry anything."""

    def __init__(self) -> None:
        self.calls = 0

    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        self.calls += 1
        return RetryAction.with_duration(0.001)


@pytest.mark.parametrize("reason", [RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, RetryReason.UNKNOWN])
async def test_unsafe_retry_is_refused_whatever_the_strategy_says(reason: RetryReason) -> None:
    strategy = RetryEverything()
    orch, vc = virtual(strategy)
    req = Request(name="kv.upsert", idempotent=False, clock=vc.clock)
    with pytest.raises(RequestCanceledException, match="not idempotent") as info:
        await orch.maybe_retry(req, reason)
    assert strategy.calls == 1  # asked, then overruled
    assert req.retry_attempts == 0
    assert vc.sleeps == []
    ctx = info.value.context
    assert ctx is not None
    assert ctx.reason is reason
    assert ctx.cancellation_reason is CancellationReason.NO_MORE_RETRIES
    # the same strategy may retry an idempotent request, or a safe reason
    assert await orch.maybe_retry(Request(idempotent=True, clock=vc.clock), reason) == timedelta(
        milliseconds=1
    )
    assert await orch.maybe_retry(
        Request(idempotent=False, clock=vc.clock), RetryReason.KV_LOCKED
    ) == timedelta(milliseconds=1)


async def test_unsafe_retry_through_execute_sends_once() -> None:
    orch = RetryOrchestrator(RetryEverything())
    send: ScriptedSend[str] = ScriptedSend([RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, "stored"])
    with pytest.raises(RequestCanceledException):
        await orch.execute(Request(name="kv.upsert", timeout=5), send)
    assert send.calls == 1
