"""Every failure a complete bug report: what the exception, its context and the logs say.

Each test here failed before the change it covers (see CHANGELOG, "Every failure a
complete bug report").
"""

from __future__ import annotations

import asyncio
import math
import pickle
import time
from datetime import timedelta
from typing import Any

import anyio
import pytest

import sdkcore
from sdkcore import (
    AmbiguousTimeoutException,
    AttemptEffect,
    BestEffortRetryStrategy,
    DocumentNotFoundException,
    FastFailOnTerminalErrorRetryStrategy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore._context import client_context_text
from sdkcore.testing import ScriptedSend, VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio


class ServerSaid(Exception):
    """Stands for a driver's exception (a status from the server)."""


# -- 7. a timeout keeps the last attempt's error ---------------------------------------
async def test_timeout_cause_is_the_last_failure_and_context_lists_attempts() -> None:
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.1), sleep=vc.sleep)
    causes = [ServerSaid("locked #1"), ServerSaid("locked #2"), ServerSaid("tmpfail #3")]
    calls = 0

    async def send(request: Request) -> bytes:
        nonlocal calls
        cause = causes[min(calls, 2)]
        calls += 1
        reason = RetryReason.KV_TEMPORARY_FAILURE if calls >= 3 else RetryReason.KV_LOCKED
        raise RetryableError(reason) from cause

    req = Request(name="kv.replace", idempotent=False, timeout=0.25, clock=vc.clock)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(req, send)
    exc = info.value
    assert exc.__cause__ is causes[2]
    ctx = exc.context
    assert ctx is not None
    assert ctx.last_error == "ServerSaid: tmpfail #3"
    assert ctx.in_flight is False
    assert [a.number for a in ctx.attempts] == [1, 2, 3]
    assert [a.reason for a in ctx.attempts] == [
        RetryReason.KV_LOCKED,
        RetryReason.KV_LOCKED,
        RetryReason.KV_TEMPORARY_FAILURE,
    ]
    assert [a.error for a in ctx.attempts] == [
        "ServerSaid: locked #1",
        "ServerSaid: locked #2",
        "ServerSaid: tmpfail #3",
    ]
    assert [a.delay.total_seconds() if a.delay else None for a in ctx.attempts] == [
        0.1,
        0.1,
        pytest.approx(0.05),  # capped at the deadline
    ]
    assert all(a.duration is not None for a in ctx.attempts)
    # the JSON a user pastes into a bug report has all of it
    text = str(exc)
    assert '"last_error": "ServerSaid: tmpfail #3"' in text
    assert '"attempts": [{"attempt": 1, "reason": "KV_LOCKED", "effect": "not_applied"' in text
    # and it survives pickling (exceptions cross process boundaries in test runners)
    again = pickle.loads(pickle.dumps(exc))
    assert again.context == ctx


async def test_in_flight_cut_is_reported_and_cause_is_the_previous_failure() -> None:
    first = ServerSaid("socket closed")
    calls = 0

    async def send(request: Request) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RetryableError(RetryReason.KV_TEMPORARY_FAILURE) from first
        await anyio.sleep(10)  # the deadline cuts it
        return b""

    req = Request(name="get", idempotent=True, timeout=0.1)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await RetryOrchestrator().execute(req, send)
    assert info.value.__cause__ is first
    ctx = info.value.context
    assert ctx is not None
    assert ctx.in_flight is True
    assert ctx.last_error == "ServerSaid: socket closed"
    assert [(a.reason, a.effect) for a in ctx.attempts] == [
        (RetryReason.KV_TEMPORARY_FAILURE, AttemptEffect.NOT_APPLIED),
        (None, AttemptEffect.MAYBE_APPLIED),
    ]
    assert ctx.attempts[1].duration is not None


async def test_a_cut_with_no_failure_before_has_no_cancellation_as_cause() -> None:
    async def send(request: Request) -> bytes:
        await anyio.sleep(10)
        return b""

    req = Request(name="upsert", idempotent=False, timeout=0.05)
    with pytest.raises(AmbiguousTimeoutException) as info:
        await RetryOrchestrator().execute(req, send)
    assert info.value.__cause__ is None
    assert info.value.context is not None
    assert info.value.context.in_flight is True


async def test_non_retryable_answer_gets_the_request_context() -> None:
    async def send(request: Request) -> bytes:
        raise DocumentNotFoundException("no such key")

    req = Request(name="get", idempotent=True)
    with pytest.raises(DocumentNotFoundException) as info:
        await RetryOrchestrator().execute(req, send)
    ctx = info.value.context
    assert ctx is not None
    assert ctx.request_id == req.id
    assert ctx.last_error == "DocumentNotFoundException: no such key"


def test_retryable_error_repr_shows_its_reason() -> None:
    assert repr(RetryableError(RetryReason.KV_LOCKED)) == "RetryableError(RetryReason.KV_LOCKED)"
    err = RetryableError(RetryReason.UNKNOWN, "boom", effect=AttemptEffect.NOT_SENT)
    assert repr(err) == "RetryableError(RetryReason.UNKNOWN, 'boom', effect=AttemptEffect.NOT_SENT)"
    again = pickle.loads(pickle.dumps(err))
    assert (again.reason, again.effect, str(again)) == (err.reason, err.effect, str(err))


def test_retryable_error_rejects_a_bad_effect() -> None:
    with pytest.raises(TypeError, match="effect must be an AttemptEffect"):
        RetryableError(RetryReason.KV_LOCKED, effect="maybe")  # type: ignore[arg-type]


# -- 2. ambiguity never overclaims ---------------------------------------------------------
@pytest.mark.parametrize(
    ("effects", "idempotent", "expected"),
    [
        ([AttemptEffect.NOT_SENT], False, UnambiguousTimeoutException),
        ([AttemptEffect.NOT_APPLIED, AttemptEffect.NOT_SENT], False, UnambiguousTimeoutException),
        # A maybe-applied attempt ends a non-idempotent request at once (never sent again):
        # no timeout at all (tests/test_effect_decides.py).
        (
            [AttemptEffect.NOT_APPLIED, AttemptEffect.MAYBE_APPLIED],
            False,
            RequestCanceledException,
        ),
        ([AttemptEffect.MAYBE_APPLIED], True, UnambiguousTimeoutException),
    ],
)
async def test_ambiguity_table(
    effects: list[AttemptEffect], idempotent: bool, expected: type[Exception]
) -> None:
    """rfc/0001 "Ambiguity": ambiguous iff not idempotent and some attempt may be applied."""
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 1.0), sleep=vc.sleep)
    script = iter(effects)

    async def send(request: Request) -> bytes:
        effect = next(script, effects[-1])
        raise RetryableError(RetryReason.SERVICE_NOT_AVAILABLE, effect=effect)

    req = Request(idempotent=idempotent, timeout=len(effects) + 0.5, clock=vc.clock)
    with pytest.raises(expected):
        await orch.execute(req, send)


async def test_unknown_then_a_hanging_strategy_is_ambiguous_with_its_reason() -> None:
    """Issue point 16: the attempt is recorded before the strategy is consulted."""

    class Hangs:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            await anyio.sleep(10)
            return RetryAction.no_retry()

    async def send(request: Request) -> bytes:
        raise RetryableError(RetryReason.UNKNOWN) from ServerSaid("connection reset")

    req = Request(name="upsert", idempotent=False, timeout=0.1, retry_strategy=Hangs())
    with pytest.raises(AmbiguousTimeoutException) as info:
        await RetryOrchestrator().execute(req, send)
    ctx = info.value.context
    assert ctx is not None
    assert ctx.reason is RetryReason.UNKNOWN
    assert ctx.last_error == "ServerSaid: connection reset"
    assert isinstance(info.value.__cause__, ServerSaid)


# -- 15. maybe_retry: the deadline bounds a strategy that never answers -------------------
async def test_maybe_retry_bounds_a_hanging_strategy_by_the_deadline() -> None:
    class Hangs:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    req = Request(name="get", idempotent=True, timeout=0.1, retry_strategy=Hangs())
    with anyio.fail_after(2):  # before the fix: still waiting here
        with pytest.raises(UnambiguousTimeoutException) as info:
            await RetryOrchestrator().maybe_retry(req, RetryReason.KV_LOCKED)
    assert info.value.context is not None
    assert info.value.context.reason is RetryReason.KV_LOCKED
    assert req.cancellation_reason is sdkcore.CancellationReason.TIMEOUT


async def test_maybe_retry_hanging_strategy_still_honours_request_cancel() -> None:
    class Hangs:
        async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            request.cancel()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    req = Request(name="get", idempotent=True, timeout=5, retry_strategy=Hangs())
    with anyio.fail_after(2), pytest.raises(RequestCanceledException):
        await RetryOrchestrator().maybe_retry(req, RetryReason.KV_LOCKED)


# -- 3. a backoff returning None -----------------------------------------------------------
async def test_backoff_returning_none_is_a_clear_error() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: None))  # type: ignore[arg-type, return-value]
    req = Request(idempotent=True)
    with pytest.raises(TypeError, match=r"backoff\(0\) returned None"):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert req.state is sdkcore.RequestState.FAILED


# -- 4. the first call's deadline -----------------------------------------------------------
async def test_deadline_is_armed_after_the_loop_clock_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first ``anyio.current_time()`` of a process imports the backend (slow): the time
    it takes must not be added to the deadline."""
    real = anyio.current_time
    slow_once = [True]

    def slow_current_time() -> float:
        if slow_once[0]:
            slow_once[0] = False
            import time

            time.sleep(0.15)  # what a first backend import costs, exaggerated
        return real()

    monkeypatch.setattr(anyio, "current_time", slow_current_time)

    async def send(request: Request) -> bytes:
        await anyio.sleep(10)
        return b""

    req = Request(idempotent=True, timeout=0.1)
    with pytest.raises(UnambiguousTimeoutException):
        await RetryOrchestrator().execute(req, send)
    # Before the fix the scope ran 0.1 s *after* the slow call: elapsed >= 0.25 s.
    assert req.elapsed.total_seconds() < 0.23


# -- 8. what the logs say --------------------------------------------------------------------
async def test_every_retry_event_says_what_failed() -> None:
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.1), sleep=vc.sleep)

    async def send(request: Request) -> bytes:
        raise RetryableError(RetryReason.KV_LOCKED) from ServerSaid("locked by another txn")

    req = Request(name="kv.get", idempotent=True, timeout=0.25, clock=vc.clock)
    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException):
        await orch.execute(req, send)
    assert [e["event"] for e in events] == [
        "retry.scheduled",
        "retry.scheduled",
        "retry.scheduled",
        "retry.timed_out",
    ]
    assert all(e["caused_by"] == "ServerSaid: locked by another txn" for e in events)
    # attempt: the 1-based number of the attempt the event is about
    assert [e["attempt"] for e in events] == [1, 2, 3, 3]


@pytest.mark.parametrize(
    "strategy", [BestEffortRetryStrategy(), FastFailOnTerminalErrorRetryStrategy()]
)
async def test_refusal_for_idempotency_says_so_whichever_strategy(strategy: Any) -> None:
    req = Request(name="kv.upsert", idempotent=False, retry_strategy=strategy)
    with capture_retry_events() as events, pytest.raises(RequestCanceledException) as info:
        await RetryOrchestrator().maybe_retry(
            req, RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, cause=ServerSaid("EOF")
        )
    assert "not idempotent" in info.value.message
    assert isinstance(info.value.__cause__, ServerSaid)
    (event,) = events
    assert event["event"] == "retry.not_retried"
    assert event["why"] == "not_idempotent"
    assert event["caused_by"] == "ServerSaid: EOF"
    assert event["attempt"] == 1


async def test_unsafe_custom_strategy_refusal_also_says_idempotency() -> None:
    class Always:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(0)

    req = Request(name="kv.upsert", idempotent=False, retry_strategy=Always())
    with capture_retry_events() as events, pytest.raises(RequestCanceledException):
        await RetryOrchestrator().maybe_retry(req, RetryReason.UNKNOWN)
    assert events[-1]["why"] == "not_idempotent"


async def test_grpc_style_errors_are_described_with_status_and_details() -> None:
    class FakeStatus:
        name = "UNAVAILABLE"

    class AioRpcError(Exception):
        def code(self) -> FakeStatus:
            return FakeStatus()

        def details(self) -> str:
            return "connection refused"

    assert sdkcore.describe_error(AioRpcError()) == "AioRpcError: UNAVAILABLE: connection refused"
    assert sdkcore.describe_error(ValueError("x" * 1000)) is not None
    assert len(sdkcore.describe_error(ValueError("x" * 1000)) or "") < 520


# -- 10. API polish -------------------------------------------------------------------------
def test_version_and_reprs() -> None:
    assert sdkcore.__version__ == "0.1.0.dev0"
    assert "__version__" in sdkcore.__all__
    text = repr(RetryOrchestrator(max_requests_in_retry=7))
    assert text.startswith(
        "<RetryOrchestrator default_strategy=FastFailOnTerminalErrorRetryStrategy("
    )
    assert "requests_in_retry=0/7" in text


def test_fail_fast_is_internal() -> None:
    assert "FailFastRetryStrategy" not in sdkcore.__all__
    assert "Internal" in (sdkcore.FailFastRetryStrategy.__doc__ or "")
    # named where it is imported from, in reprs and error messages (not sdkcore._strategy)
    assert sdkcore.FailFastRetryStrategy.__module__ == "sdkcore"


def test_the_throttles_default_is_public_to_extend() -> None:
    """rfc/0009 tells users to write ``default_is_rejection(e) or ...``: importable."""
    from sdkcore import AdaptiveThrottle, default_is_rejection

    assert "default_is_rejection" in sdkcore.__all__
    assert default_is_rejection(RetryableError(RetryReason.KV_TEMPORARY_FAILURE))
    assert not default_is_rejection(TimeoutError("slow"))
    throttle = AdaptiveThrottle(
        is_rejection=lambda e: default_is_rejection(e) or isinstance(e, TimeoutError)
    )
    with pytest.raises(TimeoutError), throttle.guard():
        raise TimeoutError("slow")
    assert throttle.accepts == 0


async def test_a_sync_send_given_to_execute_is_a_clear_type_error() -> None:
    def send(request: Request) -> bytes:  # forgot "async"
        return b"value"

    req = Request()
    with pytest.raises(TypeError, match=r"async def send\(request\).*execute_sync"):
        await RetryOrchestrator().execute(req, send)  # type: ignore[arg-type]
    assert req.state is sdkcore.RequestState.FAILED


async def test_virtual_sleep_with_a_real_clock_request_is_a_clear_error() -> None:
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=vc.sleep)
    req = Request(idempotent=True, timeout=1)  # forgot clock=vc.clock
    with pytest.raises(ValueError, match=r"Request\(clock=<the same clock>.clock\)"):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)


async def test_loop_deadline_is_on_the_event_loop_clock() -> None:
    req = Request(timeout=2)
    left = req.loop_deadline() - anyio.current_time()
    assert 1.5 < left <= 2.0
    assert Request(timeout=None).loop_deadline() == math.inf


async def test_mapper_exception_carries_the_full_request_context() -> None:
    from sdkcore.mapping import KvOpcode, KvStatus, kv_failure, kv_request, raise_failure

    statuses = [KvStatus.TEMPORARY_FAILURE, KvStatus.KEY_NOT_FOUND]

    async def send(request: Request) -> bytes:
        raise_failure(kv_failure(statuses.pop(0), KvOpcode.GET), request=request)

    req = kv_request(KvOpcode.GET)
    with pytest.raises(DocumentNotFoundException) as info:
        await RetryOrchestrator().execute(req, send)
    ctx = info.value.context
    assert ctx is not None
    assert ctx.request_id == req.id
    assert len(ctx.attempts) == 2
    # the error is described by its message, not its whole context again
    assert ctx.last_error == "DocumentNotFoundException: document not found (KV status 0x01 " + (
        "KEY_NOT_FOUND on GET)"
    )


async def test_a_retried_call_leaves_no_reference_cycle() -> None:
    """The recorded failures must not keep the request alive through their tracebacks
    (a cycle per retried call would be left to the cyclic garbage collector)."""
    import gc
    import weakref

    send: ScriptedSend[bytes] = ScriptedSend(
        [RetryReason.KV_LOCKED, RetryReason.KV_LOCKED, b"value"]
    )
    request = Request(name="get", idempotent=True, timeout=None)
    ref = weakref.ref(request)
    gc.disable()
    try:
        assert await RetryOrchestrator().execute(request, send) == b"value"
        assert [a.error for a in request.attempts] == ["RetryableError: KV_LOCKED"] * 2
        del request
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


# -- operator review: what retry.timed_out, retry.not_retried and breaker.* say -----------
# Each test below failed before the change it covers.


def _timed_out(events: list[Any]) -> dict[str, Any]:
    (event,) = [e for e in events if e["event"] == "retry.timed_out"]
    return dict(event)


async def test_a_cut_in_flight_is_not_blamed_on_the_attempt_before_it() -> None:
    """The demo's ``retry.timed_out in_flight=True reason=CONCURRENCY_LIMITED``: the
    request timed out at a slow server, but the event named the earlier refusal."""
    calls = 0

    async def send(request: Request) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RetryableError(RetryReason.CONCURRENCY_LIMITED, "20 in flight, limit 20")
        await anyio.sleep(10)  # the slow server: the deadline cuts it
        return b""

    req = Request(name="kv.set", idempotent=False, timeout=0.1)
    with capture_retry_events() as events, pytest.raises(AmbiguousTimeoutException) as info:
        await RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0)).execute(req, send)
    event = _timed_out(events)
    assert event["in_flight"] is True
    assert event["reason"] is None  # the cut attempt failed with no reason of its own
    assert event["caused_by"] == "attempt 2 was cut in flight at the deadline"
    assert event["attempt"] == 2
    # the earlier failure is kept, under its own names
    assert event["previous_reason"] == "CONCURRENCY_LIMITED"
    assert event["previous_error"] == "RetryableError: CONCURRENCY_LIMITED: 20 in flight, limit 20"
    assert event["ambiguous"] is True
    assert event["maybe_applied"] is True
    assert event["effect"] == "MAYBE_APPLIED"
    assert event["timeout_ms"] == 100.0
    assert isinstance(event["elapsed_ms"], float)
    assert event["elapsed_ms"] > 0.0
    # the fields dashboards already read are all still there
    assert {"request_id", "request_name", "idempotent", "strategy"} <= event.keys()
    # the context does not blame the earlier attempt either: its attempts tell the story
    ctx = info.value.context
    assert ctx is not None
    assert ctx.reason is None
    assert ctx.in_flight is True
    assert [(a.reason, a.effect) for a in ctx.attempts] == [
        (RetryReason.CONCURRENCY_LIMITED, AttemptEffect.NOT_SENT),
        (None, AttemptEffect.MAYBE_APPLIED),
    ]
    # and the headline says what happened
    assert info.value.message == (
        "request timed out after 1 retry (last: CONCURRENCY_LIMITED), attempt 2 in flight at "
        "the deadline; it may have been applied on the server (ambiguous)"
    )


async def test_a_first_attempt_cut_in_flight_has_no_previous_failure() -> None:
    async def send(request: Request) -> bytes:
        await anyio.sleep(10)
        return b""

    req = Request(name="kv.get", idempotent=True, timeout=0.05)
    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException) as info:
        await RetryOrchestrator().execute(req, send)
    event = _timed_out(events)
    assert event["caused_by"] == "attempt 1 was cut in flight at the deadline"
    assert (event["previous_reason"], event["previous_error"]) == (None, None)
    assert event["maybe_applied"] is True
    assert info.value.message == (
        "request timed out after 0 retries, attempt 1 in flight at the deadline; it may have "
        "reached the server, but it is idempotent, so it is safe to retry (unambiguous)"
    )


def test_execute_sync_an_error_past_the_deadline_is_the_cause_not_the_reason_before() -> None:
    """execute_sync: an attempt that raised a plain error past the deadline (a socket
    timeout) timed out naming the previous attempt's reason."""
    calls = 0

    def send(request: Request) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RetryableError(RetryReason.KV_LOCKED) from ServerSaid("locked")
        left = request.time_left
        assert left is not None
        time.sleep(left.total_seconds() + 0.01)  # blocked until past the deadline
        raise TimeoutError("socket timed out")

    req = Request(name="kv.get", idempotent=True, timeout=0.1)
    strategy = BestEffortRetryStrategy(backoff=lambda n: 0.0)
    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException) as info:
        RetryOrchestrator(strategy).execute_sync(req, send)
    event = _timed_out(events)
    assert event["in_flight"] is True
    assert event["reason"] is None
    assert event["caused_by"] == "TimeoutError: socket timed out"
    assert event["previous_reason"] == "KV_LOCKED"
    assert event["previous_error"] == "ServerSaid: locked"
    assert info.value.context is not None
    assert info.value.context.reason is None


async def test_timed_out_in_backoff_says_whether_it_may_have_been_applied() -> None:
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.1), sleep=vc.sleep)
    send: ScriptedSend[Any] = ScriptedSend([RetryReason.KV_LOCKED])
    req = Request(name="kv.replace", idempotent=False, timeout=0.25, clock=vc.clock)
    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException):
        await orch.execute(req, send)
    event = _timed_out(events)
    assert event["in_flight"] is False
    assert event["reason"] == "KV_LOCKED"
    assert event["caused_by"] == "RetryableError: KV_LOCKED"
    assert (event["ambiguous"], event["maybe_applied"]) == (False, False)
    assert event["effect"] == "NOT_APPLIED"
    assert event["timeout_ms"] == 250.0
    assert event["elapsed_ms"] == pytest.approx(250.0)
    assert "previous_reason" not in event  # only a cut has an attempt before "the" attempt


def test_timed_out_without_a_timeout_of_its_own_says_none() -> None:
    """A request built with timeout=None inside another's send inherits its deadline:
    its event says it had no timeout of its own."""

    def inner_send(request: Request) -> bytes:
        left = request.time_left
        assert left is not None  # the outer request's deadline
        time.sleep(left.total_seconds() + 0.01)
        raise TimeoutError("socket timed out")

    def outer_send(request: Request) -> bytes:
        inner = Request(name="inner", idempotent=True, timeout=None)
        return RetryOrchestrator().execute_sync(inner, inner_send)

    outer = Request(name="outer", idempotent=True, timeout=0.05)
    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException):
        RetryOrchestrator().execute_sync(outer, outer_send)
    by_name = {e["request_name"]: e for e in events if e["event"] == "retry.timed_out"}
    assert by_name["inner"]["timeout_ms"] is None
    assert by_name["outer"]["timeout_ms"] == 50.0
    assert by_name["outer"]["caused_by"].startswith("UnambiguousTimeoutException: request timed")


# -- the timeout's headline names how many retries and the last reason ----------------------
async def test_timeout_headline_names_the_retries_and_the_last_reason() -> None:
    """BestEffort with wrong credentials: AUTHENTICATION_ERROR was only in the JSON."""
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.1), sleep=vc.sleep)

    async def send(request: Request) -> bytes:
        raise RetryableError(
            RetryReason.AUTHENTICATION_ERROR, "wrong password", effect=AttemptEffect.NOT_APPLIED
        )

    req = Request(name="get", idempotent=True, timeout=1.0, clock=vc.clock)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(req, send)
    retries = req.retry_attempts
    assert retries == 10
    assert info.value.message == (
        "request timed out after 10 retries (last: AUTHENTICATION_ERROR; the last retry was due "
        "past the deadline, not sent); it was not applied on the server (unambiguous)"
    )
    assert str(info.value).startswith(info.value.message + " {")  # the context follows


async def test_a_hint_past_the_deadline_headline_names_the_retries() -> None:
    vc = VirtualClock()
    orch = RetryOrchestrator(BestEffortRetryStrategy(), sleep=vc.sleep)

    async def send(request: Request) -> bytes:
        raise RetryableError(RetryReason.KV_LOCKED, retry_after=30)

    req = Request(name="kv.get", idempotent=True, timeout=1.0, clock=vc.clock)
    with pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(req, send)
    assert info.value.message.startswith(
        "request timed out after 0 retries (last: KV_LOCKED): the next attempt may go only in "
        "30.000 s"
    )


# -- retry.not_retried says whether a write may have been applied ---------------------------
@pytest.mark.parametrize(
    ("reason", "effect", "maybe_applied"),
    [
        (RetryReason.SOCKET_CLOSED_WHILE_IN_FLIGHT, "MAYBE_APPLIED", True),
        (RetryReason.KV_LOCKED, "NOT_APPLIED", False),
        (RetryReason.NODE_NOT_AVAILABLE, "NOT_SENT", False),
    ],
)
async def test_not_retried_says_whether_it_may_have_been_applied(
    reason: RetryReason, effect: str, maybe_applied: bool
) -> None:
    orch = RetryOrchestrator(FastFailOnTerminalErrorRetryStrategy())

    class Declines:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry()

    req = Request(name="kv.upsert", idempotent=False, retry_strategy=Declines())
    with capture_retry_events() as events, pytest.raises(RequestCanceledException):
        await orch.maybe_retry(req, reason, cause=ServerSaid("no"))
    (event,) = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["maybe_applied"] is maybe_applied
    assert event["ambiguous"] is maybe_applied  # not idempotent: a write that may have run
    assert event["effect"] == effect
    assert event["timeout_ms"] == 2500.0
    assert event["elapsed_ms"] >= 0.0
    assert event["caused_by"] == "ServerSaid: no"  # the existing fields stay


# -- a refusal's exception factory that returns no exception --------------------------------
class _BadFactory:
    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.no_retry(_not_an_exception)


def _not_an_exception(context: Any) -> Any:
    return "not an exception"


async def test_a_factory_returning_no_exception_names_the_strategy_and_the_factory() -> None:
    req = Request(idempotent=True, retry_strategy=_BadFactory())
    with pytest.raises(TypeError) as info:
        await RetryOrchestrator().maybe_retry(req, RetryReason.KV_LOCKED)
    text = str(info.value)
    assert "_BadFactory.retry_after(request, <RetryReason.KV_LOCKED>) refused with" in text
    assert "RetryAction.no_retry(exception=_not_an_exception)" in text
    assert "returned 'not an exception' (str)" in text
    assert "must return an exception instance" in text
    assert "derive from BaseException" not in text


def _locked(request: Request) -> bytes:
    raise RetryableError(RetryReason.KV_LOCKED)


def test_a_factory_returning_no_exception_is_named_under_execute_sync() -> None:
    req = Request(idempotent=True, retry_strategy=_BadFactory())
    with pytest.raises(TypeError, match=r"_BadFactory\.retry_after.*_not_an_exception"):
        RetryOrchestrator().execute_sync(req, _locked)


async def test_a_factory_returning_an_exception_is_raised_as_before() -> None:
    class Mine(Exception):
        pass

    class Chooses:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry(lambda context: Mine(context.request_name))

    req = Request(name="kv.get", idempotent=True, retry_strategy=Chooses())
    with pytest.raises(Mine, match=r"kv\.get"):
        await RetryOrchestrator().maybe_retry(req, RetryReason.KV_LOCKED)


# -- breaker events after the trip do not repeat the trip's counts as current ----------------
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breaker(clock: _Clock) -> sdkcore.CircuitBreaker:
    return sdkcore.CircuitBreaker(
        volume_threshold=4,
        error_threshold_percentage=50,
        sleep_window=5.0,
        canary_timeout=2.0,
        clock=clock,
        name="node1:11210",
    )


def test_breaker_events_after_the_trip_report_trip_counts_and_the_last_error() -> None:
    clock = _Clock()
    breaker = _breaker(clock)
    with capture_retry_events() as events:
        breaker.record_success()
        breaker.record_success()
        breaker.record_failure(TimeoutError("no answer #1"))
        breaker.record_failure(ConnectionResetError("reset by peer"))  # 2 of 4: trips
        clock.now += 5.0
        assert breaker.try_acquire()  # the probe
        breaker.record_failure(ConnectionRefusedError("refused"))
        clock.now += 5.0
        assert breaker.try_acquire()
        clock.now += 2.0
        assert breaker.state is sdkcore.CircuitState.OPEN  # canary timeout
        clock.now += 5.0
        assert breaker.try_acquire()
        breaker.record_success()
    got = [(e["event"], e.get("cause")) for e in events]
    assert got == [
        ("breaker.opened", "threshold"),
        ("breaker.half_open", None),
        ("breaker.opened", "probe_failed"),
        ("breaker.half_open", None),
        ("breaker.opened", "canary_timeout"),
        ("breaker.half_open", None),
        ("breaker.closed", "probe_succeeded"),
    ]
    trip, *after = events
    assert (trip["outcomes"], trip["failures"]) == (4, 2)
    assert trip["last_error"] == "ConnectionResetError: reset by peer"
    for event in after:  # the window stopped counting at the trip: not the current rate
        assert "outcomes" not in event, event
        assert "failures" not in event, event
        assert (event["trip_outcomes"], event["trip_failures"]) == (4, 2), event
    assert [e["last_error"] for e in after] == [
        "ConnectionResetError: reset by peer",  # the probe goes out after this failure
        "ConnectionRefusedError: refused",  # the probe's own failure
        "ConnectionRefusedError: refused",
        "ConnectionRefusedError: refused",  # the canary timeout reports no error
        "ConnectionRefusedError: refused",
        "ConnectionRefusedError: refused",  # closed: what it had been open for
    ]
    # closed: counting starts over, and so does the last error
    with capture_retry_events() as events:
        for _ in range(4):
            breaker.record_failure(TimeoutError("again"))
        breaker.reset()
    assert [e["last_error"] for e in events] == ["TimeoutError: again"] * 2
    assert (events[1]["cause"], events[1]["trip_outcomes"], events[1]["trip_failures"]) == (
        "reset",
        4,
        4,
    )


def test_a_breaker_tripped_by_a_success_names_the_last_failure() -> None:
    clock = _Clock()
    breaker = _breaker(clock)
    with capture_retry_events() as events:
        breaker.record_failure(TimeoutError("slow"))
        breaker.record_failure(ValueError("an answer: not counted"))  # a success
        breaker.record_failure(TimeoutError("slower"))
        breaker.record_success()  # 4 outcomes, 2 failures: 50 % trips
    (event,) = events
    assert event["cause"] == "threshold"
    assert event["last_error"] == "TimeoutError: slower"


def test_a_probe_cut_at_its_deadline_is_named_as_the_last_error() -> None:
    """A probe cut by its request's deadline counts as a timeout; it is named so."""
    clock = _Clock()
    breaker = _breaker(clock)
    for _ in range(4):
        breaker.record_failure(TimeoutError())
    clock.now += 5.0
    request = Request(name="kv.get", idempotent=True, timeout=0.5, clock=clock)

    def dispatch() -> None:
        with breaker.guard(request):
            clock.now += 1.0  # the dispatch outlives the request's deadline: cut
            raise asyncio.CancelledError

    with capture_retry_events() as events, pytest.raises(asyncio.CancelledError):
        dispatch()
    names = [(e["event"], e.get("cause")) for e in events]
    assert names == [("breaker.half_open", None), ("breaker.opened", "probe_failed")]
    assert events[1]["last_error"].startswith(
        f"TimeoutError: kv.get (request {request.id}) was cut at its deadline"
    )


# -- a strategy's own reason for not retrying, on retry.not_retried ---------------------------


async def test_not_retried_carries_the_strategys_own_reason_as_detail() -> None:
    class Closed:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.no_retry(why="the maintenance window is closed")

    orch = RetryOrchestrator(Closed())
    request = Request(idempotent=True, timeout=5.0)

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED)

    with capture_retry_events() as events, pytest.raises(RequestCanceledException):
        await orch.execute(request, send)
    [event] = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["detail"] == "the maintenance window is closed"
    assert event["why"] == "strategy_declined"


async def test_not_retried_detail_is_none_when_the_strategy_gives_no_reason() -> None:
    orch = RetryOrchestrator(FastFailOnTerminalErrorRetryStrategy())
    request = Request(idempotent=True, timeout=5.0)

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.AUTHENTICATION_ERROR)

    with capture_retry_events() as events, pytest.raises(sdkcore.AuthenticationFailureException):
        await orch.execute(request, send)
    [event] = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["detail"] is None


def test_retry_action_why_is_checked() -> None:
    with pytest.raises(TypeError, match="why"):
        RetryAction.no_retry(why=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only a refusal"):
        RetryAction(timedelta(seconds=1), why="no")
    assert RetryAction.no_retry(why="x").why == "x"
    assert RetryAction.no_retry() is RetryAction.no_retry()  # no reason: the shared refusal


# -- what the application attached to a request, in its failure reports ---------------------


async def test_client_context_is_in_the_error_context_and_the_events() -> None:
    orch = RetryOrchestrator(BestEffortRetryStrategy())
    request = Request(
        name="kv.get",
        idempotent=True,
        timeout=0.05,
        client_context={"key": "airline_10", "bucket": "travel", "sdkcore.grpc.call": object()},
    )

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED)

    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException) as info:
        await orch.execute(request, send)
    shown = {"key": "airline_10", "bucket": "travel"}  # sdkcore's own keys left out
    context = info.value.context
    assert context is not None
    assert dict(context.client_context) == shown
    assert '"client_context": {"key": "airline_10", "bucket": "travel"}' in str(info.value)
    assert events
    assert all(e["client_context"] == shown for e in events if e["event"].startswith("retry."))
    again = pickle.loads(pickle.dumps(context))
    assert again == context


def test_client_context_text_is_bounded_and_never_raises() -> None:
    class Hostile:
        def __str__(self) -> str:
            raise RuntimeError("no")

    many = {f"k{i}": i for i in range(25)}
    shown = client_context_text({"long": "x" * 500, "bad": Hostile(), **many})
    assert len(shown["long"]) == 100
    assert shown["bad"] == "<Hostile>"
    assert len(shown) == 21  # 20 entries, and how many more were left out
    assert shown["..."] == "7 more"
    assert client_context_text({"sdkcore.grpc.call": 1}) == {}


async def test_a_request_without_client_context_shows_none() -> None:
    request = Request(idempotent=True, timeout=0.01)

    async def send(_: Request) -> str:
        raise RetryableError(RetryReason.KV_LOCKED)

    with capture_retry_events() as events, pytest.raises(UnambiguousTimeoutException) as info:
        await RetryOrchestrator().execute(request, send)
    assert "client_context" not in str(info.value)
    assert all("client_context" not in e for e in events)


class _DecidesGarbage(BestEffortRetryStrategy):
    def decide(self, request: Request, reason: RetryReason) -> Any:
        return 5


class _DecidesBadFactory(BestEffortRetryStrategy):
    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        return RetryAction.no_retry(_not_an_exception)


class _AnswersGarbage:
    def retry_after(self, request: Request, reason: RetryReason) -> Any:
        return 5


def _locked_sync(request: Request) -> Any:
    raise RetryableError(RetryReason.KV_LOCKED)


async def _locked_async(request: Request) -> Any:
    raise RetryableError(RetryReason.KV_LOCKED)


async def _through(door: str, req: Request) -> None:
    """One failed KV_LOCKED attempt through ``door``: the strategy is asked once."""
    orch = RetryOrchestrator()
    if door == "execute":
        await orch.execute(req, _locked_async)
    elif door == "execute_sync":
        orch.execute_sync(req, _locked_sync)
    else:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)


@pytest.mark.parametrize("door", ["execute", "execute_sync", "maybe_retry"])
@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (
            _DecidesGarbage(),
            r"_DecidesGarbage\.decide\(request, <RetryReason\.KV_LOCKED>\) returned 5",
        ),
        (
            _AnswersGarbage(),
            r"_AnswersGarbage\.retry_after\(request, <RetryReason\.KV_LOCKED>\) returned 5",
        ),
        (
            _DecidesBadFactory(),
            r"_DecidesBadFactory\.decide\(request, <RetryReason\.KV_LOCKED>\) refused with "
            r"RetryAction\.no_retry\(exception=_not_an_exception\)",
        ),
    ],
    ids=["decide returns garbage", "retry_after returns garbage", "decide's factory fails"],
)
async def test_a_strategys_bad_answer_names_the_method_that_gave_it(
    door: str, strategy: Any, expected: str
) -> None:
    """A subclass that overrides ``decide`` is asked through ``decide`` by every door: its
    mistake is named there, not in a ``retry_after`` it never wrote."""
    req = Request(idempotent=True, retry_strategy=strategy)
    with pytest.raises(TypeError, match=expected):
        await _through(door, req)
