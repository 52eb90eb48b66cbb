"""Every failure a complete bug report: what the exception, its context and the logs say.

Each test here failed before the change it covers (see CHANGELOG, "Every failure a
complete bug report").
"""

from __future__ import annotations

import math
import pickle
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

    send = ScriptedSend([RetryReason.KV_LOCKED, RetryReason.KV_LOCKED, b"value"])
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
