"""RetryOrchestrator.hedge asks the request's strategy before hedging past a failure,
and reports how a hedged request ended in the same events as the other doors (rfc/0004,
"The strategy"; rfc/0001, "Log events"). On asyncio and trio."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from sdkcore import (
    AuthenticationFailureException,
    BestEffortRetryStrategy,
    FailFastRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.testing import capture_retry_events

pytestmark = pytest.mark.anyio

SAFETY = 10.0


class Sends:
    """send(request, index): copy ``i`` raises ``fail[i]`` at once, or blocks."""

    def __init__(self, fail: dict[int, BaseException]) -> None:
        self.fail = fail
        self.sent: list[int] = []

    async def __call__(self, request: Request, index: int) -> Any:
        self.sent.append(index)
        error = self.fail.get(index)
        if error is not None:
            raise error
        await anyio.sleep_forever()


def req(strategy: Any = None, timeout: float = 5.0) -> Request:
    return Request(name="kv.get", idempotent=True, timeout=timeout, retry_strategy=strategy)


async def test_a_terminal_reason_ends_the_hedges_with_the_strategys_error() -> None:
    # The default strategy (FastFailOnTerminalError) maps AUTHENTICATION_ERROR to its
    # exception: no further copy is sent, the one in flight is cut.
    send = Sends({0: RetryableError(RetryReason.AUTHENTICATION_ERROR, "bad password")})
    request = req()
    with (
        anyio.fail_after(SAFETY),
        capture_retry_events() as events,
        pytest.raises(AuthenticationFailureException) as info,
    ):
        await RetryOrchestrator().hedge(request, send, HedgePolicy(4, delay=0.05))
    assert send.sent == [0]  # a terminal error is not hedged past
    assert isinstance(info.value.__cause__, RetryableError)
    assert info.value.context is not None
    assert info.value.context.extra["hedges_sent"] == 1
    refused = [e for e in events if e["event"] == "retry.not_retried"]
    assert len(refused) == 1
    assert refused[0]["why"] == "strategy_declined"
    assert refused[0]["reason"] == "AUTHENTICATION_ERROR"


async def test_fail_fast_ends_at_the_first_failure_but_a_slow_copy_is_still_hedged() -> None:
    # FailFast never retries a failure; hedging for latency still sends the next copy.
    send = Sends({1: RetryableError(RetryReason.KV_TEMPORARY_FAILURE)})
    with anyio.fail_after(SAFETY):
        with pytest.raises(RequestCanceledException) as info:
            await RetryOrchestrator().hedge(
                req(FailFastRetryStrategy()), send, HedgePolicy(4, delay=0.02)
            )
    assert send.sent == [0, 1]  # copy 1 went for latency; its failure ends the chain
    assert "FailFastRetryStrategy declined" in str(info.value)


async def test_best_effort_hedges_past_the_same_failures() -> None:
    send = Sends(
        {
            0: RetryableError(RetryReason.AUTHENTICATION_ERROR),
            1: RetryableError(RetryReason.KV_TEMPORARY_FAILURE),
        }
    )
    with anyio.fail_after(SAFETY):
        with pytest.raises(UnambiguousTimeoutException):
            await RetryOrchestrator().hedge(
                req(BestEffortRetryStrategy(), timeout=0.3), send, HedgePolicy(3, delay=0.02)
            )
    assert send.sent == [0, 1, 2]


async def test_an_always_retry_reason_is_not_asked() -> None:
    asked: list[RetryReason] = []

    class Never(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            asked.append(reason)
            return RetryAction.no_retry()

    send = Sends({0: RetryableError(RetryReason.KV_NOT_MY_VBUCKET)})  # always retry
    with anyio.fail_after(SAFETY):
        with pytest.raises(UnambiguousTimeoutException):
            await RetryOrchestrator().hedge(
                req(Never(), timeout=0.2), send, HedgePolicy(2, delay=0.02)
            )
    assert send.sent == [0, 1]
    assert asked == []


async def test_a_strategy_that_raises_ends_the_hedges_with_its_error() -> None:
    class Broken(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            raise KeyError("config missing")

    send = Sends({0: RetryableError(RetryReason.KV_TEMPORARY_FAILURE)})
    with anyio.fail_after(SAFETY), capture_retry_events() as events, pytest.raises(KeyError):
        await RetryOrchestrator().hedge(req(Broken()), send, HedgePolicy(3, delay=1.0))
    assert send.sent == [0]
    assert [e["event"] for e in events if e["event"].startswith("retry.")] == [
        "retry.strategy_failed"
    ]


async def test_every_copy_failing_logs_not_retried_at_info() -> None:
    send = Sends({i: RetryableError(RetryReason.SERVICE_NOT_AVAILABLE) for i in range(3)})
    with (
        anyio.fail_after(SAFETY),
        capture_retry_events() as events,
        pytest.raises(RequestCanceledException, match="all 3 hedges failed"),
    ):
        await RetryOrchestrator().hedge(req(), send, HedgePolicy(3, delay=0.01))
    ended = [e for e in events if e["event"] == "retry.not_retried"]
    assert len(ended) == 1
    assert ended[0]["log_level"] == "info"
    assert ended[0]["why"] == "hedges_exhausted"
    assert ended[0]["strategy"] == "hedge"
    assert ended[0]["reason"] == "SERVICE_NOT_AVAILABLE"
    assert ended[0]["cancellation_reason"] == "NO_MORE_RETRIES"
    assert ended[0]["detail"] == "all 3 hedges failed"


async def test_a_timeout_with_copies_in_flight_says_so_in_the_event_and_the_error() -> None:
    send = Sends({})  # every copy hangs
    request = req(timeout=0.15)
    with (
        anyio.fail_after(SAFETY),
        capture_retry_events() as events,
        pytest.raises(UnambiguousTimeoutException) as info,
    ):
        await RetryOrchestrator().hedge(request, send, HedgePolicy(2, delay=0.02))
    timed_out = [e for e in events if e["event"] == "retry.timed_out"]
    assert len(timed_out) == 1
    assert timed_out[0]["in_flight"] is True
    assert timed_out[0]["strategy"] == "hedge"
    assert timed_out[0]["caused_by"] == "2 hedge(s) were cut in flight at the deadline"
    assert "after 1 retry, 2 hedge(s) in flight at the deadline" in str(info.value)
    assert "(each copy after the first counts as a retry)" in str(info.value)
    assert info.value.context is not None
    assert info.value.context.in_flight
    assert request.maybe_applied


class NoRobotsPlain(BestEffortRetryStrategy):
    """README's refinement as a plain (synchronous) ``retry_after``."""

    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:  # type: ignore[override]
        if request.client_context.get("isRobotRequest"):
            return RetryAction.no_retry()
        return self.decide(request, reason)


async def test_a_plain_retry_after_refinement_is_asked() -> None:
    send = Sends({0: RetryableError(RetryReason.KV_TEMPORARY_FAILURE)})
    robot = Request(
        name="kv.get",
        idempotent=True,
        timeout=5.0,
        retry_strategy=NoRobotsPlain(),
        client_context={"isRobotRequest": True},
    )
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException, match="declined"):
        await RetryOrchestrator().hedge(robot, send, HedgePolicy(4, delay=1.0))
    assert send.sent == [0]  # refused: not hedged past
    # a request that is not a robot's is hedged past the same failure
    send = Sends({0: RetryableError(RetryReason.KV_TEMPORARY_FAILURE), 1: RuntimeError("end")})
    human = Request(name="kv.get", idempotent=True, timeout=5.0, retry_strategy=NoRobotsPlain())
    with anyio.fail_after(SAFETY), pytest.raises(RuntimeError, match="end"):
        await RetryOrchestrator().hedge(human, send, HedgePolicy(4, delay=1.0))
    assert send.sent == [0, 1]


async def test_a_fast_fail_subclass_wrapping_retry_after_keeps_its_terminal_errors() -> None:
    """Its async retry_after is not run (the chain never waits); its decide answers."""
    audited: list[RetryReason] = []

    class Audited(FastFailOnTerminalErrorRetryStrategy):
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            audited.append(reason)
            return await super().retry_after(request, reason)

    send = Sends({0: RetryableError(RetryReason.AUTHENTICATION_ERROR, "bad password")})
    with anyio.fail_after(SAFETY), pytest.raises(AuthenticationFailureException):
        await RetryOrchestrator().hedge(req(Audited()), send, HedgePolicy(3, delay=1.0))
    assert send.sent == [0]
    assert audited == []  # not run: its decide answered


async def test_an_async_retry_after_is_never_started_by_hedge() -> None:
    """Run up to its first await and then closed, a retry_after that waited on a trio
    Event left the copy's task parked there: setting the event later crashed trio
    (TrioInternalError), and on asyncio the code before the await ran unobserved. It is
    not started at all now; the strategy's decide answers."""
    started: list[bool] = []
    later = anyio.Event()

    class Remote(BestEffortRetryStrategy):
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            started.append(True)  # (a call to a remote service would begin here)
            await later.wait()
            return RetryAction.no_retry()

    send = Sends(
        {0: RetryableError(RetryReason.KV_TEMPORARY_FAILURE), 1: RuntimeError("the second")}
    )
    with anyio.fail_after(SAFETY):
        with pytest.raises(RuntimeError, match="the second"):
            await RetryOrchestrator().hedge(req(Remote()), send, HedgePolicy(3, delay=1.0))
        later.set()
        await anyio.sleep(0.01)  # (trio crashed here)
    assert send.sent == [0, 1]  # BestEffort's decide retries the reason
    assert started == []


async def test_a_bad_refusal_of_a_plain_retry_after_names_retry_after() -> None:
    """The error named ``decide``, a method the strategy does not have, for a refusal
    its plain ``retry_after`` gave (whose exception factory returns no exception)."""

    class Plain:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry(exception=lambda context: 42)  # type: ignore[arg-type,return-value]

    send = Sends({0: RetryableError(RetryReason.KV_LOCKED, "locked")})
    with anyio.fail_after(SAFETY), pytest.raises(TypeError) as info:
        await RetryOrchestrator().hedge(req(Plain()), send, HedgePolicy(2, delay=1.0))
    assert "Plain.retry_after(request, <RetryReason.KV_LOCKED>)" in str(info.value)
    assert "decide" not in str(info.value)
    assert send.sent == [0]


async def test_a_retry_after_answering_nonsense_ends_the_hedges_with_a_type_error() -> None:
    class Forgot(BestEffortRetryStrategy):
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:  # type: ignore[override]
            super().decide(request, reason)  # (the return forgotten)
            return None  # type: ignore[return-value]

    send = Sends({0: RetryableError(RetryReason.KV_TEMPORARY_FAILURE)})
    with (
        anyio.fail_after(SAFETY),
        capture_retry_events() as events,
        pytest.raises(TypeError, match=r"Forgot\.retry_after.*must return a RetryAction"),
    ):
        await RetryOrchestrator().hedge(req(Forgot()), send, HedgePolicy(3, delay=1.0))
    assert send.sent == [0]
    assert [e["event"] for e in events if e["event"] == "retry.strategy_failed"] == [
        "retry.strategy_failed"
    ]


async def test_an_async_decide_is_not_left_unawaited_by_hedge() -> None:
    """A subclass with an ``async def decide`` (execute awaits it): hedge cannot, and raised
    a TypeError naming retry_after, with a coroutine never awaited."""
    import gc
    import warnings

    class AsyncDecide(BestEffortRetryStrategy):
        async def decide(self, request: Request, reason: RetryReason) -> RetryAction:  # type: ignore[override]
            return RetryAction.no_retry()

    send = Sends({0: RetryableError(RetryReason.KV_TEMPORARY_FAILURE), 1: RuntimeError("end")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with anyio.fail_after(SAFETY), pytest.raises(RuntimeError, match="end"):
            await RetryOrchestrator().hedge(req(AsyncDecide()), send, HedgePolicy(3, delay=1.0))
        gc.collect()
    assert send.sent == [0, 1]  # not asked: the policy decided


async def test_request_cancel_with_copies_in_flight_logs_them_as_cut() -> None:
    """retry.cancelled said in_flight=False though Request.cancel() cut three copies (the
    exception's context said true)."""
    blocks = Sends({})  # every copy blocks
    three_out = anyio.Event()

    async def send(request: Request, index: int) -> Any:
        if index == 2:
            three_out.set()
        return await blocks(request, index)

    request = req()
    with anyio.fail_after(SAFETY), capture_retry_events() as events:
        async with anyio.create_task_group() as tg:

            async def cancel_when_three_are_out() -> None:
                await three_out.wait()
                request.cancel()

            tg.start_soon(cancel_when_three_are_out)
            with pytest.raises(RequestCanceledException) as info:
                await RetryOrchestrator().hedge(request, send, HedgePolicy(3, delay=0.01))
    assert info.value.context is not None
    assert info.value.context.in_flight is True
    [event] = [e for e in events if e["event"] == "retry.cancelled"]
    assert event["in_flight"] is True
    assert event["cancellation_reason"] == "CANCELLED_VIA_CONTEXT"


class Fatal(Exception):
    pass


class LooksAtTheError(BestEffortRetryStrategy):
    """Refuses when the failed attempt's cause says "fatal": it reads the request's state."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        error = request.last_error
        self.seen.append((repr(error), len(request.attempts)))
        if error is not None and "fatal" in str(error):
            return RetryAction.no_retry()
        return super().decide(request, reason)


async def test_the_strategy_sees_the_copy_that_just_failed() -> None:
    """As on every other door, the failed copy is booked before the strategy is asked:
    it was asked with the copy before's state (none for the first), so a strategy reading
    the error let copy 0's fatal failure pass and refused copy 1's blaming copy 0's."""
    temp = RetryReason.KV_TEMPORARY_FAILURE
    first = RetryableError(temp, cause=Fatal("fatal: bad key"))
    send = Sends({0: first, 1: RetryableError(temp, cause=Fatal("transient"))})
    strategy = LooksAtTheError()
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().hedge(req(strategy), send, HedgePolicy(3, delay=1.0))
    assert strategy.seen == [("Fatal('fatal: bad key')", 1)]
    assert send.sent == [0]  # refused at copy 0: no copy 1
    assert info.value.__cause__ is first.__cause__


class TaggedAction(RetryAction):
    """An application's RetryAction with a tag of its own (a subclass, as any door takes)."""


class Tags(BestEffortRetryStrategy):
    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        action = super().decide(request, reason)
        return TaggedAction(action.duration, action.exception, why=action.why)


async def test_a_retry_action_subclass_is_a_retry_action_here_too() -> None:
    temp = RetryableError(RetryReason.KV_TEMPORARY_FAILURE)
    send = Sends({0: temp})
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await RetryOrchestrator().hedge(req(Tags(), timeout=0.2), send, HedgePolicy(2, delay=5.0))
    assert send.sent == [0, 1]  # past copy 0's failure at once (A6), as the strategy allowed
