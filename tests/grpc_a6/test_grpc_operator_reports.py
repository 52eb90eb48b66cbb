"""An operator review's gRPC findings, on a real grpc.aio server on 127.0.0.1.

2. Why a call stopped retrying was not in the log. The throttler now logs
   ``throttle.engaged`` / ``throttle.released``, and ``retry.not_retried`` carries the
   policy's own reason as ``detail`` (``RetryAction.no_retry(why=...)``).
4. The nested error text said the attempt count twice ("all 4 attempts (maxAttempts)
   used after 4 attempts"): ``sdkcore._context.describe_error`` adds the count only
   when the message does not say it.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

grpc = pytest.importorskip("grpc")
from grpc import aio  # noqa: E402
from grpc_server import TEST_TIMEOUT, Server, abort, retry_config  # noqa: E402

from sdkcore import AttemptEffect, CouchbaseException, UnambiguousTimeoutException  # noqa: E402
from sdkcore._context import describe_error  # noqa: E402
from sdkcore.grpc import RetryThrottler, insecure_channel, retry_controller  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio
ABORTED = grpc.StatusCode.ABORTED


def fails_on_x() -> Any:
    """ABORTED for the request b"x", OK for any other."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if request == b"x":
            await abort(context, ABORTED)
        return b"ok:" + request

    return fn


def _throttle_events(events: list[Any]) -> list[dict[str, Any]]:
    return [dict(e) for e in events if str(e["event"]).startswith("throttle.")]


async def test_the_throttler_logs_once_when_it_engages_and_when_it_releases(
    server: Server,
) -> None:
    """maxTokens 4 (threshold 2), tokenRatio 1, maxAttempts 5 on a method that always fails.

    Call 1: attempt 1 fails (3 tokens, retry), attempt 2 fails (2 tokens: engaged, the
    retry refused). Call 2: attempt 1 fails (1 token, refused). Then two successes: 2
    tokens (still engaged), 3 tokens (released, 2 refused in between).
    """
    method = server.unary_unary("M", fails_on_x())
    cfg = retry_config(max_attempts=5, throttling={"maxTokens": 4, "tokenRatio": 1})
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert isinstance(throttler, RetryThrottler)
            call = ch.unary_unary(method)
            with pytest.raises(aio.AioRpcError):
                await call(b"x")
            engaged = _throttle_events(events)
            with pytest.raises(aio.AioRpcError):
                await call(b"x")
            assert throttler.engaged
            assert _throttle_events(events) == engaged  # logged once per episode
            assert await call(b"y") == b"ok:y"
            assert throttler.engaged  # 2 tokens: at the threshold still
            assert await call(b"z") == b"ok:z"
            assert not throttler.engaged
    assert server.count("M") == 2 + 1 + 2
    assert engaged == [
        {
            "event": "throttle.engaged",
            "log_level": "warning",
            "target": server.target,
            "tokens": 2.0,
            "max_tokens": 4.0,
            "threshold": 2.0,
        }
    ]
    assert _throttle_events(events)[1:] == [
        {
            "event": "throttle.released",
            "log_level": "info",
            "target": server.target,
            "tokens": 3.0,
            "max_tokens": 4.0,
            "threshold": 2.0,
            "refused": 2,
        }
    ]
    assert throttler.refused == 2


async def test_a_hedge_the_throttler_refuses_counts_as_refused(server: Server) -> None:
    method = server.unary_unary("M", fails_on_x())
    cfg = retry_config(max_attempts=5, throttling={"maxTokens": 2, "tokenRatio": 1})
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=cfg) as ch:
            throttler = retry_controller(ch).throttler
            assert throttler is not None
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")  # 1 token of 2: engaged at once
            assert throttler.allows_retry() is False  # a gate's "no" is a refusal
            assert await ch.unary_unary(method)(b"y") == b"ok:y"
    released = _throttle_events(events)[-1]
    assert released["event"] == "throttle.released"
    assert released["refused"] == 2  # the call's retry, and the gate above


async def test_a_replacing_bucket_continues_the_episode() -> None:
    """New service-config settings mid-episode: the new bucket logs the release."""
    with capture_retry_events() as events:
        old = RetryThrottler(4, 1)
        old.record_failure()
        assert old.record_failure() is False  # engaged
        old.note_refusal()
        new = RetryThrottler(8, 1, replaces=old)
        assert new.engaged
        new.record_success()  # 5 of 8 > 4: released
    assert [(e["event"], e.get("refused")) for e in events] == [
        ("throttle.engaged", None),
        ("throttle.released", 1),
    ]


async def test_not_retried_says_why_the_policy_stopped(server: Server) -> None:
    method = server.unary_unary("M", fails_on_x())
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=2)
        ) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
    [event] = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["why"] == "strategy_declined"
    assert event["detail"] == "all 2 attempts (maxAttempts) used"


async def test_a_capped_max_attempts_is_reported_with_the_configured_number(server: Server) -> None:
    """maxAttempts 100 runs 5 attempts (the client cap, A6): the refusal names both, or the
    operator looks for a 5 that is in no config."""
    method = server.unary_unary("M", fails_on_x())
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(
            server.target,
            service_config=retry_config(max_attempts=100, initial="0.001s", maximum="0.002s"),
        ) as ch:
            with pytest.raises(aio.AioRpcError):
                await ch.unary_unary(method)(b"x")
    assert server.count("M") == 5
    [event] = [e for e in events if e["event"] == "retry.not_retried"]
    assert event["detail"] == (
        "all 5 attempts used (maxAttempts 100, capped at 5 by the channel's max_attempts_cap)"
    )


async def test_the_first_attempt_is_booked_with_its_duration(server: Server) -> None:
    """The call's request is built at its first failure; its first attempt, sent at the
    call's start, had no duration in the error context where every later one had."""
    method = server.unary_unary("M", fails_on_x())
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=3)
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    cause = info.value.__cause__
    assert isinstance(cause, CouchbaseException)
    assert cause.context is not None
    attempts = cause.context.attempts
    assert len(attempts) == 3
    for attempt in attempts:  # each from its send to its failure: well under the test's bound
        assert attempt.duration is not None
        assert 0.0 <= attempt.duration.total_seconds() < TEST_TIMEOUT


async def test_the_nested_error_text_says_the_attempt_count_once(server: Server) -> None:
    method = server.unary_unary("M", fails_on_x())
    with anyio.fail_after(TEST_TIMEOUT):
        async with insecure_channel(
            server.target, service_config=retry_config(max_attempts=4)
        ) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x")
    text = describe_error(info.value)
    assert text is not None
    assert text.endswith(
        "(from RequestCanceledException: not retried: all 4 attempts (maxAttempts) used)"
    ), text


async def test_a_retried_call_cut_by_its_deadline_logs_the_timeout_and_names_the_cut_attempt(
    server: Server,
) -> None:
    """UNAVAILABLE, then an attempt that outlasts the call's deadline: the call's error is
    grpc's DEADLINE_EXCEEDED, caused by sdkcore's timeout whose context names the attempt cut
    in flight (no reason of its own), and ``retry.timed_out`` is logged as on the core's
    doors. Before, nothing was logged and the context blamed a status no attempt had."""

    async def fn(request: bytes, context: Any, attempt: int) -> bytes:
        if attempt == 1:
            await abort(context, grpc.StatusCode.UNAVAILABLE)
        await anyio.sleep(5)
        return b"late"

    method = server.unary_unary("Slow", fn)
    with anyio.fail_after(TEST_TIMEOUT), capture_retry_events() as events:
        async with insecure_channel(server.target, service_config=retry_config()) as ch:
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary(method)(b"x", timeout=0.3)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    cause = info.value.__cause__
    assert isinstance(cause, UnambiguousTimeoutException)
    assert cause.context is not None
    assert cause.context.in_flight
    assert cause.context.reason is None
    assert cause.context.extra["grpc_status"] == "DEADLINE_EXCEEDED"
    assert cause.context.extra["grpc_attempts"] == 2
    assert cause.context.attempts[-1].effect is AttemptEffect.MAYBE_APPLIED
    assert "attempt 2 in flight at the deadline" in str(cause)
    (timed_out,) = [e for e in events if e["event"] == "retry.timed_out"]
    assert timed_out["in_flight"] is True
    assert timed_out["previous_reason"] == "SERVICE_NOT_AVAILABLE"
    assert timed_out["strategy"] == "A6RetryStrategy"


async def test_every_event_raising_changes_no_grpc_outcome(server: Server) -> None:
    """The throttler's episode with every sdkcore event raising in the application's
    structlog pipeline: `throttle.released` raised before the call left the channel's live
    set (close(grace) then waited its whole grace, the replay buffer stayed reserved). The
    calls end as with working logging and the channel closes at once."""
    import structlog

    from sdkcore import _log

    def raising(_: Any, method: str, event_dict: Any) -> Any:
        raise RuntimeError("the pipeline broke")

    method = server.unary_unary("M", fails_on_x())
    cfg = retry_config(max_attempts=5, throttling={"maxTokens": 4, "tokenRatio": 1})
    _log._DROPPED.clear()
    structlog.configure(processors=[raising], cache_logger_on_first_use=False)
    try:

        async def episode() -> None:
            ch = insecure_channel(server.target, service_config=cfg)
            call = ch.unary_unary(method)
            for _ in range(2):
                with pytest.raises(aio.AioRpcError):
                    await call(b"x")
            assert retry_controller(ch).throttler.engaged  # type: ignore[union-attr]
            assert await call(b"y") == b"ok:y"
            assert await call(b"z") == b"ok:z"  # throttle.released
            core = retry_controller(ch)
            assert not core._live
            assert core.buffered_bytes == 0
            with anyio.fail_after(2.0):  # not the 30 s grace
                await ch.close(grace=30.0)

        with anyio.fail_after(TEST_TIMEOUT), pytest.warns(RuntimeWarning):
            await episode()
    finally:
        structlog.reset_defaults()
        _log._DROPPED.clear()
