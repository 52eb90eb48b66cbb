"""Random schedules through sdkcore's gRPC channels, against a real grpc.aio server.

Each seed builds one ``sdkcore.grpc.insecure_channel`` with a random service config: a
``retryPolicy`` (maxAttempts 2-5, backoffs of 1-10 ms, retryable codes among
UNAVAILABLE/ABORTED/RESOURCE_EXHAUSTED) or a ``hedgingPolicy`` (2-4 copies, hedgingDelay
0-10 ms, some nonFatalStatusCodes), sometimes ``retryThrottling`` and a method-config
``timeout``, and runs a few dozen concurrent calls on it: unary-unary calls, and
unary-stream calls (retried until they commit, rfc/0003; a hedged method's streaming
calls are not hedged and get one attempt, rfc/0004). The server plays a script per call
(the call is named by the client-sent ``x-fuzz-call`` metadata) and per attempt (by its
``grpc-previous-rpc-attempts``): an answer, a retryable or other status, pushback
(``grpc-retry-pushback-ms``: a delay, or negative, malformed, out of range or repeated),
headers (or messages) first and then a status, a while to wait, or no answer at all
(only for a call something else ends: a deadline, a cancellation, the close). The client
interferes: ``call.cancel()`` or cancelling the awaiting task, at a random moment or
right after a given attempt's status reached the client (where a retry or the next copy
is being decided), a per-call deadline, and closing the channel (``close()`` /
``close(grace)``) while calls are in flight or waiting to retry. Once every call has
ended, every promise below is checked; all violations of a seed are reported together.

Small real delays drive the schedule, so a seed's interleaving varies from run to run,
but its plan (config, calls, scripts, interferences) is fixed by the seed. Every check
holds whatever the interleaving.

What the client did is recorded by a probe around grpc.aio's own call class
(``grpc.aio._call.Call``: every attempt of every shape is one, hedges opened as
unary-stream RPCs included), installed for the test only: per attempt, when sdkcore
**created** it (it then left sdkcore's hands: grpc.aio sends it without asking again),
its metadata and own deadline; when its final status reached the client (a done
callback, which grpc runs as it sets the status) with that status, trailers and headers;
and when sdkcore's own code first got its answer, status, headers or a message (its
``await``, ``read()``, ``code()`` or ``initial_metadata()`` returned: a few loop steps
after the status arrived). The probe keeps no reference to the calls (grpc.aio cancels a
call that is garbage collected). The loop's task factory notes when each task started:
a hedge copy made in its own task counts from when the runner started that task (it
**booked** the copy). A spy on ``RetryThrottler.record_failure/record_success`` counts
the bucket's operations.

"After" an event means: the attempt was created after it, in the one sequence of events
of the seed. An attempt created before may still reach the server after it (it was on
the wire): that is allowed; the server's records are checked against what the client
created. The events:

* ``call.cancel()``: when it was called (it is synchronous);
* the awaiting task's cancellation: when the ``CancelledError`` reached the test's own
  coroutine (sdkcore's ``__await__`` sees it first, in the same step). ``task.cancel()``
  was called earlier, but the task only learns of it when it next runs;
* the channel's close: when ``close()`` was called (``_Channel.close`` cancels the calls
  waiting between attempts before its first await); with a grace, the channel takes
  new attempts (retries, hedges) until it stops (``_Controller._close_calls``: every call
  that may send one is over, or the grace is), as grpcio's own retries within a grace;
* the deadline: the first attempt's creation plus the call's timeout (the smaller of the
  call's and the method config's). sdkcore's clock starts before that attempt is made,
  so this is never earlier than its deadline. An attempt made after it (a stalled loop)
  must have no time left, and then never reaches the server (grpc fails it at once);
* a status, headers or a message: when sdkcore's code got it (not when grpc set it: a
  decision can only follow what the code has seen). A hedge copy is compared by when it
  was booked: one booked before a decision reached sdkcore may still be made in its
  task's first step after it, as tests/test_doors_fuzz.py allows for the core's hedges.

Assumptions, each from the documents or from grpcio 1.85 as observed:

* hedges and cancellation: ``call.cancel()`` and the caller's cancellation cancel the
  hedge runner's task, which learns of it when it next runs: a copy due in that turn
  may still be made (as tests/test_doors_fuzz.py assumes for the core's hedges on
  asyncio); it must be cut at once (its status CANCELLED, never an answer). rfc/0004
  promises that every copy is cancelled and that the cancellation propagates, both
  checked; not that none starts;
* grpc C-core passes on only the last of repeated ``grpc-retry-pushback-ms`` values
  (observed): every pushback check reads the trailers the client received, by the A6
  rule (a single ASCII decimal signed 32-bit integer; negative or unparsable: don't
  retry);
* a pushback that would end past the deadline ends the call with DEADLINE_EXCEEDED at
  once, before the deadline (sdkcore/_decision.py rule 6, rfc/0007);
* the server is always reachable, so no A6 transparent retry can happen (an attempt
  re-sent with the same header would be reported).

The promises checked (A6 text, rfc/0003, rfc/0004, README):

* at most maxAttempts attempts per retried call, maxAttempts copies per hedged call, one
  attempt for a streaming call of a hedged method, made and seen by the server;
  ``grpc-previous-rpc-attempts`` absent on the first and 1, 2, ... on the next ones, in
  creation order; the server saw only attempts the client made, each once;
* a retry only after the previous attempt ended, with a status in
  retryableStatusCodes, no response headers (or, on a stream, message: the call is
  committed), no "don't retry" pushback, and at least the pushback's delay after it;
* hedging: no copy booked after an OK, a fatal status, another copy's headers or a
  "don't retry" pushback reached sdkcore, nor less than a pushback's delay after it; the
  first copy to decide the call (an OK, a fatal status, headers) is its outcome;
* no attempt after ``call.cancel()`` (or the CancelledError), the close or the deadline,
  nor after the call ended; every attempt's own deadline within the call's;
* the outcome: an answer one of its attempts sent OK (for a retried call, the last one;
  a stream: all its messages, from one attempt); a ``grpc.aio.AioRpcError`` with the
  status of the last attempt (retries) or of a copy (hedging; for a non-fatal one, once
  no copy is in flight); ``grpc-previous-rpc-attempts`` in the answer's or error's
  trailers naming that attempt; DEADLINE_EXCEEDED only for a call with a deadline, once
  it passed; ``asyncio.CancelledError`` only after ``call.cancel()`` returned True, the
  task's cancellation or the close, and always after the first two (grpc.aio's
  semantics, rfc/0003); nothing else escapes;
* throttling (``RetryController.throttler``): the bucket's arithmetic replayed from its
  operations; one success per call answered OK; one failure per attempt that ended with
  a status the policy retries (or hedges past) or a "don't retry" pushback (A6
  "Throttling", rfc/0003 and rfc/0004): exactly that many for retried calls that ended
  with their own status and nobody interfered, at most that many otherwise; no more
  retries than failures that left retries allowed;
* nothing leaks: every attempt the client made is over once its call ended, no server
  handler still runs (an attempt nobody cancelled: a "hang" step never ends by itself),
  the channel's waiting set and replay buffer are empty, the channel closes, and no
  task is left but the test's own (and the server's).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
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
    check_attempt_deadlines,
    check_attempt_headers,
    close_channel,
    describe_close,
    interfere_on_status,
    ms,
    name_of,
    probe_calls,
    run_calls,
    settle,
    show,
    slack,
    stamped,
    status_delay,
)
from fuzz_kit import leaked_tasks  # noqa: E402
from grpc import aio  # noqa: E402
from grpc.aio import _call as aio_call  # noqa: E402 - the probe (see the module docstring)
from grpc_server import Server, server_task  # noqa: E402

from sdkcore.grpc import (  # noqa: E402
    RetryThrottler,
    insecure_channel,
    previous_rpc_attempts,
    retry_controller,
)

pytestmark = pytest.mark.asyncio

SEEDS = range(20)
#: A seed whose calls hang fails after this many seconds instead of hanging the suite.
SAFETY = 6.0

KEY = "x-fuzz-call"
HEADER = "x-fuzz-headers"
SERVICE = "fuzz.Svc"

OK_NUMBER = grpc.StatusCode.OK.value[0]
CANCELLED_NUMBER = grpc.StatusCode.CANCELLED.value[0]

#: Pushback values a server may send (a tuple: one entry per value sent).
PUSHBACKS: tuple[tuple[str, ...], ...] = (
    ("0",),
    ("2",),
    ("6",),
    ("12",),
    ("-1",),
    ("-250",),
    ("abc",),
    ("1.5",),
    ("2147483648",),  # beyond int32: A6 says a signed 32-bit integer
    ("3", "4"),  # repeated: grpc C-core passes on only the last one (observed)
)
INT32_MAX = 2**31 - 1
DONT_RETRY = -1


def pushback_of(trailing: tuple[tuple[str, str], ...]) -> int | None:
    """A6 "Pushback", read from the trailers the client received: None when absent, the
    delay in ms, or DONT_RETRY for a negative, unparsable (not an ASCII decimal signed
    32-bit integer) or repeated value."""
    values = [v for k, v in trailing if k == PUSHBACK]
    if not values:
        return None
    if len(values) > 1:
        return DONT_RETRY
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if re.fullmatch(r"-?[0-9]+", value) is None:
        return DONT_RETRY
    ms = int(value)
    if ms < 0 or ms > INT32_MAX:
        return DONT_RETRY
    return ms


@dataclass
class Step:
    """What the server does for one attempt (by its previous-attempts header)."""

    kind: str  # ok, fail, headers (headers first, then ``code`` or OK), hang
    delay: float = 0.0
    code: str | None = None  # None: OK
    pushback: tuple[str, ...] = ()
    messages: int = 0  # streams: messages sent before the status
    fake_prev: bool = False  # trailers carry a server-made grpc-previous-rpc-attempts


OK_STEP = Step("ok")


@dataclass
class Attempt:
    """One attempt as the client created it (the probe)."""

    index: int
    header: str | None
    created: int
    created_at: float
    streamed: bool
    expires_at: float | None  # its own grpc deadline, on the monotonic clock
    #: A hedge copy: when the runner booked it (started the task that makes it; see
    #: World.booking), else when it was created.
    booked: int = 0
    booked_at: float = 0.0
    done: int | None = None
    done_at: float | None = None
    code: int | None = None
    details: str = ""
    trailing: tuple[tuple[str, str], ...] = ()
    initial: tuple[tuple[str, str], ...] = ()
    #: When sdkcore's code first got the final status (an await, read() or code() of the
    #: attempt returned): grpc sets the status (``done``) some loop steps earlier.
    seen: int | None = None
    #: When sdkcore's code first got response headers (with metadata) or a message.
    headers_seen: int | None = None


@dataclass
class ServerAttempt:
    index: int
    header: str | None
    start: int
    end: int | None = None
    outcome: str = "running"
    sent_headers: bool = False
    sent_messages: int = 0
    cancelled: bool = False


@dataclass
class Plan:
    cid: str
    shape: str  # unary or stream
    steps: list[Step]
    timeout: float | None
    interference: str  # none, call_cancel, task_cancel
    #: When: "timer" (interfere_at seconds after the call started) or "status"
    #: (interfere_at seconds after attempt ``cancel_on``'s status reached the client: the
    #: moments around an attempt's end, where a retry or the next hedge is decided).
    trigger: str
    interfere_at: float
    cancel_on: int
    start_at: float


@dataclass
class Record:
    plan: Plan
    attempts: list[Attempt] = field(default_factory=list)
    server: list[ServerAttempt] = field(default_factory=list)
    start: int | None = None
    start_at: float = 0.0
    end: int | None = None
    end_at: float = 0.0
    outcome: str = "not_started"  # ok, error, cancelled, escaped, create_failed
    value: Any = None
    error: BaseException | None = None
    trailing: Any = None
    cancel_seq: int | None = None
    cancel_returned: bool | None = None
    task_cancel_seq: int | None = None
    caught: int | None = None  # when a CancelledError reached the test's coroutine
    call: Any = None
    task: Any = None


def _seen(call: Any, committed: bool = False) -> None:
    """sdkcore's code just got something of this attempt: its answer, status, headers or a
    message (``committed``: headers with metadata, or a message, A6 "commit")."""
    attempt = getattr(call, "_fuzz_attempt", None)
    if attempt is None or not ACTIVE:
        return
    now = next(ACTIVE[0].seq)
    if attempt.seen is None and call.done():
        attempt.seen = now
    if attempt.headers_seen is None and (committed or call._cython_call._initial_metadata):
        attempt.headers_seen = now


def _probe_initial_metadata(original: Any) -> Any:
    async def initial_metadata(self: Any) -> Any:
        md = await original(self)
        _seen(self, bool(md))
        return md

    return initial_metadata


def _probe_code(original: Any) -> Any:
    async def code(self: Any) -> Any:
        out = await original(self)
        _seen(self)
        return out

    return code


def _probe_read(original: Any) -> Any:
    async def read(self: Any) -> Any:
        try:
            message = await original(self)
        except BaseException:
            _seen(self)
            raise
        _seen(self, message is not aio.EOF)
        return message

    return read


def _probe_await(original: Any) -> Any:
    def __await__(self: Any) -> Any:
        try:
            response = yield from original(self)
        except BaseException:
            _seen(self)
            raise
        _seen(self)
        return response

    return __await__


def _spy_failure(original: Any) -> Any:
    def record_failure(self: Any) -> bool:
        allowed = bool(original(self))
        if ACTIVE:
            ACTIVE[0].throttle_op(self, "failure", allowed)
        return allowed

    return record_failure


def _spy_success(original: Any) -> Any:
    def record_success(self: Any) -> None:
        original(self)
        if ACTIVE:
            ACTIVE[0].throttle_op(self, "success", True)

    return record_success


class World:
    """One seed: the config, the channel, the calls and what happened to them."""

    def __init__(self, seed: int, server: Server) -> None:
        rng = self.rng = random.Random(seed)
        self.seed = seed
        self.server = server
        #: The process's collections during the seed (the test sets conftest's gc_pauses).
        self.pauses: list[tuple[float, float]] = []
        self.seq = itertools.count()
        self.problems: list[str] = []
        self.mode = "retry" if rng.random() < 0.5 else "hedge"
        method_config: dict[str, Any] = {"name": [{"service": SERVICE}]}
        if self.mode == "retry":
            self.max_attempts = rng.randint(2, 5)
            initial = rng.randint(1, 10)
            self.retryable = frozenset(rng.sample(RETRYABLE, rng.randint(1, 3)))
            method_config["retryPolicy"] = {
                "maxAttempts": self.max_attempts,
                "initialBackoff": f"{initial / 1000:.3f}s",
                "maxBackoff": f"{rng.randint(initial, 10) / 1000:.3f}s",
                "backoffMultiplier": rng.choice([1, 1.5, 2, 3]),
                "retryableStatusCodes": sorted(self.retryable),
            }
            self.non_fatal: frozenset[str] = frozenset()
        else:
            self.max_attempts = rng.randint(2, 4)
            delay = rng.choice([0, 1, 3, 5, 10, 10]) * rng.uniform(0.5, 1.0)
            policy: dict[str, Any] = {
                "maxAttempts": self.max_attempts,
                "hedgingDelay": f"{delay / 1000:.4f}s",
            }
            self.non_fatal = frozenset()
            if rng.random() < 0.8:
                self.non_fatal = frozenset(rng.sample(RETRYABLE, rng.randint(0, 3)))
                policy["nonFatalStatusCodes"] = sorted(self.non_fatal)
            method_config["hedgingPolicy"] = policy
            self.retryable = frozenset()
        #: How many failures carry pushback (more for hedges: fewer copies decide on one).
        self.pushback_share = 0.3 if self.mode == "retry" else 0.45
        self.method_timeout: float | None = None
        if rng.random() < 0.25:
            self.method_timeout = rng.randint(20, 150) / 1000
            method_config["timeout"] = f"{self.method_timeout:.3f}s"
        config: dict[str, Any] = {"methodConfig": [method_config]}
        self.throttling = rng.random() < 0.35
        if self.throttling:
            config["retryThrottling"] = {
                "maxTokens": rng.randint(2, 10),
                "tokenRatio": rng.choice([0.1, 0.5, 1]),
            }
        self.config = json.dumps(config)
        self.close_at: float | None = None
        self.grace: float | None = None
        if rng.random() < 0.3:
            self.close_at = rng.uniform(0.025, 0.09)
            self.grace = rng.choice([None, 0.0, 0.01, 0.03])
        self.records = [self.plan(i) for i in range(rng.randint(20, 32))]
        self.by_cid = {r.plan.cid: r for r in self.records}
        self.close_seq: int | None = None
        #: When the channel stopped taking attempts (close_seq's, or a grace's end).
        self.stop_seq: int | None = None
        self.close_error: BaseException | None = None
        self.throttle_ops: list[tuple[str, bool, int]] = []
        self.throttler: RetryThrottler | None = None
        self.channel: Any = None

    def describe(self) -> str:
        close = describe_close(self.close_at, self.grace)
        return f"seed {self.seed}: {self.mode}, {close}, config {self.config}"

    # -- the plan ----------------------------------------------------------------------------
    def plan(self, i: int) -> Record:
        rng = self.rng
        shape = "stream" if rng.random() < (0.25 if self.mode == "retry" else 0.15) else "unary"
        timeout = rng.uniform(0.005, 0.08) if rng.random() < 0.3 else None
        interference = rng.choices(["none", "call_cancel", "task_cancel"], weights=[4, 3, 2])[0]
        trigger = "status" if rng.random() < 0.5 else "timer"
        bounded = (
            timeout is not None
            or self.method_timeout is not None
            or (interference != "none" and trigger == "timer")
            or self.close_at is not None
        )
        steps = [self.step(shape, bounded) for _ in range(rng.randint(1, 5))]
        interfere_at = rng.uniform(0.0, 0.05)
        if trigger == "status":
            interfere_at = status_delay(rng)
        plan = Plan(
            cid=f"s{self.seed}c{i}",
            shape=shape,
            steps=steps,
            timeout=timeout,
            interference=interference,
            trigger=trigger,
            interfere_at=interfere_at,
            cancel_on=rng.randint(0, min(len(steps), self.max_attempts - 1)),  # past the plan: OK
            start_at=rng.uniform(0.0, 0.02),
        )
        return Record(plan)

    def step(self, shape: str, bounded: bool) -> Step:
        rng = self.rng
        delay = rng.choice([0.0, 0.0, rng.uniform(0.0005, 0.004), rng.uniform(0.005, 0.04)])
        code = rng.choice([*RETRYABLE, *RETRYABLE, *OTHER])
        pushback = rng.choice(PUSHBACKS) if rng.random() < self.pushback_share else ()
        fake = rng.random() < 0.1
        roll = rng.random()
        if roll < 0.08 and bounded:
            return Step("hang")
        if roll < 0.3:
            messages = rng.randint(0, 3) if shape == "stream" else 0
            return Step("ok", delay, messages=messages, fake_prev=fake)
        if roll < 0.45:
            then = None if rng.random() < 0.3 else code
            return Step("headers", delay, then, pushback, fake_prev=fake)
        if roll < 0.55 and shape == "stream":
            return Step("fail", delay, code, pushback, messages=rng.randint(1, 2))
        return Step("fail", delay, code, pushback, fake_prev=fake)

    # -- the probe and the spy ----------------------------------------------------------------
    def created(self, call: Any) -> None:
        """grpc.aio made a call: an attempt, if it belongs to one of this seed's calls."""
        md = dict(call._metadata)
        record = self.by_cid.get(md.get(KEY, ""))
        if record is None:
            return
        header = md.get(PREV)
        try:
            index = int(header) if header is not None else 0
        except ValueError:
            self.problems.append(f"call {record.plan.cid}: attempt header {header!r}")
            index = -1
        now = time.monotonic()
        remaining = call.time_remaining()
        attempt = Attempt(
            index,
            header,
            next(self.seq),
            now,
            isinstance(call, aio_call.UnaryStreamCall),
            None if remaining is None else now + remaining,
        )
        attempt.booked, attempt.booked_at = attempt.created, attempt.created_at
        task = asyncio.current_task()
        if task is not None and task.get_coro().__qualname__ == "_Chain.run":  # type: ignore[union-attr]
            # A hedge copy made in its own task (sdkcore's runner): booked when it started.
            attempt.booked, attempt.booked_at = getattr(task, "_fuzz_booked", (0, 0.0))
        record.attempts.append(attempt)
        call._fuzz_attempt = attempt
        seq = self.seq
        problems = self.problems

        def done(c: Any) -> None:  # runs inside grpc as the status is set: never raise
            try:
                attempt.done = next(seq)
                attempt.done_at = time.monotonic()
                cython = c._cython_call
                status = cython._status
                attempt.code = int(status.code())
                attempt.details = str(status.details())
                attempt.trailing = tuple((m[0], m[1]) for m in status.trailing_metadata() or ())
                attempt.initial = tuple((m[0], m[1]) for m in cython._initial_metadata or ())
            except Exception as exc:  # pragma: no cover - the probe itself failed
                problems.append(f"probe: {exc!r}")

        call.add_done_callback(done)
        interfere_on_status(call, index, record, self.interfere)

    def throttle_op(self, throttler: Any, op: str, allowed: bool) -> None:
        if self.throttler is not None and throttler._current() is self.throttler._current():
            self.throttle_ops.append((op, allowed, throttler.milli_tokens))

    # -- the server --------------------------------------------------------------------------
    def _server_attempt(self, context: Any) -> tuple[Record | None, ServerAttempt, Step]:
        md, header, index = attempt_metadata(context)
        record = self.by_cid.get(md.get(KEY, ""))
        attempt = ServerAttempt(index, header, next(self.seq))
        if record is None:
            self.problems.append(f"the server saw an attempt of no call: {md}")
            return None, attempt, OK_STEP
        record.server.append(attempt)
        steps = record.plan.steps
        return record, attempt, steps[index] if index < len(steps) else OK_STEP

    @staticmethod
    def _trailers(step: Step) -> tuple[tuple[str, str], ...]:
        trailing = [(PUSHBACK, v) for v in step.pushback]
        if step.fake_prev:
            trailing.append((PREV, "7"))
        return tuple(trailing)

    async def unary(self, request: bytes, context: Any, n: int) -> bytes:
        record, attempt, step = self._server_attempt(context)
        cid = "?" if record is None else record.plan.cid
        try:
            await asyncio.sleep(step.delay)
            if step.kind == "hang":
                await asyncio.sleep(HANG)
            if step.kind == "headers":
                await context.send_initial_metadata(((HEADER, "1"),))
                attempt.sent_headers = True
                await asyncio.sleep(0.005)
            trailing = self._trailers(step)
            if trailing:
                context.set_trailing_metadata(trailing)
            if step.code is None:
                attempt.outcome = "OK"
                return f"ok:{cid}:{attempt.index}".encode()
            attempt.outcome = step.code
            await context.abort(CODE[step.code], f"{cid}/{attempt.index}/{step.code}")
            raise AssertionError("unreachable")
        except asyncio.CancelledError:
            attempt.cancelled = True
            attempt.outcome = "cancelled"
            raise
        finally:
            attempt.end = next(self.seq)

    async def stream(self, request: bytes, context: Any, n: int) -> Any:
        record, attempt, step = self._server_attempt(context)
        cid = "?" if record is None else record.plan.cid
        try:
            await asyncio.sleep(step.delay)
            if step.kind == "hang":
                await asyncio.sleep(HANG)
            if step.kind == "headers":
                await context.send_initial_metadata(((HEADER, "1"),))
                attempt.sent_headers = True
                await asyncio.sleep(0.005)
            for j in range(step.messages):
                yield f"m:{cid}:{attempt.index}:{j}".encode()
                attempt.sent_messages += 1
            trailing = self._trailers(step)
            if trailing:
                context.set_trailing_metadata(trailing)
            if step.code is None:
                attempt.outcome = "OK"
                return
            attempt.outcome = step.code
            await context.abort(CODE[step.code], f"{cid}/{attempt.index}/{step.code}")
        except asyncio.CancelledError:
            attempt.cancelled = True
            attempt.outcome = "cancelled"
            raise
        finally:
            attempt.end = next(self.seq)

    # -- the client --------------------------------------------------------------------------
    def booking(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        """The loop's task factory: notes when each task was started."""
        task = asyncio.Task(coro, loop=loop, **kwargs)
        task._fuzz_booked = (next(self.seq), time.monotonic())  # type: ignore[attr-defined]
        return task

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        factory = loop.get_task_factory()
        loop.set_task_factory(self.booking)
        try:
            await self._run()
        finally:
            loop.set_task_factory(factory)

    async def _run(self) -> None:
        before = set(asyncio.all_tasks())
        self.server.unary_unary("U", self.unary)
        self.server.unary_stream("S", self.stream)
        self.channel = insecure_channel(self.server.target, service_config=self.config)
        self.core = retry_controller(self.channel)
        self.throttler = self.core.throttler
        if self.throttling and self.throttler is None:
            self.problems.append("the config has retryThrottling, the channel no throttler")
        self.start_milli = None if self.throttler is None else self.throttler.milli_tokens
        self.unary_mc = self.channel.unary_unary(f"/{SERVICE}/U")
        self.stream_mc = self.channel.unary_stream(f"/{SERVICE}/S")

        def hung() -> None:
            running = [r.plan.cid for r in self.records if r.end is None]
            self.problems.append(f"calls still running after {SAFETY} s: {running}")

        closer = None if self.close_at is None else self.close()
        await run_calls([self.run_call(r) for r in self.records], closer, SAFETY, hung)
        # Attempts still running on the server once their calls ended: each must see its
        # cancellation soon (a "hang" step never ends by itself).
        await settle(lambda: any(a.end is None for r in self.records for a in r.server))
        self.left_on_server = [
            self.describe_record(r) for r in self.records if any(a.end is None for a in r.server)
        ]
        # Every attempt the client created is over once its call ended.
        self.open_attempts = [
            self.describe_record(r) for r in self.records if any(a.done is None for a in r.attempts)
        ]
        self.waiting = len(self.core._waiting)
        self.buffered = self.core.buffered_bytes
        if self.close_seq is None:
            self.close_error = await close_channel(self.channel, bound=2.0)
        # grpc.aio ends a closed channel's call tasks in its own time: a task is a leak if
        # it is still pending a while after the close.
        self.leaked_tasks = await leaked_tasks(before, server_task)

    async def close(self) -> None:
        assert self.close_at is not None
        await asyncio.sleep(self.close_at)
        self.close_seq = next(self.seq)
        self.core._close_calls = stamped(self.core._close_calls, self.stopped)  # type: ignore[method-assign]
        self.close_error = await close_channel(self.channel, self.grace)

    def stopped(self) -> None:
        if self.stop_seq is None:
            self.stop_seq = next(self.seq)

    async def run_call(self, record: Record) -> None:
        plan = record.plan
        loop = asyncio.get_running_loop()
        await asyncio.sleep(plan.start_at)
        record.start = next(self.seq)
        record.start_at = time.monotonic()
        multi = self.unary_mc if plan.shape == "unary" else self.stream_mc
        try:
            call = multi(b"request", metadata=((KEY, plan.cid),), timeout=plan.timeout)
        except BaseException as exc:
            record.outcome = "create_failed"
            record.error = exc
            record.end = next(self.seq)
            return
        record.call = call
        record.task = asyncio.current_task()
        handle = None
        if plan.trigger == "timer" and plan.interference != "none":
            handle = loop.call_later(plan.interfere_at, self.interfere, record)
        try:
            if plan.shape == "unary":
                record.value = await call
            else:
                record.value = [m async for m in call]
            record.outcome = "ok"
        except aio.AioRpcError as exc:
            record.outcome = "error"
            record.error = exc
        except asyncio.CancelledError as exc:
            record.caught = next(self.seq)
            record.outcome = "cancelled"
            record.error = exc
        except BaseException as exc:
            record.outcome = "escaped"
            record.error = exc
        finally:
            record.end = next(self.seq)
            record.end_at = time.monotonic()
            if handle is not None:
                handle.cancel()
        record.call = record.task = None  # the checks run on the records, not the calls
        if record.outcome == "ok":
            record.trailing = await call.trailing_metadata()

    def interfere(self, record: Record) -> None:
        """``call.cancel()``, or cancelling the task awaiting the call (a loop callback)."""
        if record.end is not None or record.call is None:
            return
        if record.plan.interference == "call_cancel":
            record.cancel_seq = next(self.seq)
            record.cancel_returned = bool(record.call.cancel())
        elif record.task_cancel_seq is None:
            record.task_cancel_seq = next(self.seq)
            record.task.cancel()

    # -- the invariants ----------------------------------------------------------------------
    def check(self) -> None:
        for record in self.records:
            self.check_record(record)
        if self.left_on_server:
            self.problems.append(
                f"attempts still running on the server {SETTLE} s after their calls ended "
                f"(never cancelled): {self.left_on_server}"
            )
        if self.open_attempts:
            self.problems.append(
                f"attempts the client created still open after their calls ended: "
                f"{self.open_attempts}"
            )
        if self.buffered:
            self.problems.append(f"{self.buffered} bytes left in the channel's replay buffer")
        self.problems += channel_problems(self.waiting, self.close_error, self.leaked_tasks)
        self.check_throttle()

    def check_record(self, record: Record) -> None:
        plan = record.plan
        hedged = self.mode == "hedge" and plan.shape == "unary"
        retried = self.mode == "retry"
        attempts = sorted(record.attempts, key=lambda a: a.created)
        name = self.describe_record(record)

        def problem(text: str) -> None:
            self.problems.append(f"{name}: {text}")

        end = record.end if record.end is not None else 1 << 62
        error = record.error

        if record.outcome == "not_started":
            return  # reported as hung
        # grpc.aio refuses a call made on a closed channel (UsageError: at once for a unary
        # call, when read for the streaming shapes). A streaming call's first attempt is
        # made by a task (grpc.aio's interceptor chain, which sdkcore's streaming shapes go
        # through): a close that starts before that task ran refuses it the same way, as
        # grpc.aio does with any interceptor (observed with close(grace); rfc/0003 "A first
        # attempt on a closed channel is refused with UsageError, as grpc.aio does"). Only
        # then.
        close = self.close_seq
        closed_before = close is not None and (
            close < (record.start or 0)
            or (plan.shape == "stream" and not record.attempts and close < end)
        )
        refused = closed_before and isinstance(error, aio.UsageError)
        if record.outcome == "create_failed":
            if not refused:
                problem(f"making the call raised {error!r}")
            return
        if record.outcome == "escaped" and not refused:
            problem(f"the call raised {type(error).__name__}: {error!r}")

        # -- how many attempts, and their headers ----------------------------------------
        limit = self.max_attempts if (retried or hedged) else 1
        if len(attempts) > limit:
            problem(f"{len(attempts)} attempts created, at most {limit} allowed")
        if len(record.server) > limit:
            problem(f"the server saw {len(record.server)} attempts, at most {limit} allowed")
        check_attempt_headers(attempts, record.server, problem)

        # -- when attempts were created --------------------------------------------------
        timeout = plan.timeout
        if self.method_timeout is not None and (timeout is None or self.method_timeout < timeout):
            timeout = self.method_timeout
        deadline_at = None
        if timeout is not None and attempts:
            deadline_at = attempts[0].created_at + timeout
        check_attempt_deadlines(attempts, deadline_at, problem, self.pauses)
        cut = [x for x in (record.cancel_seq, record.caught) if x is not None]
        cut_at = min(cut) if cut else None
        if close is not None and close < (record.start or 0) and attempts:
            # made once close had started: refused, whatever the grace (the channel refuses
            # it itself while close(grace) waits for sdkcore's calls)
            problem(f"{len(attempts)} attempt(s) of a call made after the channel's close started")
        for a in attempts[1:]:
            if cut_at is not None and a.created > cut_at:
                if not hedged:
                    cause = "call.cancel()" if cut_at == record.cancel_seq else "CancelledError"
                    problem(f"attempt {a.index} created after {cause}")
                elif a.code != CANCELLED_NUMBER:
                    # Assumption, as tests/test_doors_fuzz.py makes for the core's hedges on
                    # asyncio: call.cancel() (and the caller's cancellation) cancels the hedge
                    # runner's task, which learns of it when it next runs; a copy due in that
                    # turn may still be made. It is cut at once: never an answer.
                    problem(
                        f"copy {a.index} made after the call was cancelled ended "
                        f"{name_of(a.code)}, not CANCELLED"
                    )
            if self.stop_seq is not None and a.created > self.stop_seq:
                problem(f"attempt {a.index} created after the channel stopped taking attempts")

            # Made after the deadline, with no time left: grpc fails such an attempt at once
            # and sends nothing. Reaching the server would be sending it. (sdkcore reads its
            # clock a little before the probe: an attempt made within the slack of the
            # deadline may still have had microseconds left, and go out with them.)
            if (
                deadline_at is not None
                and a.created_at > deadline_at + slack(self.pauses, a.created_at)
                and any(seen.header == a.header for seen in record.server)
            ):
                problem(
                    f"attempt {a.index} created {ms(a.created_at - deadline_at)} after the "
                    "deadline, and it reached the server"
                )
            if a.created > end and not (hedged and cut_at is not None):
                problem(f"attempt {a.index} created after the call ended")

        if not hedged:
            # Retries (and a hedged method's streams: no retry at all) are sequential: each
            # attempt after the previous one ended, for a reason A6 allows.
            for prev, a in itertools.pairwise(attempts):
                why = self.why_not_retry(prev, record)
                if why is not None:
                    problem(f"attempt {a.index} created although attempt {prev.index} {why}")
                pushback = pushback_of(prev.trailing)
                if (
                    prev.done_at is not None
                    and pushback is not None
                    and pushback >= 0
                    and a.created_at - prev.done_at < pushback / 1000 - 0.001
                ):
                    problem(
                        f"attempt {a.index} created {ms(a.created_at - prev.done_at)} after a "
                        f"pushback of {pushback} ms"
                    )
        else:
            self.check_hedges(attempts, problem)

        # -- the outcome -----------------------------------------------------------------
        by_index = {a.index: a for a in attempts}
        server_by_index = {a.index: a for a in record.server}
        last = attempts[-1] if attempts else None
        interfered = (
            record.cancel_returned is True
            or record.task_cancel_seq is not None
            or (self.close_seq is not None and self.close_seq < end)
        )
        if record.cancel_returned and record.outcome != "cancelled":
            problem("call.cancel() returned True, yet the call did not raise CancelledError")
        if record.task_cancel_seq is not None and record.outcome != "cancelled":
            problem("the awaiting task was cancelled, yet the call did not raise CancelledError")
        if record.outcome == "cancelled" and not interfered:
            problem("CancelledError without call.cancel(), the task's cancellation or a close")
        if record.outcome == "ok":
            index = self.answer_index(record, problem)
            if index is not None:
                served = server_by_index.get(index)
                if served is None or served.outcome != "OK":
                    problem(f"answered from attempt {index}, which the server did not answer OK")
                if not hedged and last is not None and index != last.index:
                    problem(f"answered from attempt {index}, not the last one ({last.index})")
                reported = previous_rpc_attempts(record.trailing)
                if reported != index:
                    problem(f"grpc-previous-rpc-attempts of the answer is {reported}, not {index}")
                if plan.shape == "stream" and served is not None:
                    step = plan.steps[index] if index < len(plan.steps) else OK_STEP
                    if len(record.value) != step.messages:
                        problem(f"{len(record.value)} messages, the server sent {step.messages}")
        elif record.outcome == "error":
            assert isinstance(error, aio.AioRpcError)
            code = error.code()
            details = error.details() or ""
            match = re.fullmatch(r"(\w+)/(\d+)/(\w+)", details)
            if code is grpc.StatusCode.DEADLINE_EXCEEDED and match is None:
                if timeout is None:
                    problem("DEADLINE_EXCEEDED for a call without a deadline")
                elif record.end_at < record.start_at + timeout and not any(
                    # sdkcore's rule (sdkcore/_decision.py, rule 6; rfc/0007): a pushback
                    # that would end past the deadline times the call out at once.
                    (pushback := pushback_of(a.trailing)) is not None
                    and pushback >= 0
                    and record.end_at + pushback / 1000 >= record.start_at + timeout
                    for a in attempts
                ):
                    problem(
                        f"DEADLINE_EXCEEDED {ms(record.end_at - record.start_at)} after the "
                        f"start, before its {ms(timeout)} deadline"
                    )
            elif match is None or match.group(1) != plan.cid:
                problem(f"an error no attempt of this call answered: {code.name} {details!r}")
            else:
                index = int(match.group(2))
                answer = by_index.get(index)
                if answer is None or answer.code != code.value[0]:
                    problem(f"{code.name} of attempt {index}, which did not end with it")
                if not hedged and last is not None and index != last.index:
                    problem(f"the error is attempt {index}'s, not the last one's ({last.index})")
                reported = previous_rpc_attempts(error)
                if reported != index:
                    problem(f"grpc-previous-rpc-attempts of the error is {reported}, not {index}")
                committed = answer is not None and answer.headers_seen is not None
                if hedged and code.name in self.non_fatal and not committed:
                    # All copies failed (or no more could be sent): the error is returned
                    # once every copy in flight ended (A6 "Summary").
                    running = [o.index for o in attempts if o.done is None or o.done > end]
                    if running:
                        problem(f"non-fatal error returned with copies {running} still running")
        if hedged and record.outcome in ("ok", "error"):
            self.check_hedged_outcome(record, attempts, problem)

    def check_hedged_outcome(self, record: Record, attempts: list[Attempt], problem: Any) -> None:
        """The first copy to decide a hedged call is its outcome (A6 "Hedging Policy": the
        first OK answer wins; a fatal status ends the call; a copy whose headers arrived is
        the one the call commits to). sdkcore's runner books each copy's outcome in the
        step its read of that copy returns (no await in between), so the first decision it
        saw is the first the probe saw."""
        decisive: list[tuple[int, Attempt, str]] = []
        for a in attempts:
            if a.headers_seen is not None:
                decisive.append((a.headers_seen, a, "headers"))
            elif a.seen is not None and a.code == OK_NUMBER:
                decisive.append((a.seen, a, "OK"))
            elif a.seen is not None and name_of(a.code) not in (
                *self.non_fatal,
                "CANCELLED",
                "DEADLINE_EXCEEDED",
            ):
                decisive.append((a.seen, a, name_of(a.code)))
        if not decisive:
            return
        _, first, why = min(decisive, key=lambda d: d[0])
        if record.outcome == "ok":
            value = record.value or b""
            match = re.fullmatch(rb"ok:\w+:(\d+)", value)
            if match is not None and int(match.group(1)) != first.index:
                problem(
                    f"answered by copy {int(match.group(1))}, but copy {first.index} decided "
                    f"the call first ({why})"
                )
            return
        error = record.error
        assert isinstance(error, aio.AioRpcError)
        found = re.fullmatch(r"\w+/(\d+)/\w+", error.details() or "")
        if found is not None and int(found.group(1)) != first.index:
            problem(
                f"ended with copy {int(found.group(1))}'s {error.code().name}, but copy "
                f"{first.index} decided the call first ({why})"
            )

    def describe_record(self, record: Record) -> str:
        plan = record.plan
        attempts = sorted(record.attempts, key=lambda a: a.created)
        steps = ", ".join(
            f"{s.kind}{'' if s.code is None else ' ' + s.code}"
            f"{' pb ' + '/'.join(s.pushback) if s.pushback else ''}"
            f"{f' +{s.messages}m' if s.messages else ''}"
            for s in plan.steps
        )
        return (
            f"call {plan.cid} ({plan.shape}, timeout "
            f"{None if plan.timeout is None else ms(plan.timeout)}, {plan.interference} "
            f"{ms(plan.interfere_at)} after "
            f"{'start' if plan.trigger == 'timer' else f'attempt {plan.cancel_on} ended'}, "
            f"steps [{steps}]; outcome {record.outcome} "
            f"{show(record.error)}; client attempts "
            f"{[(a.index, name_of(a.code)) for a in attempts]}, server "
            f"{[(a.index, a.outcome) for a in record.server]})"
        )

    def why_not_retry(self, prev: Attempt, record: Record) -> str | None:
        """Why A6 forbids an attempt after ``prev`` (a sequential retry), or None."""
        if prev.done is None:
            return "had not ended"
        if self.mode != "retry":
            return "is the only attempt of a streaming call of a hedged method"
        name = name_of(prev.code)
        if name not in self.retryable:
            return f"ended with {name}, not in retryableStatusCodes"
        if prev.headers_seen is not None:
            return "sent response headers (the call was committed)"
        served = next((s for s in record.server if s.index == prev.index), None)
        if served is not None and served.sent_messages:
            return "sent a response message (the call was committed)"
        if pushback_of(prev.trailing) == DONT_RETRY:
            return f"carried a pushback asking not to retry: {prev.trailing}"
        return None

    def check_hedges(self, attempts: list[Attempt], problem: Any) -> None:
        """No copy after the call was decided (A6 "Hedging Policy", "Pushback", commit).

        A copy counts from when the runner booked it (started its task): one booked before
        the decision reached sdkcore may still be made after it, in its task's first step
        (the core fuzz allows the same: "a copy it booked before may still begin after
        it"); it is then cut, which the leak checks see.
        """
        for a in attempts[1:]:
            for other in attempts:
                if other is a or other.created > a.created:
                    continue
                if other.headers_seen is not None and other.headers_seen < a.booked:
                    problem(f"copy {a.index} booked after copy {other.index}'s headers arrived")
                if other.seen is None or other.seen > a.booked:
                    continue
                name = name_of(other.code)
                if other.code == OK_NUMBER:
                    problem(f"copy {a.index} booked after copy {other.index} answered OK")
                elif name not in (*self.non_fatal, "CANCELLED", "DEADLINE_EXCEEDED"):
                    problem(f"copy {a.index} booked after copy {other.index}'s fatal {name}")
                elif pushback_of(other.trailing) == DONT_RETRY:
                    problem(f"copy {a.index} booked after a 'don't retry' pushback")
            failed = [
                o for o in attempts if o.seen is not None and o.seen < a.booked and o is not a
            ]
            if failed:
                latest = max(failed, key=lambda o: o.seen or 0)
                pushback = pushback_of(latest.trailing)
                assert latest.done_at is not None
                if (
                    pushback is not None
                    and pushback >= 0
                    and a.booked_at - latest.done_at < pushback / 1000 - 0.001
                ):
                    problem(
                        f"copy {a.index} booked {ms(a.booked_at - latest.done_at)} after a "
                        f"pushback of {pushback} ms"
                    )

    def answer_index(self, record: Record, problem: Any) -> int | None:
        """Which attempt the call's answer came from (its body says so)."""
        cid = record.plan.cid
        if record.plan.shape == "unary":
            match = re.fullmatch(rb"ok:(\w+):(\d+)", record.value or b"")
            if match is None or match.group(1).decode() != cid:
                problem(f"answered {record.value!r}, which no attempt of this call sent")
                return None
            return int(match.group(2))
        found = {
            m.group(1).decode() + ":" + m.group(2).decode()
            for m in (re.fullmatch(rb"m:(\w+):(\d+):\d+", v) for v in record.value)
            if m is not None
        }
        if len(found) > 1 or (found and next(iter(found)).split(":")[0] != cid):
            problem(f"messages from several attempts (or calls): {sorted(found)}")
            return None
        if found:
            return int(next(iter(found)).split(":")[1])
        # No message: the answer is the last attempt's OK (checked by the caller).
        last = max(record.attempts, key=lambda a: a.created, default=None)
        return None if last is None else last.index

    def check_throttle(self) -> None:
        if self.throttler is None:
            return
        ops = self.throttle_ops
        failures = [allowed for op, allowed, _ in ops if op == "failure"]
        successes = sum(1 for op, _, _ in ops if op == "success")
        # The bucket's arithmetic (milli-tokens, A6 "Throttling"): replayed in order.
        assert self.start_milli is not None
        max_milli = int(self.throttler.max_tokens * 1000)
        ratio = round(self.throttler.token_ratio * 1000)
        milli = self.start_milli
        for op, allowed, after in ops:
            milli = max(0, milli - 1000) if op == "failure" else min(max_milli, milli + ratio)
            if after != milli:
                self.problems.append(f"throttle: {op} left {after} milli-tokens, expected {milli}")
                milli = after
            if op == "failure" and allowed != (milli * 2 > max_milli):
                self.problems.append(f"throttle: failure at {milli} said allowed={allowed}")
        # What the calls saw: a success per call that answered OK (at least the ones the
        # application got, at most the ones with an OK attempt); a failure per attempt that
        # ended with a status the policy retries (or hedges past), or failed with a "don't
        # retry" pushback (rfc/0003 table; A6 "Throttling"). Exactly for a retried call that ended
        # with its own status and nobody interfered; at most that otherwise (a call cut
        # first never looks at its last status). Hedged calls: at most (a loser's status may
        # arrive after the call was decided and is then never looked at).
        s_min = sum(1 for r in self.records if r.outcome == "ok")
        s_max = sum(1 for r in self.records if any(a.code == OK_NUMBER for a in r.attempts))
        f_min = f_max = 0
        for r in self.records:
            hedged = self.mode == "hedge" and r.plan.shape == "unary"
            # A hedged method's stream (sent once, no retry policy): no status of its own costs
            # a token, a "don't retry" pushback does (A6: every RPC; rfc/0003).
            costly: frozenset[str] = frozenset()
            if self.mode == "retry":
                costly = self.retryable
            elif hedged:
                costly = self.non_fatal
            # An OK answer is a success whatever pushback it carries (A6 counts a pushback
            # only on a failed RPC, as grpc C-core's retry filter does).
            cost = sum(
                1
                for a in r.attempts
                if a.code != OK_NUMBER
                and (name_of(a.code) in costly or pushback_of(a.trailing) == DONT_RETRY)
            )
            f_max += cost
            clean = (
                self.mode == "retry"
                and r.outcome in ("ok", "error")
                and r.plan.interference == "none"
                and (self.close_seq is None or (r.end is not None and r.end < self.close_seq))
                and not (
                    isinstance(r.error, aio.AioRpcError)
                    and r.error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                )
            )
            if clean:
                f_min += cost
        if not s_min <= successes <= s_max:
            self.problems.append(
                f"throttle: {successes} successes recorded, expected {s_min}..{s_max}"
            )
        if not f_min <= len(failures) <= f_max:
            self.problems.append(
                f"throttle: {len(failures)} failures recorded, expected {f_min}..{f_max}"
            )
        if self.mode == "retry":
            retries = sum(max(0, len(r.attempts) - 1) for r in self.records)
            permitted = sum(failures)
            if retries > permitted:
                self.problems.append(
                    f"throttle: {retries} retries sent, only {permitted} failures left retries "
                    "allowed"
                )


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe on grpc.aio's call class and the spy on the throttler, for one test."""
    probe_calls(monkeypatch)
    monkeypatch.setattr(
        aio_call.Call, "initial_metadata", _probe_initial_metadata(aio_call.Call.initial_metadata)
    )
    monkeypatch.setattr(aio_call.Call, "code", _probe_code(aio_call.Call.code))
    mixin = aio_call._UnaryResponseMixin
    monkeypatch.setattr(mixin, "__await__", _probe_await(mixin.__await__))
    streams = aio_call._StreamResponseMixin
    monkeypatch.setattr(streams, "read", _probe_read(streams.read))
    monkeypatch.setattr(
        RetryThrottler, "record_failure", _spy_failure(RetryThrottler.record_failure)
    )
    monkeypatch.setattr(
        RetryThrottler, "record_success", _spy_success(RetryThrottler.record_success)
    )


@pytest.mark.parametrize("seed", SEEDS)
async def test_grpc_channels_keep_their_promises_under_random_schedules(
    seed: int, server: Server, probe: None, gc_pauses: list[tuple[float, float]]
) -> None:
    world = World(seed, server)
    world.pauses = gc_pauses
    with active(world):
        await world.run()
    world.check()
    assert not world.problems, f"{world.describe()}\n" + "\n".join(world.problems)
