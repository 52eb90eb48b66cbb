"""Structured log events: names, levels, fields; nothing at debug when debug is filtered."""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import pytest
import structlog

from sdkcore import (
    BestEffortRetryStrategy,
    FailFastRetryStrategy,
    Request,
    RequestCanceledException,
    RetryAction,
    RetryOrchestrator,
    RetryReason,
    TimeoutException,
)
from sdkcore.testing import ScriptedSend, VirtualClock, capture_retry_events

pytestmark = pytest.mark.anyio

SCHEDULED_FIELDS = {
    "event",
    "log_level",
    "request_id",
    "request_name",
    "reason",
    "attempt",
    "delay_ms",
    "capped",
    "idempotent",
    "strategy",
    "caused_by",
}


def virtual(strategy: Any = None, **kwargs: Any) -> tuple[RetryOrchestrator, VirtualClock]:
    vc = VirtualClock()
    return RetryOrchestrator(strategy, sleep=vc.sleep, **kwargs), vc


async def test_retry_scheduled_event() -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    req = Request(name="kv.get", idempotent=True, timeout=10, clock=vc.clock)
    with capture_retry_events() as events:
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
        await orch.maybe_retry(req, RetryReason.KV_NOT_MY_VBUCKET)
    assert events == [
        {
            "event": "retry.scheduled",
            "log_level": "debug",
            "request_id": req.id,
            "request_name": "kv.get",
            "reason": "KV_LOCKED",
            "attempt": 1,
            "delay_ms": 1.0,
            "capped": False,
            "idempotent": True,
            "strategy": "BestEffortRetryStrategy",
            "caused_by": None,
        },
        {
            "event": "retry.scheduled",
            "log_level": "debug",
            "request_id": req.id,
            "request_name": "kv.get",
            "reason": "KV_NOT_MY_VBUCKET",
            "attempt": 2,
            "delay_ms": 10.0,
            "capped": False,
            "idempotent": True,
            "strategy": "controlled_backoff",
            "caused_by": None,
        },
    ]
    assert set(events[0]) == SCHEDULED_FIELDS


async def test_capped_retry_logs_capped_then_timed_out() -> None:
    class Fixed:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(0.1)

    orch, vc = virtual(Fixed())
    req = Request(name="kv.replace", idempotent=False, timeout=0.25, clock=vc.clock)
    vc.advance(0.2)
    with capture_retry_events() as events, pytest.raises(TimeoutException):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert [e["event"] for e in events] == ["retry.scheduled", "retry.timed_out"]
    scheduled, timed_out = events
    assert scheduled["capped"] is True
    assert scheduled["delay_ms"] == pytest.approx(50.0)
    assert scheduled["strategy"] == "Fixed"
    assert timed_out["log_level"] == "info"
    assert timed_out["request_id"] == req.id
    assert timed_out["request_name"] == "kv.replace"
    assert timed_out["reason"] == "KV_LOCKED"
    # KV LOCKED proves the write was not applied: not ambiguous (rfc/0001 Ambiguity)
    assert timed_out["ambiguous"] is False
    assert timed_out["idempotent"] is False


async def test_retry_not_retried_event() -> None:
    orch, vc = virtual(FailFastRetryStrategy())
    req = Request(name="kv.insert", clock=vc.clock)
    with capture_retry_events() as events, pytest.raises(RequestCanceledException):
        await orch.maybe_retry(req, RetryReason.KV_TEMPORARY_FAILURE)
    assert len(events) == 1
    event = events[0]
    assert event["event"] == "retry.not_retried"
    assert event["log_level"] == "info"
    assert event["request_id"] == req.id
    assert event["request_name"] == "kv.insert"
    assert event["reason"] == "KV_TEMPORARY_FAILURE"
    assert event["attempt"] == 1  # the attempt that failed (1-based)
    assert event["idempotent"] is False
    assert event["strategy"] == "FailFastRetryStrategy"
    assert event["why"] == "strategy_declined"
    assert event["cancellation_reason"] == "NO_MORE_RETRIES"


async def test_backpressure_is_logged_as_not_retried() -> None:
    class Slow:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            return RetryAction.with_duration(30)

    orch = RetryOrchestrator(Slow(), max_requests_in_retry=1)
    waiting = Request(timeout=60)
    with capture_retry_events() as events:
        async with anyio.create_task_group() as tg:
            tg.start_soon(orch.maybe_retry, waiting, RetryReason.KV_LOCKED)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(RequestCanceledException) as info:
                await orch.maybe_retry(Request(timeout=60), RetryReason.KV_LOCKED)
            tg.cancel_scope.cancel()
    refused = [e for e in events if e["event"] == "retry.not_retried"]
    assert len(refused) == 1
    assert refused[0]["cancellation_reason"] == "TOO_MANY_REQUESTS_IN_RETRY"
    # The limit, named as the setting an operator changes, in the event and the message
    # ("1 requests are already waiting in retry" read as a count: an operator's review).
    assert refused[0]["max_requests_in_retry"] == 1
    assert "limit of 1 requests waiting in retry at once" in str(info.value)
    assert "(max_requests_in_retry;" in str(info.value)


async def test_strategy_failed_event_when_strategy_raises() -> None:
    class Broken:
        def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
            raise RuntimeError("lookup service down")

    orch, vc = virtual(Broken())
    req = Request(name="kv.get", clock=vc.clock)
    with capture_retry_events() as events, pytest.raises(RuntimeError):
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
    assert len(events) == 1
    event = events[0]
    assert event["event"] == "retry.strategy_failed"
    assert event["log_level"] == "warning"
    assert event["request_id"] == req.id
    assert event["strategy"] == "Broken"
    assert event["reason"] == "KV_LOCKED"
    assert "lookup service down" in event["error"]


async def test_strategy_failed_event_when_strategy_returns_garbage() -> None:
    class Garbage:
        def retry_after(self, request: Request, reason: RetryReason) -> Any:
            return 0.5

    orch, vc = virtual(Garbage())
    with capture_retry_events() as events, pytest.raises(TypeError):
        await orch.maybe_retry(Request(clock=vc.clock), RetryReason.KV_LOCKED)
    assert [e["event"] for e in events] == ["retry.strategy_failed"]
    assert "RetryAction" in events[0]["error"]


async def test_execute_in_flight_timeout_event() -> None:
    async def send(_: Request) -> str:
        await anyio.sleep_forever()
        return "never"

    orch = RetryOrchestrator()
    with capture_retry_events() as events, pytest.raises(TimeoutException):
        await orch.execute(Request(timeout=0.02, idempotent=True), send)
    assert [e["event"] for e in events] == ["retry.timed_out"]
    assert events[0]["in_flight"] is True
    assert events[0]["ambiguous"] is False


async def test_capture_restores_configuration() -> None:
    before = structlog.get_config()
    with capture_retry_events():
        pass
    assert structlog.get_config() == before


# -- filtered levels ---------------------------------------------------------------


@pytest.fixture
def info_only() -> Iterator[list[MutableMapping[str, Any]]]:
    """structlog configured to drop debug; a processor records what it is handed."""
    seen: list[MutableMapping[str, Any]] = []

    def record(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        seen.append({**event_dict, "method": method})
        raise structlog.DropEvent

    structlog.configure(
        processors=[record],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=False,
    )
    try:
        yield seen
    finally:
        structlog.reset_defaults()


async def test_no_debug_event_reaches_processors_when_debug_is_filtered(
    info_only: list[MutableMapping[str, Any]],
) -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    send: ScriptedSend[str] = ScriptedSend([RetryReason.KV_LOCKED] * 5 + ["ok"])
    assert await orch.execute(Request(timeout=10, clock=vc.clock), send) == "ok"
    with pytest.raises(RequestCanceledException):
        await orch.maybe_retry(Request(clock=vc.clock), RetryReason.UNKNOWN)
    assert [e["method"] for e in info_only] == ["info"]
    assert [e["event"] for e in info_only] == ["retry.not_retried"]
    assert not any(e["event"] == "retry.scheduled" for e in info_only)


async def test_reconfiguring_structlog_is_picked_up(
    info_only: list[MutableMapping[str, Any]],
) -> None:
    orch, vc = virtual(BestEffortRetryStrategy())
    await orch.maybe_retry(Request(timeout=10, clock=vc.clock), RetryReason.KV_LOCKED)
    assert info_only == []
    with capture_retry_events() as events:
        await orch.maybe_retry(Request(timeout=10, clock=vc.clock), RetryReason.KV_LOCKED)
    assert [e["event"] for e in events] == ["retry.scheduled"]
    # back to the filtered configuration after the capture
    await orch.maybe_retry(Request(timeout=10, clock=vc.clock), RetryReason.KV_LOCKED)
    assert info_only == []


def _recording_wrapper(level: int, calls: list[str]) -> type:
    """A filtering bound logger whose level methods record that they were called."""
    base = structlog.make_filtering_bound_logger(level)

    class Recording(base):  # type: ignore[misc, valid-type]
        def debug(self, event: str, *args: Any, **kw: Any) -> Any:
            calls.append("debug")
            return super().debug(event, *args, **kw)

        def info(self, event: str, *args: Any, **kw: Any) -> Any:
            calls.append("info")
            return super().info(event, *args, **kw)

    return Recording


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
async def test_filtered_level_is_never_called_so_no_event_is_built(level: int) -> None:
    """Free when filtered out: sdkcore asks the level first and never calls log.debug()."""
    calls: list[str] = []
    structlog.configure(
        processors=[structlog.testing.LogCapture()],
        wrapper_class=_recording_wrapper(level, calls),
        cache_logger_on_first_use=False,
    )
    try:
        orch, vc = virtual(BestEffortRetryStrategy())
        req = Request(timeout=10, idempotent=True, clock=vc.clock)
        for _ in range(5):
            await orch.maybe_retry(req, RetryReason.KV_LOCKED)
        assert req.retry_attempts == 5
        assert "debug" not in calls
        with pytest.raises(RequestCanceledException):
            await orch.maybe_retry(Request(clock=vc.clock), RetryReason.UNKNOWN)
        assert calls == (["info"] if level <= logging.INFO else [])
    finally:
        structlog.reset_defaults()


async def test_stdlib_backed_logger_level_is_honoured() -> None:
    """With structlog.stdlib, the stdlib logger's level decides, and changes are seen."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    std = logging.getLogger("sdkcore")
    handler = Keep()
    std.addHandler(handler)
    old_level = std.level
    std.setLevel(logging.INFO)
    structlog.configure(
        processors=[structlog.stdlib.render_to_log_kwargs],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    try:
        orch, vc = virtual(BestEffortRetryStrategy())
        req = Request(timeout=10, idempotent=True, clock=vc.clock)
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
        assert [r.msg for r in records] == []
        std.setLevel(logging.DEBUG)  # a runtime level change is picked up
        await orch.maybe_retry(req, RetryReason.KV_LOCKED)
        assert [r.msg for r in records] == ["retry.scheduled"]
        assert records[0].levelno == logging.DEBUG
    finally:
        structlog.reset_defaults()
        std.removeHandler(handler)
        std.setLevel(old_level)
