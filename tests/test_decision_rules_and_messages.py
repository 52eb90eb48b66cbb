"""The retry rules in the order ``_decision.decide`` checks them, a server hint blamed only
when it is what passes the deadline, the controlled backoff past its table, what
``after_dispatch`` decides, and error messages that name what was given."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import anyio
import pytest

from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    BestEffortRetryStrategy,
    CouchbaseException,
    FastFailOnTerminalErrorRetryStrategy,
    Request,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
    UnambiguousTimeoutException,
    _backoff,
    controlled_backoff,
)
from sdkcore._context import DEFAULT_EFFECT, CancellationReason
from sdkcore._decision import CONTROLLED_SECONDS, Verdict, decide, spends_budget
from sdkcore.testing import VirtualClock, capture_retry_events

# -- 1. decide / retry_after with a bad argument ---------------------------------------------


def _retryable_error_hint(value: object) -> str:
    """What RetryableError appends for ``value`` (the part after "got ...")."""
    with pytest.raises(TypeError) as info:
        RetryableError(value)  # type: ignore[arg-type]
    return str(info.value).split(f"got {value!r}", 1)[1]


@pytest.mark.parametrize("value", ["kv_locked", "KV_LOCKED", " RetryReason.kv_locked", 3, None])
@pytest.mark.parametrize(
    "strategy", [BestEffortRetryStrategy(), FastFailOnTerminalErrorRetryStrategy()]
)
def test_decide_with_a_bad_reason_ends_as_retryable_error_does(
    strategy: BestEffortRetryStrategy, value: object
) -> None:
    hint = _retryable_error_hint(value)
    assert hint.startswith("; ")
    with pytest.raises(TypeError) as info:
        strategy.decide(Request(idempotent=True), value)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(
        f"{type(strategy).__name__}.decide(request, reason): reason must be an "
        "sdkcore.RetryReason member, got "
    )
    assert message.endswith(hint), message


def test_decide_with_a_lowercase_reason_name_suggests_the_member() -> None:
    with pytest.raises(
        TypeError, match=r"; use RetryReason\.KV_LOCKED, not the string 'kv_locked'$"
    ):
        BestEffortRetryStrategy().decide(Request(idempotent=True), "kv_locked")  # type: ignore[arg-type]


def test_retry_after_with_a_bad_reason_suggests_the_member_too() -> None:
    strategy = BestEffortRetryStrategy()
    with pytest.raises(
        TypeError, match=r"; use RetryReason\.KV_LOCKED, not the string 'kv_locked'$"
    ):
        asyncio.run(strategy.retry_after(Request(idempotent=True), "kv_locked"))  # type: ignore[arg-type]


def test_decide_with_a_bad_request_names_the_request() -> None:
    with pytest.raises(
        TypeError,
        match=r"^BestEffortRetryStrategy\.decide\(request, reason\): request must be an "
        r"sdkcore\.Request, got 'req'$",
    ):
        BestEffortRetryStrategy().decide("req", RetryReason.KV_LOCKED)  # type: ignore[arg-type]


# -- 2. a backoff returning a bad delay ------------------------------------------------------


@pytest.mark.parametrize("delay", [timedelta(seconds=-1), timedelta(microseconds=-1), -1.0, -1])
def test_a_negative_backoff_is_named_as_the_backoff_whatever_its_type(delay: object) -> None:
    strategy = BestEffortRetryStrategy(backoff=lambda attempt: delay)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match=r"^BestEffortRetryStrategy: backoff\(0\)") as info:
        strategy.decide(Request(idempotent=True), RetryReason.KV_LOCKED)
    message = str(info.value)
    assert message == f"BestEffortRetryStrategy: backoff(0) must be >= 0 seconds, got {delay!r}"
    assert "with_duration" not in message


@pytest.mark.anyio
async def test_a_negative_timedelta_backoff_through_a_door_names_the_backoff() -> None:
    class Mine(BestEffortRetryStrategy):
        pass

    orch = RetryOrchestrator(Mine(backoff=lambda attempt: timedelta(seconds=-2)))
    with pytest.raises(ValueError, match=r"^Mine: backoff\(0\) must be >= 0 seconds, got "):
        await orch.maybe_retry(Request(idempotent=True), RetryReason.KV_LOCKED)


def test_a_backoff_returning_none_says_to_refuse_from_decide_or_retry_after() -> None:
    strategy = BestEffortRetryStrategy(backoff=lambda attempt: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError) as info:
        strategy.decide(Request(idempotent=True), RetryReason.KV_LOCKED)
    message = str(info.value)
    assert message.endswith(
        "(to stop retrying, return RetryAction.no_retry() from decide (or retry_after) instead)"
    ), message


def test_a_good_timedelta_backoff_keeps_its_timedelta() -> None:
    delay = timedelta(milliseconds=3)
    strategy = BestEffortRetryStrategy(backoff=lambda attempt: delay)
    action = strategy.decide(Request(idempotent=True), RetryReason.KV_LOCKED)
    assert action.duration == delay
    assert action.seconds == 0.003


# -- 3. RetryAction given a duration and a refusal's field -----------------------------------


def test_retry_action_with_a_duration_and_an_exception_says_what_was_given() -> None:
    with pytest.raises(ValueError, match=r"^RetryAction\(exception=\.\.\.\)") as info:
        RetryAction(timedelta(seconds=1), CouchbaseException)  # type: ignore[arg-type]
    assert str(info.value) == (
        "RetryAction(exception=...): only a refusal (duration=None) takes an exception, got "
        "exception=<class 'sdkcore.CouchbaseException'> with "
        "duration=datetime.timedelta(seconds=1); refuse with RetryAction.no_retry(exception) "
        "instead"
    )


def test_retry_action_with_a_duration_and_why_says_what_was_given() -> None:
    with pytest.raises(ValueError, match=r"^RetryAction\(why=\.\.\.\)") as info:
        RetryAction(timedelta(milliseconds=5), why="tired")
    assert str(info.value) == (
        "RetryAction(why=...): only a refusal (duration=None) takes why, got why='tired' with "
        "duration=datetime.timedelta(microseconds=5000); refuse with "
        "RetryAction.no_retry(why=...) instead"
    )


# -- 4a. the rules of decide(), in the order the docstring lists them ------------------------

_REFUSE = RetryAction.no_retry()
_WAIT = RetryAction.with_duration(0.5)


def test_rule_1_the_effect_comes_before_always_retry() -> None:
    assert decide(
        RetryReason.KV_NOT_MY_VBUCKET, None, 0, False, 10.0, 0, 10, maybe_applied=True
    ) == (Verdict.NOT_IDEMPOTENT, 0.0)


def test_rule_2_always_retry_skips_the_flag_and_the_strategy() -> None:
    # an always-retry reason is retried without the strategy's action (None)
    verdict, delay = decide(RetryReason.KV_NOT_MY_VBUCKET, None, 0, False, 10.0, 0, 10)
    assert (verdict, delay) == (Verdict.RETRY, 0.001)


def test_rule_3_the_flag_comes_before_the_strategy_refusal() -> None:
    reason = RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT  # does not allow a non-idempotent retry
    assert decide(reason, _REFUSE, 0, False, 10.0, 0, 10) == (Verdict.NOT_IDEMPOTENT, 0.0)


def test_rule_4_the_refusal_comes_before_backpressure() -> None:
    assert decide(RetryReason.KV_LOCKED, _REFUSE, 0, True, 10.0, 10, 10) == (
        Verdict.REFUSED,
        0.0,
    )


def test_rule_5_backpressure_comes_before_the_hint() -> None:
    assert decide(RetryReason.KV_LOCKED, _WAIT, 0, True, 1.0, 10, 10, hint=5.0) == (
        Verdict.TOO_MANY,
        0.0,
    )


def test_rule_6_the_hint_comes_before_capping() -> None:
    # the backoff alone reaches the deadline too, but the hint is what the request names
    assert decide(RetryReason.KV_LOCKED, _WAIT, 0, True, 0.2, 0, 10, hint=0.3) == (
        Verdict.HINT_PAST_DEADLINE,
        0.0,
    )


# -- 4b. a hint is blamed only when it is what passes the deadline ---------------------------


@pytest.mark.parametrize("time_left", [0.0, -1.0])
@pytest.mark.parametrize("hint", [0.0, 0.5])
def test_no_time_left_is_a_plain_timeout_whatever_the_hint(time_left: float, hint: float) -> None:
    assert decide(RetryReason.KV_LOCKED, _WAIT, 0, True, time_left, 0, 10, hint=hint) == (
        Verdict.TIME_OUT,
        0.0,
    )


def test_a_hint_reaching_the_deadline_while_time_is_left_is_blamed() -> None:
    assert decide(RetryReason.KV_LOCKED, _WAIT, 0, True, 0.5, 0, 10, hint=0.5) == (
        Verdict.HINT_PAST_DEADLINE,
        0.0,
    )
    assert decide(RetryReason.KV_LOCKED, _WAIT, 0, True, 0.5, 0, 10, hint=0.0)[0] is (
        Verdict.TIME_OUT  # the backoff (0.5 s), not the hint, reaches the deadline
    )


async def _maybe_retry_past_deadline(**kwargs: Any) -> TimeoutException:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, timeout=1, clock=clock.clock)
    clock.advance(2)  # the deadline has passed when the attempt's failure is handed over
    with pytest.raises(TimeoutException) as info:
        await orch.maybe_retry(request, RetryReason.KV_LOCKED, **kwargs)
    return info.value


@pytest.mark.anyio
async def test_maybe_retry_with_a_zero_hint_past_the_deadline_is_the_plain_timeout() -> None:
    hinted = await _maybe_retry_past_deadline(retry_after=0)
    plain = await _maybe_retry_past_deadline()
    assert type(hinted) is UnambiguousTimeoutException
    assert "retry_after from" not in hinted.message
    assert "may go only in" not in hinted.message
    assert hinted.message == plain.message


@pytest.mark.anyio
async def test_execute_with_a_zero_hint_past_the_deadline_is_the_plain_timeout() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)

    async def send(request: Request) -> bytes:
        clock.advance(2)  # the attempt fails after the deadline (1 s)
        raise RetryableError(RetryReason.KV_LOCKED, "busy", retry_after=0)

    request = Request(name="kv.get", idempotent=True, timeout=1, clock=clock.clock)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(request, send)
    assert "retry_after from" not in info.value.message, info.value.message


@pytest.mark.anyio
async def test_a_hint_that_passes_the_deadline_is_still_named() -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, timeout=1, clock=clock.clock)
    clock.advance(0.7)  # 0.3 s left; the server asks for 0.5 s
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.maybe_retry(request, RetryReason.KV_LOCKED, retry_after=0.5)
    assert "may go only in 0.500 s (retry_after from the server)" in info.value.message
    assert clock.sleeps == []  # timed out at once


# -- 5. the controlled-backoff table's length ------------------------------------------------


def test_controlled_seconds_follow_controlled_backoff_past_the_table() -> None:
    assert len(CONTROLLED_SECONDS) == _backoff.CONTROLLED_STEPS + 1
    for n in range(_backoff.CONTROLLED_STEPS + 4):
        _, delay = decide(RetryReason.KV_NOT_MY_VBUCKET, None, n, True, 100.0, 0, 10)
        assert delay == controlled_backoff(n).total_seconds(), n


# -- 6. after_dispatch decides the default effect --------------------------------------------


@pytest.mark.parametrize("reason", list(RetryReason), ids=lambda r: r.name)
def test_after_dispatch_decides_the_default_effect_and_the_budget(reason: RetryReason) -> None:
    effect = DEFAULT_EFFECT[reason]
    assert (effect is AttemptEffect.NOT_SENT) is (not reason.after_dispatch)
    assert spends_budget(effect) is reason.after_dispatch


@pytest.mark.anyio
@pytest.mark.parametrize(
    "reason", [RetryReason.SOCKET_NOT_AVAILABLE, RetryReason.KV_LOCKED], ids=lambda r: r.name
)
async def test_after_dispatch_decides_reached_network(reason: RetryReason) -> None:
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request = Request(idempotent=True, timeout=10, clock=clock.clock)
    await orch.maybe_retry(request, reason)
    assert request.reached_network is reason.after_dispatch


# -- 7. the exceptions' docstrings -----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("idempotent", "expected"),
    [(False, AmbiguousTimeoutException), (True, UnambiguousTimeoutException)],
)
async def test_a_cut_attempt_is_ambiguous_only_when_not_idempotent(
    idempotent: bool, expected: type[TimeoutException]
) -> None:
    async def send(request: Request) -> bytes:
        await anyio.sleep(10)  # cut at the deadline: maybe applied
        return b""

    request = Request(name="upsert", idempotent=idempotent, timeout=0.05)
    with pytest.raises(TimeoutException) as info:
        await RetryOrchestrator().execute(request, send)
    assert type(info.value) is expected
    assert request.maybe_applied


@pytest.mark.anyio
async def test_a_timed_out_request_handed_back_times_out_again() -> None:
    """What the RequestCanceledException docstring says of TIMEOUT: never "cancelled"."""
    clock = VirtualClock()
    orch = RetryOrchestrator(sleep=clock.sleep)
    request = Request(idempotent=True, timeout=1, clock=clock.clock)
    clock.advance(2)
    with pytest.raises(TimeoutException):
        await orch.maybe_retry(request, RetryReason.KV_LOCKED)
    with pytest.raises(UnambiguousTimeoutException, match="timed out already") as info:
        await orch.maybe_retry(request, RetryReason.KV_LOCKED)
    assert info.value.context is not None
    assert info.value.context.cancellation_reason is CancellationReason.TIMEOUT


@pytest.mark.anyio
async def test_a_capped_retry_says_what_was_asked_for() -> None:
    """A strategy's timedelta(500) (500 days, meant as ms) capped at the deadline: the event
    said only the capped delay, so the mistake could not be seen."""

    class Days(BestEffortRetryStrategy):
        def decide(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(timedelta(500))

    clock = VirtualClock()
    request = Request(name="kv.get", idempotent=True, timeout=0.2, clock=clock.clock)

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED)

    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException):
        await RetryOrchestrator(Days(), sleep=clock.sleep).execute(request, send)
    (scheduled,) = [e for e in events if e["event"] == "retry.scheduled"]
    assert scheduled["capped"] is True
    assert scheduled["delay_ms"] == pytest.approx(200.0)
    assert scheduled["requested_delay_ms"] == 500 * 86400 * 1000.0
