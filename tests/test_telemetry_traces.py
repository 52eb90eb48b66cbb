"""Telemetry traces (issue 22 item 4, rfc/0008), on every door, asyncio and trio.

One span per request (named after it, kind CLIENT, a child of the caller's current
span), one child span ``sdkcore.attempt`` per attempt (``sdkcore.attempt.number``,
1-based) that is the current span while ``send`` runs, a ``sdkcore.retry`` event
(reason, delay in seconds) on the request span per scheduled retry, error status
and the exception recorded on failure, hedged copies as sibling attempt spans with
``sdkcore.hedge.index``. Checked with the OpenTelemetry SDK's InMemorySpanExporter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from telemetry_kit import (
    Fatal,
    Otel,
    attr,
    current_span_id,
    hand_wired,
    parent_id,
    span_named,
)

from sdkcore import (
    BestEffortRetryStrategy,
    FailFastRetryStrategy,
    HedgePolicy,
    Request,
    RequestCanceledException,
    RetryableError,
    RetryOrchestrator,
    RetryReason,
    UnambiguousTimeoutException,
)
from sdkcore.testing import VirtualClock

LOCKED = RetryReason.KV_LOCKED
SAFETY = 10.0


@pytest.fixture
def otel() -> Iterator[Otel]:
    kit = Otel()
    yield kit
    kit.shutdown()


class Recorder:
    """A send that fails ``failures`` times with KV_LOCKED, then answers; inside, it
    notes the current span and starts a span of its own (an instrumented client)."""

    def __init__(self, otel: Otel, failures: int = 0, error: BaseException | None = None) -> None:
        self.otel = otel
        self.failures = failures
        self.error = error
        self.current: list[int] = []  # the current span's id, per attempt

    def step(self, request: Request) -> str:
        self.current.append(current_span_id())
        with self.otel.app.start_as_current_span(f"app.inner{len(self.current)}"):
            pass
        if len(self.current) <= self.failures:
            raise RetryableError(LOCKED)
        if self.error is not None:
            raise self.error
        return "v"

    async def __call__(self, request: Request) -> str:
        await anyio.lowlevel.checkpoint()
        answer = self.step(request)
        await anyio.lowlevel.checkpoint()
        return answer


async def through(
    door: str, orchestrator: RetryOrchestrator, request: Request, send: Recorder
) -> Any:
    if door == "execute":
        return await orchestrator.execute(request, send)
    if door == "hedge":

        async def copy(r: Request, index: int) -> Any:
            return await send(r)

        return await orchestrator.hedge(request, copy, HedgePolicy(1))
    return await hand_wired(orchestrator, request, send)


def tree(otel: Otel, request_name: str) -> tuple[ReadableSpan, ReadableSpan, list[ReadableSpan]]:
    """(caller, request span, attempt spans in attempt order)."""
    spans = otel.spans()
    caller = span_named(spans, "caller")
    request = span_named(spans, request_name)
    attempts = [s for s in spans if s.name == "sdkcore.attempt"]
    attempts.sort(key=lambda s: int(attr(s, "sdkcore.attempt.number")))
    return caller, request, attempts


def check_tree(otel: Otel, send: Recorder, attempts_expected: int) -> ReadableSpan:
    caller, request, attempts = tree(otel, "kv.get")
    # the request: named after it, CLIENT, a child of the caller's span, same trace
    assert request.kind is SpanKind.CLIENT
    assert parent_id(request) == caller.context.span_id
    assert request.context.trace_id == caller.context.trace_id
    assert request.attributes is not None
    assert request.attributes["sdkcore.request.name"] == "kv.get"
    # attempts: children of the request, 1-based, each current while send ran
    assert [attr(a, "sdkcore.attempt.number") for a in attempts] == list(
        range(1, attempts_expected + 1)
    )
    for n, attempt in enumerate(attempts, start=1):
        assert attempt.kind is SpanKind.INTERNAL
        assert parent_id(attempt) == request.context.span_id
        assert attempt.context.trace_id == caller.context.trace_id
        assert send.current[n - 1] == attempt.context.span_id
        inner = span_named(otel.spans(), f"app.inner{n}")
        assert parent_id(inner) == attempt.context.span_id  # nests under the attempt
        assert request.start_time is not None
        assert attempt.start_time is not None
        assert request.start_time <= attempt.start_time
        assert attempt.end_time is not None
        assert request.end_time is not None
        assert attempt.end_time <= request.end_time
    return request


# -- the span tree, every door -------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("door", ["execute", "hand_wired"])
async def test_request_and_attempt_spans_with_retries(otel: Otel, door: str) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    request = Request(name="kv.get", idempotent=True, timeout=2.5, clock=clock.clock)
    send = Recorder(otel, failures=2)
    with anyio.fail_after(SAFETY), otel.app.start_as_current_span("caller") as caller:
        assert await through(door, orchestrator, request, send) == "v"
        assert trace.get_current_span() is caller  # the caller's context is given back
    span = check_tree(otel, send, 3)
    assert span.status.status_code is StatusCode.UNSET
    assert span.attributes is not None
    assert span.attributes["sdkcore.request.outcome"] == "success"
    events = [(e.name, dict(e.attributes or {})) for e in span.events]
    assert events == [
        ("sdkcore.retry", {"sdkcore.retry.reason": "KV_LOCKED", "sdkcore.retry.delay": delay})
        for delay in clock.sleeps
    ]
    assert len(clock.sleeps) == 2
    _, _, attempts = tree(otel, "kv.get")
    for failed in attempts[:2]:  # each failed attempt: error status, the exception
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.attributes is not None
        assert failed.attributes["error.type"] == "RetryableError"
        assert failed.attributes["sdkcore.retry.reason"] == "KV_LOCKED"  # (every reason's type)
        [event] = failed.events
        assert event.name == "exception"
        assert str(attr(event, "exception.type")).endswith("RetryableError")
    assert attempts[2].status.status_code is StatusCode.UNSET
    assert not attempts[2].events


@pytest.mark.anyio
async def test_hedge_door_spans(otel: Otel) -> None:
    request = Request(name="kv.get", idempotent=True)
    send = Recorder(otel)
    with anyio.fail_after(SAFETY), otel.app.start_as_current_span("caller") as caller:
        assert await through("hedge", otel.orchestrator(), request, send) == "v"
        assert trace.get_current_span() is caller
    check_tree(otel, send, 1)
    _, _, [attempt] = tree(otel, "kv.get")
    assert attempt.attributes is not None
    assert attempt.attributes["sdkcore.hedge.index"] == 0


def test_sync_door_spans(otel: Otel) -> None:
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy())
    request = Request(name="kv.get", idempotent=True, clock=clock.clock)
    send = Recorder(otel, failures=1)
    delays: list[float] = []

    def sleep(seconds: float) -> None:
        delays.append(seconds)
        clock.advance(seconds)

    with otel.app.start_as_current_span("caller") as caller:
        assert orchestrator.execute_sync(request, send.step, sleep=sleep) == "v"
        assert trace.get_current_span() is caller
    span = check_tree(otel, send, 2)
    assert [dict(e.attributes or {}) for e in span.events] == [
        {"sdkcore.retry.reason": "KV_LOCKED", "sdkcore.retry.delay": delays[0]}
    ]


def test_sync_door_spans_from_many_threads(otel: Otel) -> None:
    """Each thread's request is a child of that thread's own caller span."""
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            with otel.app.start_as_current_span(f"app.caller{t}"):
                send = Recorder(otel, failures=1)
                request = Request(name=f"op{t}", idempotent=True)
                orchestrator.execute_sync(request, lambda r: send.step(r))
                assert len(set(send.current)) == 2
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(SAFETY)
    assert not errors
    spans = otel.spans()
    for t in range(16):
        caller = span_named(spans, f"app.caller{t}")
        request = span_named(spans, f"op{t}")
        assert parent_id(request) == caller.context.span_id
        attempts = [s for s in spans if parent_id(s) == request.context.span_id]
        assert len(attempts) == 2
        assert all(a.name == "sdkcore.attempt" for a in attempts)


@pytest.mark.anyio
async def test_a_request_outside_any_span_is_a_root(otel: Otel) -> None:
    request = Request(name="kv.get")
    assert await otel.orchestrator().execute(request, Recorder(otel)) == "v"
    span = span_named(otel.spans(), "kv.get")
    assert span.parent is None


@pytest.mark.anyio
async def test_concurrent_requests_keep_their_own_spans(otel: Otel) -> None:
    """Attempt spans are current in their own task only; requests never nest."""
    clock = VirtualClock()
    orchestrator = otel.orchestrator(BestEffortRetryStrategy(), sleep=clock.sleep)
    sends = [Recorder(otel, failures=1) for _ in range(8)]

    async def one(n: int) -> None:
        with otel.app.start_as_current_span(f"app.caller{n}") as caller:
            request = Request(name=f"op{n}", idempotent=True, clock=clock.clock)
            await orchestrator.execute(request, sends[n])
            assert trace.get_current_span() is caller

    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            for n in range(8):
                tg.start_soon(one, n)
    spans = otel.spans()
    by_id = {s.context.span_id: s for s in spans}
    for n in range(8):
        request = span_named(spans, f"op{n}")
        assert parent_id(request) == span_named(spans, f"app.caller{n}").context.span_id
        for current in sends[n].current:
            assert parent_id(by_id[current]) == request.context.span_id


# -- failures on the spans ----------------------------------------------------------------


def check_failed_request(otel: Otel, error_type: str, outcome: str = "failure") -> None:
    span = span_named(otel.spans(), "kv.get")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["sdkcore.request.outcome"] == outcome
    assert span.attributes["error.type"] == error_type
    exceptions = [e for e in span.events if e.name == "exception"]
    assert len(exceptions) == 1
    assert exceptions[0].attributes is not None
    assert str(exceptions[0].attributes["exception.type"]).endswith(error_type)


@pytest.mark.anyio
@pytest.mark.parametrize("door", ["execute", "hand_wired", "hedge"])
async def test_failure_sets_error_status_and_records_the_exception(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True)
    with anyio.fail_after(SAFETY), pytest.raises(Fatal):
        await through(door, otel.orchestrator(), request, Recorder(otel, error=Fatal("gone")))
    check_failed_request(otel, "Fatal")
    [attempt] = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert attempt.status.status_code is StatusCode.ERROR


def test_sync_failure_sets_error_status_and_records_the_exception(otel: Otel) -> None:
    request = Request(name="kv.get", idempotent=True)
    with pytest.raises(Fatal):
        otel.orchestrator().execute_sync(request, Recorder(otel, error=Fatal("gone")).step)
    check_failed_request(otel, "Fatal")


async def hang(request: Request) -> Any:
    await anyio.sleep_forever()


@pytest.mark.anyio
@pytest.mark.parametrize("door", ["execute", "hand_wired"])
async def test_timeout_cuts_the_attempt_span_too(otel: Otel, door: str) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=0.05)
    orchestrator = otel.orchestrator()
    run = orchestrator.execute if door == "execute" else functools.partial(hand_wired, orchestrator)
    with anyio.fail_after(SAFETY), pytest.raises(UnambiguousTimeoutException):
        await run(request, hang)
    check_failed_request(otel, "UnambiguousTimeoutException", "timeout")
    [attempt] = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.end_time is not None
    # The attempt says what cut it: the request's timeout, not the bare cancellation.
    assert attempt.attributes is not None
    assert attempt.attributes["error.type"] == "UnambiguousTimeoutException"
    assert attempt.status.description


@pytest.mark.anyio
async def test_an_attempt_cut_by_request_cancel_says_so(otel: Otel) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=SAFETY)
    orchestrator = otel.orchestrator()
    entered = anyio.Event()

    async def send(request: Request) -> Any:
        entered.set()
        await anyio.sleep_forever()

    caught: list[BaseException] = []

    async def run() -> None:
        try:
            await orchestrator.execute(request, send)
        except RequestCanceledException as exc:
            caught.append(exc)

    with anyio.fail_after(SAFETY):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await entered.wait()
            request.cancel()
    assert len(caught) == 1
    [attempt] = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert attempt.attributes is not None
    assert attempt.attributes["error.type"] == "RequestCanceledException"


@pytest.mark.anyio
async def test_hand_wired_attempt_without_deadline_records_its_error(otel: Otel) -> None:
    request = Request(name="kv.get", idempotent=True, timeout=None)
    with pytest.raises(Fatal):
        await hand_wired(otel.orchestrator(), request, Recorder(otel, error=Fatal("gone")))
    [attempt] = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert attempt.status.status_code is StatusCode.ERROR


# -- hedged copies --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_hedged_copies_are_sibling_attempt_spans(otel: Otel) -> None:
    current: dict[int, int] = {}

    async def send(request: Request, index: int) -> str:
        current[index] = current_span_id()
        with otel.app.start_as_current_span(f"app.copy{index}"):
            if index < 2:
                await anyio.sleep_forever()
        return f"r{index}"

    request = Request(name="kv.get", idempotent=True, timeout=None)
    with anyio.fail_after(SAFETY), otel.app.start_as_current_span("caller") as caller:
        result = await otel.orchestrator().hedge(request, send, HedgePolicy(4, delay=0.02))
        assert trace.get_current_span() is caller
    assert result == "r2"
    spans = otel.spans()
    parent = span_named(spans, "kv.get")
    assert parent_id(parent) == span_named(spans, "caller").context.span_id
    copies = sorted(
        (s for s in spans if s.name == "sdkcore.attempt"),
        key=lambda s: int(attr(s, "sdkcore.hedge.index")),
    )
    assert len(copies) == 3  # every copy's span ended, the cancelled ones too
    for index, copy in enumerate(copies):
        assert copy.attributes is not None
        assert copy.attributes["sdkcore.hedge.index"] == index
        assert copy.attributes["sdkcore.attempt.number"] == index + 1
        assert parent_id(copy) == parent.context.span_id  # siblings
        assert current[index] == copy.context.span_id  # current in that copy's task
        assert parent_id(span_named(spans, f"app.copy{index}")) == copy.context.span_id
    assert copies[2].status.status_code is StatusCode.UNSET  # the winner
    assert parent.status.status_code is StatusCode.UNSET


# -- what a span carries -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_request_span_is_backdated_to_the_request_creation(otel: Otel) -> None:
    request = Request(name="kv.get")
    await anyio.sleep(0.05)  # built, then sent later: the span covers the wait
    assert await otel.orchestrator().execute(request, Recorder(otel)) == "v"
    span = span_named(otel.spans(), "kv.get")
    [attempt] = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert span.start_time is not None
    assert attempt.start_time is not None
    assert attempt.start_time - span.start_time >= 40_000_000  # ns


@pytest.mark.anyio
async def test_a_call_that_fails_its_argument_checks_starts_no_span_and_records_nothing(
    otel: Otel,
) -> None:
    orchestrator = otel.orchestrator()
    request = Request(name="kv.get", idempotent=True)
    assert await orchestrator.execute(request, Recorder(otel)) == "v"
    # a second execute of the completed request, and a send that is not callable
    with pytest.raises(Exception, match="already"):
        await orchestrator.execute(request, Recorder(otel))
    with pytest.raises(TypeError, match="send must be"):
        await orchestrator.execute(Request(name="kv.bad"), "not callable")  # type: ignore[arg-type]
    names = [span.name for span in otel.spans()]
    assert names.count("kv.get") == 1
    assert "kv.bad" not in names
    durations = otel.metrics()["sdkcore.request.duration"]
    assert sum(count for _, (count, _sum) in durations.points) == 1


@pytest.mark.anyio
async def test_a_refused_requests_span_status_is_its_message_not_its_context(otel: Otel) -> None:
    """Cut at 100 characters, the status of a CouchbaseException's span ended mid-JSON."""
    request = Request(name="kv.get", idempotent=True, timeout=2.5)
    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException) as info:
        await otel.orchestrator(FailFastRetryStrategy()).execute(
            request, Recorder(otel, failures=5)
        )
    [span] = [s for s in otel.spans() if s.name == "kv.get"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == info.value.message[:100]
    assert "{" not in (span.status.description or "")


@pytest.mark.anyio
@pytest.mark.parametrize("door", ["execute", "execute_sync"])
async def test_log_events_carry_the_requests_trace_and_span_ids(otel: Otel, door: str) -> None:
    """An operator joins a retry.* line to its trace: the request span's ids, as W3C
    traceparent writes them (32 and 16 hex digits). Without telemetry there are none."""
    from sdkcore.testing import capture_retry_events

    request = Request(name="kv.get", idempotent=True, timeout=5.0)
    failures = [RetryableError(LOCKED)]

    def step(r: Request) -> str:
        if failures:
            raise failures.pop()
        return "v"

    async def send(r: Request) -> str:
        return step(r)

    orchestrator = otel.orchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0))
    with capture_retry_events() as events:
        if door == "execute":
            assert await orchestrator.execute(request, send) == "v"
        else:
            assert orchestrator.execute_sync(request, step) == "v"
    [scheduled] = [e for e in events if e["event"] == "retry.scheduled"]
    span = span_named(otel.spans(), "kv.get")
    context = span.get_span_context()
    assert context is not None
    assert scheduled["trace_id"] == format(context.trace_id, "032x")
    assert scheduled["span_id"] == format(context.span_id, "016x")

    plain = Request(name="kv.get", idempotent=True, timeout=5.0)
    failures.append(RetryableError(LOCKED))
    with capture_retry_events() as events:
        assert await RetryOrchestrator(BestEffortRetryStrategy(backoff=lambda n: 0.0)).execute(
            plain, send
        )
    [scheduled] = [e for e in events if e["event"] == "retry.scheduled"]
    assert "trace_id" not in scheduled


@pytest.mark.anyio
async def test_hedged_copies_cut_by_request_cancel_end_as_a_cancelled_request(otel: Otel) -> None:
    """As execute's attempt cut by Request.cancel(): the copies' spans say the request was
    cancelled (RequestCanceledException), not a bare cancellation that reads like the
    caller's own."""
    request = Request(name="kv.get_replica", idempotent=True, timeout=5)

    async def send(r: Request, index: int) -> str:
        if index == 1:
            r.cancel()  # both copies in flight
        await anyio.sleep(5)
        return "never"

    with anyio.fail_after(SAFETY), pytest.raises(RequestCanceledException):
        await otel.orchestrator().hedge(request, send, HedgePolicy(2, delay=0.01))
    copies = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert len(copies) == 2
    for copy in copies:
        assert copy.status.status_code is StatusCode.ERROR
        assert attr(copy, "error.type") == "RequestCanceledException"
        assert "Request.cancel()" in (copy.status.description or "")


@pytest.mark.anyio
async def test_a_hand_wired_loop_that_tries_again_by_itself_numbers_its_attempts(
    otel: Otel,
) -> None:
    """attempt() opened again without maybe_retry books the earlier block (maybe applied):
    the spans are attempts 1, 2, 3 (each said 1)."""
    orch = otel.orchestrator()
    request = Request(name="loop", idempotent=True, timeout=5)
    for n in range(3):
        try:
            with orch.attempt(request):
                if n < 2:
                    raise ConnectionResetError("reset")
        except ConnectionResetError:
            continue
    orch.succeed(request)
    attempts = [s for s in otel.spans() if s.name == "sdkcore.attempt"]
    assert sorted(attr(s, "sdkcore.attempt.number") for s in attempts) == [1, 2, 3]
