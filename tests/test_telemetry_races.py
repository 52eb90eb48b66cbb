"""Deterministic regressions for telemetry bugs found by tests/test_telemetry_fuzz.py.

Each test is one schedule, pinned with events (no sleeps, no randomness), on asyncio and
trio: ``Request.cancel()`` from another task while a hand-wired loop is between sdkcore's
calls, after an earlier call began the request's trace. rfc/0008: ``sdkcore.request.duration``
and ``sdkcore.request.retries`` are recorded "once per finished request", the request span
is "ended when the request ends", with ``sdkcore.request.outcome`` ``cancelled`` for
``Request.cancel()`` and, on anything but success, status ERROR and ``error.type`` the class
name of what the caller got.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import context as otel_context
from opentelemetry.trace import StatusCode
from telemetry_kit import Otel, SpanCounter

from sdkcore import (
    BestEffortRetryStrategy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
)

pytestmark = pytest.mark.anyio

LOCKED = RetryReason.KV_LOCKED
SAFETY = 10.0
NAME = "sdkcore.request.name"
OUTCOME = "sdkcore.request.outcome"


@pytest.fixture
def otel() -> Iterator[Otel]:
    kit = Otel()
    yield kit
    kit.shutdown()


@pytest.fixture
def counter(otel: Otel) -> SpanCounter:
    """Counts every span's start and end (each must end exactly once)."""
    counted = SpanCounter()
    otel.tracers.add_span_processor(counted)
    return counted


def orchestrator(otel: Otel) -> RetryOrchestrator:
    return otel.orchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))


async def with_canceller(
    request: Request, loop: Callable[[anyio.Event, anyio.Event], Awaitable[Any]]
) -> tuple[Any, BaseException | None]:
    """Runs ``loop(ready, cancelled)``; another task calls ``request.cancel()`` once the loop
    sets ``ready``, then sets ``cancelled``. Returns (what the loop returned, what it raised)."""
    ready, cancelled = anyio.Event(), anyio.Event()
    outcome: list[Any] = [None, None]

    async def canceller() -> None:
        await ready.wait()
        request.cancel()
        cancelled.set()

    async def run() -> None:
        try:
            outcome[0] = await loop(ready, cancelled)
        except Exception as exc:
            outcome[1] = exc

    before = otel_context.get_current()
    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            tg.start_soon(canceller)
            await run()
    assert otel_context.get_current() == before
    return outcome[0], outcome[1]


def check_recorded_once(
    otel: Otel, counter: SpanCounter, name: str, outcome: str, error_type: str, retries: int
) -> None:
    """One finished request: one duration point and one retries point, its span ended once
    with the same outcome and error."""
    got = otel.metrics()
    duration = got.get("sdkcore.request.duration")
    points = [] if duration is None else [(a, v[0]) for a, v in duration.points]
    assert points == [({NAME: name, OUTCOME: outcome, "error.type": error_type}, 1)]
    retried = got.get("sdkcore.request.retries")
    assert retried is not None
    assert retried.points == [({NAME: name}, (1, retries))]
    assert counter.problems() == []
    [span] = [s for s in otel.spans() if s.name == name]
    attributes = dict(span.attributes or {})
    assert attributes[OUTCOME] == outcome
    assert attributes["sdkcore.request.retries"] == retries
    assert span.status.status_code is StatusCode.ERROR
    assert attributes["error.type"] == error_type


async def test_loop_without_attempt_records_a_request_cancelled_during_a_later_send(
    otel: Otel, counter: SpanCounter
) -> None:
    """A loop without attempt(): its first failure's maybe_retry begins the trace; the
    application cancels the request while the second send is in flight (no scope cuts it);
    the send then fails retryably and maybe_retry raises RequestCanceledException.

    Fails before the fix: maybe_retry refuses the completed request before its ``try``
    (sdkcore/_execute.py, ``maybe_retry``: ``if request.state is not _PENDING: raise
    _failing.already_completed(...)``), so the trace it began is never ended: no duration
    or retries point, the request span never ends.
    """
    orch = orchestrator(otel)
    request = Request(name="kv.get", idempotent=True, timeout=None)

    async def loop(ready: anyio.Event, cancelled: anyio.Event) -> str:
        sends = 0
        while True:
            sends += 1
            try:
                await anyio.lowlevel.checkpoint()
                if sends == 2:  # in flight while another task cancels the request
                    ready.set()
                    await cancelled.wait()
                raise RetryableError(LOCKED)
            except RetryableError as exc:
                await orch.maybe_retry(request, exc.reason, cause=exc)

    _, error = await with_canceller(request, loop)
    assert isinstance(error, RequestCanceledException)
    check_recorded_once(otel, counter, "kv.get", "cancelled", "RequestCanceledException", 1)


async def test_attempt_records_a_request_cancelled_between_two_attempts(
    otel: Otel, counter: SpanCounter
) -> None:
    """The README's loop (attempt() + maybe_retry), awaiting a pooled connection before each
    retry: the application cancels the request while the loop waits there, and the next
    attempt() raises RequestCanceledException.

    Fails before the fix: attempt() refuses the completed request before anything
    (sdkcore/_execute.py, ``attempt``: ``if request.state is not _PENDING: raise
    _failing.already_completed(...)``), so the trace the first attempt() began is never
    ended: no duration or retries point, the request span never ends.
    """
    orch = orchestrator(otel)
    request = Request(name="kv.get", idempotent=True, timeout=None)

    async def loop(ready: anyio.Event, cancelled: anyio.Event) -> str:
        attempts = 0
        while True:
            attempts += 1
            if attempts == 2:  # waiting for a pooled connection: another task cancels
                ready.set()
                await cancelled.wait()
            try:
                with orch.attempt(request):
                    await anyio.lowlevel.checkpoint()
                    raise RetryableError(LOCKED)
            except RetryableError as exc:
                await orch.maybe_retry(request, exc.reason, cause=exc)

    _, error = await with_canceller(request, loop)
    assert isinstance(error, RequestCanceledException)
    check_recorded_once(otel, counter, "kv.get", "cancelled", "RequestCanceledException", 1)


async def test_succeed_of_a_cancelled_request_marks_its_span_as_its_metric(
    otel: Otel, counter: SpanCounter
) -> None:
    """A loop without attempt(): its first failure's maybe_retry begins the trace; the
    application cancels the request while the second send is in flight, the send answers and
    the loop calls succeed(). The request is recorded ``cancelled`` with ``error.type``
    ``RequestCanceledException`` on ``sdkcore.request.duration`` (as sdkcore does today).

    Fails before the fix: its span says neither. ``RequestTrace.end`` (sdkcore/_telemetry.py)
    gets no error from succeed() and sets the span's status and ``error.type`` only
    ``if error is not None``, while the metric takes ``RequestCanceledException`` for it:
    the span (status UNSET, no ``error.type``) and the metric disagree about one request.
    """
    orch = orchestrator(otel)
    request = Request(name="kv.get", idempotent=True, timeout=None)

    async def loop(ready: anyio.Event, cancelled: anyio.Event) -> str:
        sends = 0
        while True:
            sends += 1
            try:
                await anyio.lowlevel.checkpoint()
                if sends == 1:
                    raise RetryableError(LOCKED)
                ready.set()  # in flight while another task cancels the request
                await cancelled.wait()
                value = "v"
            except RetryableError as exc:
                await orch.maybe_retry(request, exc.reason, cause=exc)
                continue
            orch.succeed(request)  # a completed request: does nothing but record
            return value

    await with_canceller(request, loop)
    assert request.cancelled
    check_recorded_once(otel, counter, "kv.get", "cancelled", "RequestCanceledException", 1)
