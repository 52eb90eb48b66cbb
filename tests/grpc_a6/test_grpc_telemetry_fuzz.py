"""Random schedules through sdkcore's gRPC channels WITH telemetry, against a real grpc.aio server.

Each seed builds one ``sdkcore.grpc.insecure_channel(..., telemetry=...)`` (OpenTelemetry SDK,
in-memory reader and exporter: tests/telemetry_kit.py) to a grpc.aio server on 127.0.0.1
started by the test, and runs a couple of dozen concurrent calls on it. Every call has a
method of its own (``/test.Svc/C<i>``) and a method config of its own, so that every metric
point and span of the seed belongs to exactly one call: a ``retryPolicy`` (maxAttempts 2-5,
short or long backoffs, full or proportional jitter, 1-3 retryable codes), a
``hedgingPolicy`` (2-4 copies, hedgingDelay 0-15 ms, some nonFatalStatusCodes) or no policy,
sometimes a method ``timeout``; some seeds add ``retryThrottling``. Calls are unary-unary
(mostly) or unary-stream (retried until they commit; a hedged method's stream gets one
attempt, rfc/0004).

The server plays a script per call and per attempt (by ``grpc-previous-rpc-attempts``): OK,
a retryable or other status, pushback (a delay, or negative, malformed, out of range,
repeated), response headers first and then a status, a delay first, or no answer at all
(only where something else ends the call: a deadline, a cancellation, the close). The client
interferes: ``call.cancel()`` or cancelling the awaiting task, at a random moment, at the
loop's next step after the call was made, or right after a given attempt's status reached
the client (where the retry is decided, or in the backoff), a per-call ``timeout=``
(expiring mid-attempt or mid-backoff), and ``channel.close()`` while calls are in flight or
waiting to retry (calls made after the close are refused by grpc.aio). Some unary calls are
not awaited until they ended (the application waits on ``call.code()``: sdkcore then runs
the retries in a task of its own), and some seeds put application interceptors on the
channel (hedges then go through them as unary calls).

What the client really did is recorded by a probe around grpc.aio's call classes (every
attempt of every shape is a ``grpc.aio._call.Call``, made through the interceptors when
there are some: when sdkcore made it, its own status and when grpc set it), the server
records what it saw per attempt, the interceptors note the current span of each attempt
they run, and a SpanProcessor counts ``on_start``/``on_end``. After the call, the test
reads ``await call.code()``: the call's own status.

Invariants, per call (rfc/0008 "gRPC metrics and spans", gRFC A66/A96/A72):

* ``grpc.client.attempt.started`` = the grpc.aio calls sdkcore made for it ("each attempt,
  when its grpc.aio call is made"); the server saw a subset of them, and an attempt it
  never saw ended CANCELLED or DEADLINE_EXCEEDED (cut before it got there);
* ``grpc.client.attempt.duration``: one point per attempt, with the statuses of the attempt
  spans; each attempt's ``grpc.status`` is its own (grpc's status of that grpc.aio call),
  but see "Ambiguities";
* ``grpc.client.call.duration``: exactly one point, whose ``grpc.status`` is what the
  application got (OK, the AioRpcError's code, CANCELLED for ``asyncio.CancelledError``),
  which is also what ``call.code()`` says;
* A96: ``grpc.client.call.retries`` one point (attempts - 1) for a retried call with more
  than one attempt, none otherwise (0 is not reported); ``grpc.client.call.hedges`` one
  point (copies - 1) for a hedged call that sent more than one copy, none otherwise;
  ``grpc.client.call.transparent_retries`` none (the server is always reachable);
  ``grpc.client.call.retry_delay`` one point per call: 0 for a call of one attempt, and for
  sequential retries at least the backoffs sdkcore scheduled between attempts and at most
  the gaps the probe saw between them (the wait after the last attempt is not counted);
  attempts plus delay fit in the call's duration;
* spans: one ``Sent.test.Svc.C<i>`` (CLIENT) per call, a child of the application's span,
  ``grpc.status`` = the call's status, ERROR with ``<STATUS>...`` iff not OK,
  ``sdkcore.request.outcome``/``sdkcore.request.retries`` as the core metrics say; one
  ``Attempt.`` child (INTERNAL) per attempt, ``previous-rpc-attempts`` its index (0, 1, ...
  in order for retries; the copies' indexes for hedges), ``transparent-retry`` false,
  ERROR iff not OK, within the call's span, sequential for retries; the application's
  interceptors run each attempt under its Attempt span ("the call's task and the
  application's interceptors run under it"); every span started ends exactly once, no
  OpenTelemetry warning is logged (``Calling end() on an ended span``, "Failed to detach
  context" from ``opentelemetry.context``), the OpenTelemetry context of the application's
  task is the same after making and awaiting the call as before;
* core metrics: ``sdkcore.request.duration`` exactly one point: outcome ``success`` (OK),
  ``timeout`` (DEADLINE_EXCEEDED: the server never sends one), ``cancelled``
  (CancelledError), ``failure`` otherwise, ``error.type`` the status code's name of the
  AioRpcError the application got, else its class (``CancelledError``);
  ``sdkcore.request.retries`` one point: the
  ``sdkcore.retry`` events of the call's span (scheduled retries: attempts - 1, or one
  more when the call ended in its backoff, rfc/0008 "A backoff capped at the deadline
  counts as a retry"), 0 for hedged and unretried calls; ``sdkcore.retries`` the same
  count; ``sdkcore.hedges`` copies - 1; ``sdkcore.hedge.wins`` 1 iff a copy after the first
  answered OK;
* nothing leaks: every attempt over, every server handler over, the channel's waiting set
  empty, no task left once the channel closed, no ``telemetry.failed`` log event.

Ambiguities (rfc/0008 does not decide them; the test accepts either reading):

* an attempt whose status grpc had set, but which sdkcore dropped because the call was
  cancelled (or the hedge lost) before it looked, may be recorded CANCELLED ("A hedge
  cancelled because another won ends CANCELLED") although A66 would say its own status;
  a hedged copy dropped so by the call's deadline ends with the call's status,
  DEADLINE_EXCEEDED (``_hedging``: a copy cut past the deadline stays open for
  ``CallTrace.end``);
* an attempt sdkcore cut as the call ended (grpc then ends it CANCELLED, or with
  DEADLINE_EXCEEDED) may carry the call's status when that is not OK (``CallTrace.end``:
  "Attempts still open end with the call's status"); never a winner's OK;
* the awaiting task cancelled: the application gets CancelledError although the call may
  have ended already (``call.code()`` then says its status, rfc/0003); the call may be
  recorded with that status (its outcome from it) or CANCELLED (outcome ``cancelled``);
* a call refused at creation (a closed channel: grpc.aio raises ``UsageError``) is no call
  object: whether it records a call at all is not said. The test only asks that it leaves
  no span open and counts no attempt whose grpc.aio call was never made. Likewise a stream
  that grpc.aio cancelled (the channel closing) before sdkcore's interceptor ran recorded
  nothing (before 2026-11-28 the streams went through interceptors; such a stream is now
  refused when made), and an attempt that the closing channel refuses inside the application's
  interceptors (``UsageError``, no status) may be recorded UNKNOWN;
* with application interceptors, an attempt is the intercepted call sdkcore made: one
  cancelled before the interceptors ran made no call of its own (it counts, ended
  CANCELLED).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
from _fuzz_common import (  # noqa: E402
    ACTIVE,
    CODE,
    HANG,
    OTHER,
    PREV,
    PUSHBACK,
    RETRYABLE,
    SETTLE,
    active,
    attempt_metadata,
    channel_problems,
    close_channel,
    describe_close,
    interfere_on_status,
    probe_calls,
    run_calls,
    settle,
    show,
    status_delay,
)
from fuzz_kit import leaked_tasks  # noqa: E402
from grpc import aio  # noqa: E402
from grpc.aio import _interceptor as aio_interceptor  # noqa: E402
from grpc_server import Server, server_task  # noqa: E402
from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor  # noqa: E402
from telemetry_kit import Metric, Otel  # noqa: E402

from sdkcore.grpc import BackoffJitter, insecure_channel, retry_controller  # noqa: E402
from sdkcore.testing import capture_retry_events  # noqa: E402

pytestmark = pytest.mark.asyncio

#: 0-15, plus seeds that reach rarer schedules: a stream cancelled at the loop's next step
#: after it was made (49, 97: its attempt task cancelled before it first ran), a call nobody
#: awaits cancelled as its retry task is started (98, 181), a hedged call whose first copy
#: commits just past its deadline, before the deadline's timer ran (85: the losing copy was
#: recorded DEADLINE_EXCEEDED in about one run in eight, not CANCELLED), hedged calls the
#: application cancels just past their deadline (468, 587, 623, 723, 758: copies recorded
#: DEADLINE_EXCEEDED under a CANCELLED call, 17 of 42 runs).
SEEDS = (*range(16), 49, 85, 97, 98, 181, 468, 587, 623, 723, 758)
#: A seed whose calls hang fails after this many seconds instead of hanging the suite.
SAFETY = 5.0
#: Slack on time comparisons between sdkcore's clock readings and the probe's.
SLACK = 0.002

KEY = "x-tel-call"
HEADER = "x-tel-headers"
SERVICE = "test.Svc"  # grpc_server.Server serves every method under this name

NAME_OF = {code.value[0]: code.name for code in grpc.StatusCode}
CANCELLED = grpc.StatusCode.CANCELLED.value[0]
PUSHBACKS: tuple[tuple[str, ...], ...] = (
    ("0",),
    ("3",),
    ("8",),
    ("-1",),
    ("abc",),
    ("1.5",),
    ("2147483648",),
    ("3", "4"),
)


@dataclass
class Step:
    """What the server does for one attempt."""

    kind: str  # ok, fail, headers (headers first, then ``code`` or OK), hang
    delay: float = 0.0
    code: str | None = None  # None: OK
    pushback: tuple[str, ...] = ()
    messages: int = 0  # streams: messages sent before the status

    def show(self) -> str:
        text = self.kind if self.code is None else f"{self.kind} {self.code}"
        if self.delay:
            text += f" after {ms(self.delay)}"
        if self.pushback:
            text += " pb " + "/".join(self.pushback)
        if self.messages:
            text += f" +{self.messages}m"
        return text


OK_STEP = Step("ok")


@dataclass
class ClientAttempt:
    """One grpc.aio call the client made for a call (the probe)."""

    index: int
    created_at: float
    code: int | None = None  # grpc's final status of that grpc.aio call
    done_at: float | None = None

    @property
    def status(self) -> str:
        return "in flight" if self.code is None else NAME_OF.get(self.code, str(self.code))


@dataclass
class ServerAttempt:
    index: int
    start: float
    end: float | None = None
    outcome: str = "running"


@dataclass
class Plan:
    i: int
    cid: str
    kind: str  # retry, hedge, none
    shape: str  # unary, stream
    config: dict[str, Any]
    steps: list[Step]
    timeout: float | None
    interference: str  # none, call_cancel, task_cancel
    trigger: str  # timer, status
    interfere_at: float
    cancel_on: int
    start_at: float

    @property
    def method(self) -> str:
        return f"/{SERVICE}/C{self.i}"

    @property
    def hedged(self) -> bool:
        return self.kind == "hedge" and self.shape == "unary"

    @property
    def retried(self) -> bool:
        return self.kind == "retry"


@dataclass
class Record:
    plan: Plan
    attempts: list[ClientAttempt] = field(default_factory=list)
    #: Seeds with an application interceptor: the intercepted calls sdkcore made, one
    #: per attempt (grpc.aio makes the attempt's own call when the interceptors ran; a call
    #: cancelled before they ran never makes one).
    intercepted_calls: list[ClientAttempt] = field(default_factory=list)
    server: list[ServerAttempt] = field(default_factory=list)
    outcome: str = "not_started"  # ok, error, cancelled, create_failed, escaped
    error: BaseException | None = None
    value: Any = None
    start_at: float = 0.0
    end_at: float | None = None
    app_span: int = 0
    #: Not awaited until it ended: the application waits on ``call.code()`` first.
    detached: bool = False
    #: (previous-rpc-attempts, current span id) as the application's interceptor saw each
    #: attempt it ran (seeds with an interceptor only).
    intercepted: list[tuple[int, int]] = field(default_factory=list)
    context_changed: str | None = None
    cancel_returned: bool | None = None
    task_cancelled: bool = False
    #: ``await call.code()`` once the call ended: the call's own status (None: no call).
    code: str | None = None
    #: The answer of a hedged call that ended OK as its awaiting task was cancelled.
    late_value: Any = None
    call: Any = None
    task: Any = None

    @property
    def app_status(self) -> str | None:
        """The status the application got (None: no gRPC status, e.g. UsageError)."""
        if self.outcome == "ok":
            return "OK"
        if self.outcome == "error" and isinstance(self.error, aio.AioRpcError):
            return str(self.error.code().name)
        if self.outcome == "cancelled":
            return "CANCELLED"
        return None


class SpanEnds(SpanProcessor):
    """Counts every span's on_start and on_end, by span id."""

    def __init__(self) -> None:
        self.started: dict[int, str] = {}
        self.ended: Counter[int] = Counter()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started[span.context.span_id] = span.name

    def on_end(self, span: Any) -> None:
        self.ended[span.context.span_id] += 1

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def open_spans(self) -> list[str]:
        return [name for sid, name in self.started.items() if self.ended[sid] == 0]


class SeesTheSpan(aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """An application interceptor: it runs once per attempt, under the attempt's span (A72,
    rfc/0008: "the application's interceptors run under it")."""

    def __init__(self, world: World) -> None:
        self.world = world

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.world.intercepted(details)
        return await continuation(details, request)


class SeesTheSpanStreaming(aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, world: World) -> None:
        self.world = world

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self.world.intercepted(details)
        return await continuation(details, request)


class LogRecords(logging.Handler):
    """Every record the OpenTelemetry loggers emit at WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def _probe_intercepted(original: Any) -> Any:
    def __init__(
        self: Any,
        interceptors: Any,
        request: Any,
        timeout: Any,
        metadata: Any,
        *args: Any,
        **kw: Any,
    ) -> None:
        original(self, interceptors, request, timeout, metadata, *args, **kw)
        if ACTIVE:
            ACTIVE[0].created_intercepted(metadata)

    return __init__


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> None:
    probe_calls(monkeypatch)
    # sdkcore drives both shapes directly: each attempt is one intercepted call
    for intercepted in (
        aio_interceptor.InterceptedUnaryUnaryCall,
        aio_interceptor.InterceptedUnaryStreamCall,
    ):
        monkeypatch.setattr(intercepted, "__init__", _probe_intercepted(intercepted.__init__))


def ms(seconds: float) -> str:
    """A duration in this harness's reports ("1.5ms"; _fuzz_common.ms writes "1.5 ms")."""
    return f"{seconds * 1000:.1f}ms"


class World:
    """One seed: the plan, the channel, the calls and what happened to them."""

    def __init__(self, seed: int, server: Server) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.server = server
        self.problems: list[str] = []
        self.jitter = rng.choice([BackoffJitter.FULL, BackoffJitter.PROPORTIONAL])
        self.throttling: dict[str, Any] | None = None
        if rng.random() < 0.3:
            self.throttling = {
                "maxTokens": rng.randint(3, 10),
                "tokenRatio": rng.choice([0.1, 0.5, 1]),
            }
        self.close_at: float | None = None
        self.grace: float | None = None
        if rng.random() < 0.35:
            self.close_at = rng.uniform(0.03, 0.12)
            self.grace = rng.choice([None, 0.0, 0.01, 0.03])
        self.records = [Record(self.plan(i)) for i in range(rng.randint(16, 24))]
        # Drawn apart, so that the calls' plans above stay those the seed always had: the
        # application's interceptors on the channel (hedges then go through them as unary
        # calls, not as sdkcore's unary-stream RPCs).
        self.intercept = random.Random(seed + 1_000_003).random() < 0.35
        # Unary calls nobody awaits until they ended (the app waits on call.code()): sdkcore
        # runs their retries in a task of its own (rfc/0003, "The direct path").
        detach = random.Random(seed + 2_000_003)
        for r in self.records:
            r.detached = r.plan.shape == "unary" and detach.random() < 0.2
        self.by_cid = {r.plan.cid: r for r in self.records}
        config: dict[str, Any] = {"methodConfig": [r.plan.config for r in self.records]}
        if self.throttling is not None:
            config["retryThrottling"] = self.throttling
        self.config = json.dumps(config)
        self.t0 = 0.0
        self.close_started: float | None = None
        self.close_error: BaseException | None = None

    def describe(self) -> str:
        close = describe_close(self.close_at, self.grace, ms)
        return (
            f"seed {self.seed}: {close}, jitter {self.jitter.name}, "
            f"throttling {self.throttling}, interceptors {self.intercept}"
        )

    # -- the plan ---------------------------------------------------------------------
    def plan(self, i: int) -> Plan:
        rng = self.rng
        kind = rng.choices(["retry", "hedge", "none"], weights=[5, 3, 2])[0]
        shape = "stream" if rng.random() < (0.1 if kind == "hedge" else 0.25) else "unary"
        config: dict[str, Any] = {"name": [{"service": SERVICE, "method": f"C{i}"}]}
        timeout = rng.uniform(0.005, 0.15) if rng.random() < 0.35 else None
        #: The statuses the call's policy retries (or hedges past): most failures use them.
        again: tuple[str, ...] = ()
        if kind == "retry":
            long = rng.random() < 0.3  # long enough that the call surely waits in it
            initial = rng.uniform(0.1, 0.3) if long else rng.uniform(0.001, 0.01)
            again = tuple(sorted(rng.sample(RETRYABLE, rng.randint(1, 3))))
            config["retryPolicy"] = {
                "maxAttempts": rng.randint(2, 5),
                "initialBackoff": f"{initial:.4f}s",
                "maxBackoff": f"{initial * rng.choice([1, 2, 4]):.4f}s",
                "backoffMultiplier": rng.choice([1, 1.5, 2]),
                "retryableStatusCodes": list(again),
            }
            if long and rng.random() < 0.5:  # a deadline that passes in the backoff
                timeout = rng.uniform(0.02, 0.09)
        elif kind == "hedge":
            policy: dict[str, Any] = {
                "maxAttempts": rng.randint(2, 4),
                "hedgingDelay": f"{rng.choice([0, 1, 5, 10, 15]) / 1000:.3f}s",
            }
            if rng.random() < 0.8:
                again = tuple(sorted(rng.sample(RETRYABLE, rng.randint(0, 3))))
                policy["nonFatalStatusCodes"] = list(again)
            config["hedgingPolicy"] = policy
        if rng.random() < 0.15:
            config["timeout"] = f"{rng.uniform(0.02, 0.15):.3f}s"
        interference = rng.choices(["none", "call_cancel", "task_cancel"], weights=[5, 3, 2])[0]
        trigger = "status" if rng.random() < 0.5 else "timer"
        bounded = (
            timeout is not None
            or "timeout" in config
            or (interference != "none" and trigger == "timer")
            or self.close_at is not None
        )
        steps = [self.step(shape, bounded, again) for _ in range(rng.randint(1, 5))]
        # 0 for a timer: the loop's next step after the call was made (call_soon), where
        # grpc.aio's and sdkcore's tasks for the call have been started but not yet run.
        interfere_at = 0.0 if rng.random() < 0.1 else rng.uniform(0.0, 0.06)
        if trigger == "status":
            interfere_at = status_delay(rng)
        return Plan(
            i=i,
            cid=f"s{self.seed}c{i}",
            kind=kind,
            shape=shape,
            config=config,
            steps=steps,
            timeout=timeout,
            interference=interference,
            trigger=trigger,
            interfere_at=interfere_at,
            cancel_on=rng.randint(0, len(steps)),
            start_at=rng.uniform(0.0, 0.04),
        )

    def step(self, shape: str, bounded: bool, again: tuple[str, ...]) -> Step:
        rng = self.rng
        delay = rng.choice([0.0, 0.0, rng.uniform(0.0005, 0.004), rng.uniform(0.005, 0.04)])
        if again and rng.random() < 0.6:
            code = rng.choice(again)
        else:
            code = rng.choice([*RETRYABLE, *RETRYABLE, *OTHER])
        pushback = rng.choice(PUSHBACKS) if rng.random() < 0.25 else ()
        roll = rng.random()
        if roll < 0.08 and bounded:
            return Step("hang")
        if roll < 0.25:
            return Step("ok", delay, messages=rng.randint(0, 3) if shape == "stream" else 0)
        if roll < 0.38:
            return Step("headers", delay, None if rng.random() < 0.3 else code, pushback)
        if roll < 0.55 and shape == "stream":
            return Step("fail", delay, code, pushback, messages=rng.randint(1, 2))
        return Step("fail", delay, code, pushback)

    # -- the probe ----------------------------------------------------------------------
    def created(self, call: Any) -> None:
        """grpc.aio made a call: an attempt of one of this seed's calls, or not ours."""
        md = dict(call._metadata)
        record = self.by_cid.get(md.get(KEY, ""))
        if record is None:
            return
        header = md.get(PREV)
        index = int(header) if header is not None and str(header).isdigit() else 0
        attempt = ClientAttempt(index, time.monotonic())
        record.attempts.append(attempt)
        problems = self.problems

        def done(c: Any) -> None:  # runs inside grpc as the status is set: never raise
            try:
                attempt.done_at = time.monotonic()
                attempt.code = int(c._cython_call._status.code())
            except Exception as exc:  # pragma: no cover - the probe itself failed
                problems.append(f"probe: {exc!r}")

        call.add_done_callback(done)
        interfere_on_status(call, index, record, self.interfere)

    def created_intercepted(self, metadata: Any) -> None:
        """sdkcore made an attempt's call through the application's interceptors."""
        md = dict(metadata or ())
        record = self.by_cid.get(md.get(KEY, ""))
        if record is not None:
            header = md.get(PREV)
            index = int(header) if header is not None and str(header).isdigit() else 0
            record.intercepted_calls.append(ClientAttempt(index, time.monotonic()))

    def intercepted(self, details: Any) -> None:
        """The application's interceptor runs an attempt: note the current span."""
        md = dict(details.metadata or ())
        record = self.by_cid.get(md.get(KEY, ""))
        if record is not None:
            header = md.get(PREV)
            index = int(header) if header is not None and str(header).isdigit() else 0
            span = trace.get_current_span().get_span_context().span_id
            record.intercepted.append((index, span))

    # -- the server ---------------------------------------------------------------------
    def _server_attempt(self, record: Record, context: Any) -> tuple[ServerAttempt, Step]:
        _, _, index = attempt_metadata(context)
        attempt = ServerAttempt(index, time.monotonic())
        record.server.append(attempt)
        steps = record.plan.steps
        return attempt, steps[index] if index < len(steps) else OK_STEP

    @staticmethod
    async def _play(step: Step, context: Any) -> None:
        await asyncio.sleep(step.delay)
        if step.kind == "hang":
            await asyncio.sleep(HANG)
        if step.kind == "headers":
            await context.send_initial_metadata(((HEADER, "1"),))
            await asyncio.sleep(0.005)  # the headers go out on their own (grpc_server.py)

    @staticmethod
    def _end(attempt: ServerAttempt, step: Step, context: Any) -> None:
        if step.pushback:
            context.set_trailing_metadata(tuple((PUSHBACK, v) for v in step.pushback))
        attempt.outcome = "OK" if step.code is None else step.code

    def unary_handler(self, record: Record) -> Any:
        async def handler(request: bytes, context: Any, n: int) -> bytes:
            attempt, step = self._server_attempt(record, context)
            try:
                await self._play(step, context)
                self._end(attempt, step, context)
                if step.code is None:
                    return f"ok:{record.plan.cid}:{attempt.index}".encode()
                await context.abort(CODE[step.code], f"{record.plan.cid}/{attempt.index}")
                raise AssertionError("unreachable")
            except asyncio.CancelledError:
                attempt.outcome = "cancelled"
                raise
            finally:
                attempt.end = time.monotonic()

        return handler

    def stream_handler(self, record: Record) -> Any:
        async def handler(request: bytes, context: Any, n: int) -> Any:
            attempt, step = self._server_attempt(record, context)
            try:
                await self._play(step, context)
                for j in range(step.messages):
                    yield f"m:{record.plan.cid}:{attempt.index}:{j}".encode()
                self._end(attempt, step, context)
                if step.code is not None:
                    await context.abort(CODE[step.code], f"{record.plan.cid}/{attempt.index}")
            except asyncio.CancelledError:
                attempt.outcome = "cancelled"
                raise
            finally:
                attempt.end = time.monotonic()

        return handler

    # -- the client ---------------------------------------------------------------------
    async def run(self, otel: Otel, ends: SpanEnds) -> None:
        before = set(asyncio.all_tasks())
        self.t0 = time.monotonic()
        for r in self.records:
            name = f"C{r.plan.i}"
            if r.plan.shape == "unary":
                self.server.unary_unary(name, self.unary_handler(r))
            else:
                self.server.unary_stream(name, self.stream_handler(r))
        self.target = self.server.target
        self.channel = insecure_channel(
            self.target,
            service_config=self.config,
            telemetry=otel.telemetry,
            backoff_jitter=self.jitter,
            interceptors=[SeesTheSpan(self), SeesTheSpanStreaming(self)] if self.intercept else (),
        )
        self.core = retry_controller(self.channel)

        def hung() -> None:
            running = [r.plan.cid for r in self.records if r.end_at is None]
            self.problems.append(f"calls still running after {SAFETY} s: {running}")

        closer = None if self.close_at is None else self.close()
        await run_calls([self.run_call(r, otel) for r in self.records], closer, SAFETY, hung)
        # Attempts still running on the server once their calls ended must see their
        # cancellation soon; streams account a committed call's end in a task: wait for both.
        await settle(
            lambda: (
                any(a.end is None for r in self.records for a in r.server)
                or any(a.code is None for r in self.records for a in r.attempts)
                or any(not name.startswith("app.") for name in ends.open_spans())
            )
        )
        # A finished call left in the set is a leak; one still running (a call nobody awaits
        # whose reader was cancelled, no deadline, a copy the server never answers: seed
        # 273) is rightly there until it ends or the channel closes.
        self.waiting = sum(1 for call in self.core._waiting if call.done())
        if self.close_started is None:
            self.close_error = await close_channel(self.channel, bound=2.0)
        self.leaked_tasks = await leaked_tasks(before, server_task)

    async def close(self) -> None:
        assert self.close_at is not None
        await asyncio.sleep(self.close_at)
        self.close_started = time.monotonic()
        self.close_error = await close_channel(self.channel, self.grace)

    async def run_call(self, record: Record, otel: Otel) -> None:
        plan = record.plan
        loop = asyncio.get_running_loop()
        await asyncio.sleep(plan.start_at)
        with otel.app.start_as_current_span(f"app.{plan.cid}") as app_span:
            record.app_span = app_span.get_span_context().span_id
            before = otel_context.get_current()
            record.start_at = time.monotonic()
            if plan.shape == "unary":
                multi = self.channel.unary_unary(plan.method)
            else:
                multi = self.channel.unary_stream(plan.method)
            try:
                call = multi(b"request", metadata=((KEY, plan.cid),), timeout=plan.timeout)
            except BaseException as exc:
                record.outcome = "create_failed"
                record.error = exc
                record.end_at = time.monotonic()
                self.check_context(record, before)
                return
            self.check_context(record, before)
            record.call = call
            record.task = asyncio.current_task()
            handle: Any = None
            if plan.trigger == "timer" and plan.interference != "none":
                if plan.interfere_at:
                    handle = loop.call_later(plan.interfere_at, self.interfere, record)
                else:
                    handle = loop.call_soon(self.interfere, record)
            try:
                if plan.shape == "unary":
                    if record.detached:  # the call runs on its own; the app reads its end
                        await call.code()
                    record.value = await call
                else:
                    record.value = [m async for m in call]
                record.outcome = "ok"
            except aio.AioRpcError as exc:
                record.outcome = "error"
                record.error = exc
            except asyncio.CancelledError as exc:
                record.outcome = "cancelled"
                record.error = exc
                task = asyncio.current_task()
                # 3.11+ count them
                if record.task_cancelled and task is not None and hasattr(task, "uncancel"):
                    task.uncancel()
            except BaseException as exc:
                record.outcome = "escaped"
                record.error = exc
            finally:
                record.end_at = time.monotonic()
                if handle is not None:
                    handle.cancel()
            self.check_context(record, before)
            record.call = record.task = None
            # The call's own status, as any reader of the call sees it once it ended (after
            # the awaiting task's cancellation: OK, or the status it had, or CANCELLED).
            try:
                record.code = (await asyncio.wait_for(call.code(), 1.0)).name
            except BaseException as exc:
                record.code = f"code() raised {show(exc)}"
            if plan.hedged and record.code == "OK" and record.outcome == "cancelled":
                # Which copy answered a call that ended OK before the task's cancellation
                # reached it (for sdkcore.hedge.wins).
                try:
                    record.late_value = await asyncio.wait_for(call, 1.0)
                except BaseException as exc:
                    record.late_value = f"await raised {show(exc)}"

    def check_context(self, record: Record, before: Any) -> None:
        after = otel_context.get_current()
        if after != before and record.context_changed is None:
            record.context_changed = (
                f"current span {trace.get_current_span(after).get_span_context().span_id:x}, "
                f"was {trace.get_current_span(before).get_span_context().span_id:x}"
            )

    def interfere(self, record: Record) -> None:
        if record.end_at is not None or record.call is None:
            return
        if record.plan.interference == "call_cancel":
            record.cancel_returned = bool(record.call.cancel())
        elif not record.task_cancelled:
            record.task_cancelled = True
            record.task.cancel()

    # -- the invariants -------------------------------------------------------------------
    def check(self, otel: Otel, ends: SpanEnds, logs: LogRecords, events: list[Any]) -> None:
        metrics = otel.metrics()
        spans = otel.spans()
        by_parent: dict[int, list[ReadableSpan]] = {}
        sent: dict[str, list[ReadableSpan]] = {}
        for span in spans:
            if span.name.startswith("Sent."):
                sent.setdefault(span.name, []).append(span)
            if span.parent is not None:
                by_parent.setdefault(span.parent.span_id, []).append(span)
        target = f"dns:///{self.target}"
        for name, metric in metrics.items():
            for attributes, _ in metric.points:
                if name.startswith("grpc.") and attributes.get("grpc.target") != target:
                    self.problems.append(f"{name}: grpc.target {attributes} is not {target}")
                if name.startswith("grpc.") and attributes.get("grpc.method") == "other":
                    self.problems.append(f"{name}: a configured method recorded as 'other'")
        open_spans = ends.open_spans()
        for record in self.records:
            self.check_record(record, metrics, sent, by_parent, open_spans)
        # -- every span ends exactly once; OpenTelemetry logged nothing -----------------
        if open_spans:
            self.problems.append(f"spans started and never ended: {sorted(open_spans)}")
        twice = [ends.started.get(sid, "?") for sid, n in ends.ended.items() if n > 1]
        if twice:
            self.problems.append(f"spans ended more than once: {twice}")
        if logs.records:
            self.problems.append(f"OpenTelemetry logged: {logs.records[:5]}")
        failed = [e for e in events if e.get("event") == "telemetry.failed"]
        if failed:
            self.problems.append(f"telemetry.failed logged: {failed[:3]}")
        self.problems += channel_problems(self.waiting, self.close_error, self.leaked_tasks)

    def check_record(
        self,
        record: Record,
        metrics: dict[str, Metric],
        sent_spans: dict[str, list[ReadableSpan]],
        by_parent: dict[int, list[ReadableSpan]],
        open_spans: list[str],
    ) -> None:
        plan = record.plan
        found: list[str] = []
        problem = found.append
        full = plan.method
        short = full.lstrip("/")
        dotted = short.replace("/", ".")

        def grpc_points(name: str) -> list[tuple[dict[str, Any], Any]]:
            metric = metrics.get(name)
            if metric is None:
                return []
            return [(a, v) for a, v in metric.points if a.get("grpc.method") == short]

        def core_points(name: str) -> list[tuple[dict[str, Any], Any]]:
            metric = metrics.get(name)
            if metric is None:
                return []
            return [(a, v) for a, v in metric.points if a.get("sdkcore.request.name") == full]

        attempts = sorted(record.attempts, key=lambda a: a.created_at)
        if record.intercepted_calls:
            # The attempts are the intercepted calls sdkcore made; grpc's own call of each,
            # if the interceptors ran, has its status. One cut before they ran made no call
            # of its own and reached nothing: it ended CANCELLED.
            own = {a.index: a for a in attempts}
            merged = []
            for outer in record.intercepted_calls:
                inner = own.pop(outer.index, None)
                if inner is None:
                    merged.append(
                        ClientAttempt(outer.index, outer.created_at, CANCELLED, outer.created_at)
                    )
                else:
                    merged.append(
                        ClientAttempt(outer.index, outer.created_at, inner.code, inner.done_at)
                    )
            for a in own.values():
                problem(f"attempt {a.index} made without an intercepted call")
            attempts = merged
        n = len(attempts)
        status = record.app_status
        started = sum(v for _, v in grpc_points("grpc.client.attempt.started"))
        durations = grpc_points("grpc.client.attempt.duration")
        calls = grpc_points("grpc.client.call.duration")
        sent = sent_spans.get(f"Sent.{dotted}", [])
        telemetry = (
            f"started {started}, attempt.duration "
            f"{sorted((a['grpc.status'], c) for a, (c, _) in durations)}, call.duration "
            f"{sorted((a['grpc.status'], c) for a, (c, _) in calls)}, sent spans {len(sent)}"
        )

        left_open = [name for name in open_spans if name.endswith(f".{dotted}")]
        if left_open:
            problem(f"its spans started and never ended: {sorted(left_open)}")

        # -- the application's outcome (sanity: the test's own premises) -----------------
        interfered = (
            record.cancel_returned is True
            or record.task_cancelled
            or (self.close_started is not None and self.close_started < (record.end_at or 1e18))
        )
        if record.outcome == "cancelled" and not interfered:
            problem("CancelledError without call.cancel(), the task's cancellation or a close")
        if record.outcome == "escaped" and not isinstance(record.error, aio.UsageError):
            problem(f"the call raised {show(record.error)}")
        if record.context_changed is not None:
            problem(f"the OpenTelemetry context changed across the call: {record.context_changed}")

        if (
            record.outcome == "escaped"
            and isinstance(record.error, aio.UsageError)
            and not (sent or calls or started or durations)
            and self.close_started is not None
            and self.close_started <= record.start_at
        ):
            # Made once the close had begun: grpc.aio's own call (rfc/0003), which the
            # closing channel refused inside the application's interceptors. sdkcore made
            # no attempt of it and records nothing; the intercepted call the probe saw is
            # grpc.aio's (found with more seeds: 145).
            self.report(record, found, telemetry)
            return

        # -- attempts: the client's, the server's, attempt.started ------------------------
        if started != n:
            problem(f"grpc.client.attempt.started is {started}, the client made {n} attempt(s)")
        made = Counter(a.index for a in attempts)
        for seen in record.server:
            if made[seen.index] == 0:
                problem(f"the server saw attempt {seen.index}, which the client never made")
        for seen in record.server:
            if seen.end is None:
                problem(f"attempt {seen.index} still running on the server {SETTLE} s later")
        reached = {s.index for s in record.server}
        for a in attempts:
            if a.code is None:
                problem(f"attempt {a.index} still in flight after its call ended")
            elif a.index not in reached and a.status not in ("CANCELLED", "DEADLINE_EXCEEDED"):
                problem(f"attempt {a.index} never reached the server, yet ended {a.status}")

        if record.outcome in ("create_failed", "not_started"):
            # Refused at creation: no call object (see Ambiguities); only "its spans end"
            # and "no attempt counted that grpc.aio never made" (above) apply.
            self.report(record, found, telemetry)
            return
        if status is None:  # an escaped UsageError (a stream refused by the closed channel)
            self.report(record, found, telemetry)
            return
        if (
            plan.shape == "stream"
            and n == 0
            and not (sent or calls or started)
            and self.close_started is not None
            and self.close_started <= (record.end_at or 0.0)
        ):
            # grpc.aio cancelled the stream before sdkcore's interceptor ran (the channel
            # was closing): sdkcore never saw a call (see Ambiguities; the interceptor
            # path's case, kept for a stream the closing channel refuses unseen).
            self.report(record, found, telemetry)
            return
        if record.outcome in ("ok", "error") and record.code != status:
            problem(f"the application got {status}, call.code() says {record.code}")
        # The call's status: what the application got; after the awaiting task's own
        # cancellation, what the call says it ended with (rfc/0003: only a cancelled call
        # reports CANCELLED: it may have ended before the cancellation reached it), or
        # CANCELLED (see Ambiguities).
        accepted = [record.code]
        if record.task_cancelled and record.outcome == "cancelled":
            accepted.append("CANCELLED")
        recorded_calls = [(a["grpc.status"], c) for a, (c, _) in calls]
        status = recorded_calls[0][0] if len(recorded_calls) == 1 else record.code

        # -- grpc.client.call.duration: one point, the application's status ---------------
        if len(recorded_calls) != 1 or recorded_calls[0] not in [(s, 1) for s in accepted]:
            problem(f"grpc.client.call.duration points {calls}, expected one with {accepted}")
        call_duration = sum(s for _, (_, s) in calls)

        # -- spans ----------------------------------------------------------------------
        if len(sent) != 1:
            problem(f"{len(sent)} Sent.{dotted} spans, expected 1")
            self.report(record, found, telemetry)
            return
        (span,) = sent
        attributes = dict(span.attributes or {})
        if span.kind is not trace.SpanKind.CLIENT:
            problem(f"Sent span kind {span.kind}")
        if span.parent is None or span.parent.span_id != record.app_span:
            problem("the Sent span is not a child of the application's span")
        if attributes.get("grpc.status") != status:
            problem(f"Sent span grpc.status {attributes.get('grpc.status')}, the call's {status}")
        expected_status = trace.StatusCode.OK if status == "OK" else trace.StatusCode.ERROR
        if span.status.status_code is not expected_status:  # A72
            problem(f"Sent span status {span.status.status_code} for {status}")
        if status != "OK" and not (span.status.description or "").startswith(str(status)):
            problem(f"Sent span status description {span.status.description!r}")
        children = by_parent.get(span.context.span_id, [])
        tries = sorted(
            (c for c in children if c.name == f"Attempt.{dotted}"),
            key=lambda s: s.start_time or 0,
        )
        strangers = [c.name for c in children if c.name != f"Attempt.{dotted}"]
        if strangers:
            problem(f"unexpected children of the Sent span: {strangers}")
        if len(tries) != n:
            problem(f"{len(tries)} Attempt spans, the client made {n} attempt(s)")
        indexes = [dict(s.attributes or {}).get("previous-rpc-attempts") for s in tries]
        if plan.hedged:
            if sorted(i for i in indexes if i is not None) != sorted(a.index for a in attempts):  # type: ignore[type-var]
                problem(f"Attempt spans previous-rpc-attempts {indexes}")
        elif indexes != list(range(len(tries))) or [a.index for a in attempts] != list(range(n)):
            problem(
                f"previous-rpc-attempts of the Attempt spans {indexes}, of the attempts made "
                f"{[a.index for a in attempts]}"
            )
        recorded: list[str] = []
        by_index = {a.index: a for a in attempts}
        for s in tries:
            a_attr = dict(s.attributes or {})
            st = str(a_attr.get("grpc.status"))
            recorded.append(st)
            if s.kind is not trace.SpanKind.INTERNAL:
                problem(f"Attempt span kind {s.kind}")
            if a_attr.get("transparent-retry") is not False:
                problem(f"Attempt span transparent-retry {a_attr.get('transparent-retry')}")
            if s.status.status_code is not (
                trace.StatusCode.OK if st == "OK" else trace.StatusCode.ERROR
            ):
                problem(f"Attempt span status {s.status.status_code} for {st}")
            if (s.start_time or 0) < (span.start_time or 0) or (s.end_time or 0) > (
                span.end_time or 0
            ):
                problem("an Attempt span outside its Sent span")
            index = a_attr.get("previous-rpc-attempts")
            attempt = by_index.get(index) if isinstance(index, int) else None
            if attempt is not None and st != attempt.status:
                # See "Ambiguities": a status sdkcore dropped may be recorded CANCELLED; an
                # attempt sdkcore cut as the call ended, with the call's status.
                dropped = (st == "CANCELLED" and (status == "CANCELLED" or plan.hedged)) or (
                    st == status == "DEADLINE_EXCEEDED" and plan.hedged
                )
                # Not for a hedge another copy beat: rfc/0008 says it ends CANCELLED.
                cut = st == status != "OK" and attempt.status in ("CANCELLED", "DEADLINE_EXCEEDED")
                # An attempt the closing channel refused inside the interceptors (it made no
                # call of its own): grpc.aio raised UsageError, which has no status.
                refused = (
                    st == "UNKNOWN"
                    and index not in {x.index for x in record.attempts}
                    and self.close_started is not None
                )
                if not (dropped or cut or refused):
                    problem(f"attempt {index} recorded {st}, grpc ended it {attempt.status}")
        if self.intercept:
            # Every attempt the interceptors ran (it made its own grpc.aio call) ran under
            # its Attempt span; none under another span.
            ran = {a.index for a in record.attempts}
            by_span = {s.context.span_id: dict(s.attributes or {}) for s in tries}
            spans_seen = set(record.intercepted)
            for s in tries:
                index = dict(s.attributes or {}).get("previous-rpc-attempts")
                if index in ran and (index, s.context.span_id) not in spans_seen:
                    problem(
                        f"the application's interceptor did not run attempt {index} under its "
                        f"Attempt span (it saw {record.intercepted})"
                    )
            for index, span_id in spans_seen:
                if by_span.get(span_id, {}).get("previous-rpc-attempts") != index:
                    problem(f"the application's interceptor ran attempt {index} under another span")
        if not plan.hedged:
            for x, y in itertools.pairwise(tries):
                if (x.end_time or 0) > (y.start_time or 0):
                    problem("sequential Attempt spans overlap")
        by_status = Counter(a["grpc.status"] for a, (c, _) in durations for _ in range(c))
        if by_status != Counter(recorded):
            problem(
                f"grpc.client.attempt.duration statuses {dict(by_status)}, Attempt spans "
                f"{dict(Counter(recorded))}"
            )
        attempt_sum = sum(s for _, (_, s) in durations)

        # -- A96 -------------------------------------------------------------------------
        retries = grpc_points("grpc.client.call.retries")
        hedges = grpc_points("grpc.client.call.hedges")
        transparent = grpc_points("grpc.client.call.transparent_retries")
        want_retries = [(1, n - 1)] if plan.retried and n > 1 else []
        want_hedges = [(1, n - 1)] if plan.hedged and n > 1 else []
        if [v for _, v in retries] != want_retries:
            problem(f"grpc.client.call.retries {[v for _, v in retries]}, expected {want_retries}")
        if [v for _, v in hedges] != want_hedges:
            problem(f"grpc.client.call.hedges {[v for _, v in hedges]}, expected {want_hedges}")
        if transparent:
            problem(f"grpc.client.call.transparent_retries {[v for _, v in transparent]}")
        delays = grpc_points("grpc.client.call.retry_delay")
        if [c for _, (c, _) in delays] != [1]:
            problem(f"grpc.client.call.retry_delay points {delays}, expected one")
        delay = sum(s for _, (_, s) in delays)
        events = [e for e in span.events if e.name == "sdkcore.retry"]
        if n <= 1 and delay != 0.0:
            problem(f"grpc.client.call.retry_delay {ms(delay)} for a call of {n} attempt(s)")
        if not plan.hedged and n > 1:
            scheduled = sum(
                float(dict(e.attributes or {}).get("sdkcore.retry.delay", 0.0))  # type: ignore[arg-type,misc]
                for e in events[: n - 1]
            )
            gaps = sum(
                (b.created_at - a.done_at)
                for a, b in itertools.pairwise(attempts)
                if a.done_at is not None
            )
            if delay < scheduled - SLACK:
                problem(f"retry_delay {ms(delay)} is less than the backoffs {ms(scheduled)}")
            if delay > gaps + SLACK:
                problem(f"retry_delay {ms(delay)} exceeds the gaps between attempts {ms(gaps)}")
            if attempt_sum + delay > call_duration + SLACK:
                problem(
                    f"attempts {ms(attempt_sum)} + retry_delay {ms(delay)} exceed the call's "
                    f"{ms(call_duration)}"
                )
        elif delay < 0.0 or delay > call_duration + SLACK:
            problem(f"retry_delay {ms(delay)} outside [0, call {ms(call_duration)}]")

        # -- core metrics ---------------------------------------------------------------
        # rfc/0008: outcome success / timeout (the call's deadline: the server never sends
        # DEADLINE_EXCEEDED) / cancelled (call.cancel(), the close, the caller's own
        # cancellation) / failure; error.type the status code's name of the AioRpcError the
        # application got (OpenTelemetry's RPC conventions), else its class.
        cancelled = record.outcome == "cancelled"
        expected: list[tuple[str, str | None]]
        if status == "OK":
            expected = [("success", None)]
        elif status == "CANCELLED" and cancelled:
            expected = [("cancelled", "CancelledError")]
        elif status == "DEADLINE_EXCEEDED":
            expected = [("timeout", "DEADLINE_EXCEEDED")]
        else:
            expected = [("failure", status)]
        if cancelled and status != "CANCELLED" and status != "OK":
            # The call had ended with its status when the caller's cancellation reached
            # it: the outcome of either reading (see Ambiguities).
            expected.append(("cancelled", "CancelledError"))
        durations_core = core_points("sdkcore.request.duration")
        got = [
            (a.get("sdkcore.request.outcome"), a.get("error.type"), c)
            for a, (c, _) in durations_core
        ]
        if len(got) != 1 or got[0][2] != 1 or got[0][:2] not in expected:
            problem(f"sdkcore.request.duration {got}, expected one of {expected}")
        outcome = got[0][0] if len(got) == 1 else None
        if attributes.get("sdkcore.request.outcome") != outcome:
            problem(
                f"Sent span sdkcore.request.outcome {attributes.get('sdkcore.request.outcome')}"
            )
        core_retries = [v for _, v in core_points("sdkcore.request.retries")]
        booked = len(events)
        if plan.retried:
            want = booked
            if not n - 1 <= booked <= n:
                problem(f"{booked} sdkcore.retry events for {n} attempt(s)")
            if booked == n and record.outcome == "ok":
                problem("a retry booked after the attempt that answered")
        else:
            want = 0
            if events:
                problem(f"{len(events)} sdkcore.retry events on a call that is never retried")
        if core_retries != [(1, want)]:
            problem(f"sdkcore.request.retries {core_retries}, expected [(1, {want})]")
        if attributes.get("sdkcore.request.retries") != want:
            problem(
                f"Sent span sdkcore.request.retries {attributes.get('sdkcore.request.retries')}"
            )
        counted = sum(v for _, v in core_points("sdkcore.retries"))
        if counted != booked:
            problem(f"sdkcore.retries {counted}, {booked} retry events")
        hedges_core = sum(v for _, v in core_points("sdkcore.hedges"))
        copies = max(n - 1, 0) if plan.hedged else 0
        if hedges_core != copies:
            problem(f"sdkcore.hedges {hedges_core}, expected {copies}")
        wins = sum(v for _, v in core_points("sdkcore.hedge.wins"))
        answer = record.value if record.outcome == "ok" else record.late_value
        winner = status == "OK" and isinstance(answer, bytes) and not answer.endswith(b":0")
        if wins != (1 if plan.hedged and winner else 0):
            problem(f"sdkcore.hedge.wins {wins}, answered {answer!r} with {status}")
        self.report(record, found, telemetry)

    def report(self, record: Record, found: list[str], telemetry: str) -> None:
        if not found:
            return
        plan = record.plan
        t0 = record.start_at
        client = [
            (
                a.index,
                a.status,
                f"+{ms(a.created_at - t0)}",
                None if a.done_at is None else f"+{ms(a.done_at - t0)}",
            )
            for a in sorted(record.attempts, key=lambda a: a.created_at)
        ]
        server = [(s.index, s.outcome) for s in record.server]
        when = "start" if plan.trigger == "timer" else f"attempt {plan.cancel_on} ended"
        shape = f"{plan.shape}{' (not awaited)' if record.detached else ''}"
        head = (
            f"call {plan.cid} ({plan.kind} {shape}, config {json.dumps(plan.config)}, "
            f"timeout {None if plan.timeout is None else ms(plan.timeout)}, "
            f"{plan.interference} {ms(plan.interfere_at)} after {when}, "
            f"steps [{', '.join(s.show() for s in plan.steps)}], started "
            f"+{ms(record.start_at - self.t0)})\n"
            f"    app got: {record.outcome} {show(record.error) or repr(record.value)} after "
            f"{ms((record.end_at or t0) - t0)}, then call.code() {record.code}; "
            f"cancel() returned {record.cancel_returned}, "
            f"task cancelled {record.task_cancelled}\n"
            f"    client attempts (index, status, made, ended): {client}\n"
            f"    server saw: {server}\n"
            f"    telemetry: {telemetry}"
        )
        self.problems.append(head + "".join(f"\n    - {p}" for p in found))


@pytest.mark.parametrize("seed", SEEDS)
async def test_grpc_telemetry_under_random_schedules(
    seed: int, server: Server, probe: None
) -> None:
    otel = Otel()
    ends = SpanEnds()
    otel.tracers.add_span_processor(ends)
    logs = LogRecords()
    otel_logger = logging.getLogger("opentelemetry")
    otel_logger.addHandler(logs)
    world = World(seed, server)
    try:
        with active(world):
            with capture_retry_events() as events:
                await world.run(otel, ends)
            world.check(otel, ends, logs, events)
    finally:
        otel_logger.removeHandler(logs)
        otel.shutdown()
    if world.problems:  # the report alone: no traceback of the test's own code
        pytest.fail(f"{world.describe()}\n" + "\n".join(world.problems), pytrace=False)
