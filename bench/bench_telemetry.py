"""What telemetry costs a successful call: off (the default), and on with the OpenTelemetry SDK.

Run:  uv run python bench/bench_telemetry.py [--backend asyncio|trio] [--calls N] [--rounds R]

Every case runs interleaved with the others in each round; the median of the rounds
is printed (issue 22 item 8).

Telemetry off (target: <= 0.1 us per successful call):

* ``execute`` through ``RetryOrchestrator()`` and ``RetryOrchestrator(telemetry=None)``
  (the same thing: the spread between them is the noise), beside a bare ``await
  send()``. A core without the checks cannot be built from this tree, so the checks
  themselves are timed in isolation (``timeit``, locals as in the door, minus an
  empty statement): a successful ``execute`` makes one, ``self._telemetry is not
  None`` (it short-circuits), and ``Request()`` stores ``_trace = None``; the
  hand-wired loop's ``attempt()`` and ``succeed()`` read ``request._trace`` and
  ``self._telemetry`` (three loads).

Telemetry on (target: sdkcore's own share <= 1 us per successful call):

* ``execute`` and ``execute_sync`` with ``Telemetry(meter_provider, tracer_provider)``
  over the OpenTelemetry SDK: a MeterProvider with an ``InMemoryMetricReader``, a
  TracerProvider whose only span processor does nothing (spans are made, sampled
  and ended; nothing is exported). Against the same call with telemetry off.
* The bare SDK calls sdkcore makes for that call, written by hand around a bare
  ``send()`` on the same instruments and tracer: ``start_span`` x2 (the request's,
  the attempt's under it), ``set_span_in_context`` x2, ``context.attach``/``detach``,
  ``span.end`` x2, ``histogram.record`` x2 (duration, retries), ``span.set_attribute``
  x2 (outcome, retries). A successful call adds to no counter: counters count retries
  and hedges. Their glue is one ``time.time_ns()`` (the request span's start).
* The same with the OpenTelemetry API's no-op providers (``NoOpMeterProvider``,
  ``NoOpTracerProvider``): the calls cost little, so sdkcore's own share (the same
  Python either way) is read with far less noise than beside the SDK's 50-150 us.
* sdkcore's own share = (on - off) - (the calls by hand - bare send), taken per
  round (the rounds' median and range are printed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import statistics
import time
import timeit
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import NoOpTracerProvider

from sdkcore import Request, RetryOrchestrator, Telemetry

NAME = "sdkcore.request.name"
OUTCOME = "sdkcore.request.outcome"


async def ok(_: object) -> str:
    return "ok"


def ok_sync(_: object) -> str:
    return "ok"


async def per_call(fn: Callable[[], Awaitable[object]], calls: int) -> float:
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - start) / calls * 1e6


async def per_call_sync(fn: Callable[[], object], calls: int) -> float:
    gc.collect()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def sdk() -> tuple[Telemetry, MeterProvider, TracerProvider]:
    """The OpenTelemetry SDK: an in-memory reader, a span processor that does nothing."""
    meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
    tracers = TracerProvider()
    tracers.add_span_processor(SpanProcessor())  # the base class: does nothing
    return Telemetry(meter_provider=meters, tracer_provider=tracers), meters, tracers


def by_hand(telemetry: Telemetry) -> tuple[Callable[[], Awaitable[str]], Callable[[], str]]:
    """The OpenTelemetry calls sdkcore makes for one successful call, around a bare send."""
    tracer = telemetry.tracer
    duration = telemetry.request_duration
    retries = telemetry.request_retries
    client = trace.SpanKind.CLIENT
    in_context = trace.set_span_in_context
    attach = otel_context.attach
    detach = otel_context.detach
    time_ns = time.time_ns

    def begin() -> tuple[Any, Any, Any]:
        span = tracer.start_span(
            "kv.get", kind=client, attributes={NAME: "kv.get", "sdkcore.request.id": 1},
            start_time=time_ns(),
        )  # fmt: skip
        attempt = tracer.start_span(
            "sdkcore.attempt", context=in_context(span), attributes={"sdkcore.attempt.number": 1}
        )
        return span, attempt, attach(in_context(attempt))

    def end(span: Any, attempt: Any, token: Any) -> None:
        detach(token)
        attempt.end()
        duration.record(0.00001, {NAME: "kv.get", OUTCOME: "success"})
        retries.record(0, {NAME: "kv.get"})
        span.set_attribute(OUTCOME, "success")
        span.set_attribute("sdkcore.request.retries", 0)
        span.end()

    async def call() -> str:
        span, attempt, token = begin()
        result = await ok(None)
        end(span, attempt, token)
        return result

    def call_sync() -> str:
        span, attempt, token = begin()
        result = ok_sync(None)
        end(span, attempt, token)
        return result

    return call, call_sync


class Floor:
    """The least Python a door can run around those calls: the floor of the design.

    An object per request holding its span and its shared attribute dicts, three
    methods (begin, one attempt around ``send``, end), the two clock reads a
    back-dated span and a duration need, the request's private fields read directly
    (its name made known to ``telemetry`` first); no guards, no flags, no hedge or adopted-span
    cases. sdkcore's hooks do this plus what keeps a request safe from a failing
    exporter and correct for every door.
    """

    __slots__ = ("attributes", "span", "success", "telemetry")

    def __init__(self, telemetry: Telemetry, request: Request) -> None:
        request._trace = None
        self.telemetry = telemetry
        self.attributes, self.success = telemetry._named[request._name]
        self.span = telemetry.tracer.start_span(
            request._name,
            kind=telemetry._client,
            attributes={NAME: request._name, "sdkcore.request.id": request._id},
            start_time=time.time_ns() - int((request._clock() - request._start) * 1e9),
        )

    def send_sync(self, send: Callable[[Any], str], request: Request) -> str:
        telemetry = self.telemetry
        in_context = trace.set_span_in_context
        span = telemetry.tracer.start_span(
            "sdkcore.attempt",
            context=in_context(self.span),
            attributes={"sdkcore.attempt.number": request._retries + 1},
        )
        token = otel_context.attach(in_context(span))
        result = send(request)
        otel_context.detach(token)
        span.end()
        return result

    def end(self, request: Request) -> None:
        telemetry = self.telemetry
        retries = request._retries
        telemetry.request_duration.record(request._clock() - request._start, self.success)
        telemetry.request_retries.record(retries, self.attributes)
        span = self.span
        span.set_attribute(OUTCOME, "success")
        span.set_attribute("sdkcore.request.retries", retries)
        span.end()


def floor(telemetry: Telemetry) -> Callable[[], str]:
    """A successful one-attempt call through :class:`Floor` (no door around it)."""
    telemetry._named_attributes("kv.get")

    def call_sync() -> str:
        request = Request(name="kv.get", idempotent=True)
        hooks = Floor(telemetry, request)
        result = hooks.send_sync(ok_sync, request)
        request._succeeded()
        hooks.end(request)
        return result

    return call_sync


def request_only() -> str:
    """The same call's request without telemetry: what :func:`floor` adds to it is the floor."""
    request = Request(name="kv.get", idempotent=True)
    result = ok_sync(request)
    request._succeeded()
    return result


Case = Callable[[int], Awaitable[float]]


async def timings(calls: int, rounds: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Medians per case, and per-round samples (for the paired differences)."""
    default = RetryOrchestrator()
    none = RetryOrchestrator(telemetry=None)
    telemetry, meters, tracers = sdk()
    noop = Telemetry(meter_provider=NoOpMeterProvider(), tracer_provider=NoOpTracerProvider())

    def request() -> Request:
        return Request(name="kv.get", idempotent=True)

    cases: dict[str, Case] = {}

    def door(label: str, orchestrator: RetryOrchestrator) -> None:
        async def call() -> str:
            return await orchestrator.execute(request(), ok)

        def call_sync() -> str:
            return orchestrator.execute_sync(request(), ok_sync)

        cases[f"execute, {label}"] = lambda n: per_call(call, n)
        cases[f"execute_sync, {label}"] = lambda n: per_call_sync(call_sync, n)

    async def bare() -> str:
        return await ok(None)

    def bare_sync() -> str:
        return ok_sync(None)

    door("RetryOrchestrator()", default)
    door("telemetry=None", none)
    cases["execute, bare send"] = lambda n: per_call(bare, n)
    cases["execute_sync, bare send"] = lambda n: per_call_sync(bare_sync, n)
    for label, tel in (("SDK", telemetry), ("no-op API", noop)):
        door(f"telemetry on ({label})", RetryOrchestrator(telemetry=tel))
        hand, hand_sync = by_hand(tel)
        cases[f"execute, {label} calls by hand"] = functools.partial(per_call, hand)
        cases[f"execute_sync, {label} calls by hand"] = functools.partial(per_call_sync, hand_sync)
    cases["floor: request + Floor hooks (no-op API)"] = functools.partial(
        per_call_sync, floor(noop)
    )
    cases["floor: request alone"] = functools.partial(per_call_sync, request_only)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():  # warm up
        await run(max(calls // 10, 1))
    for _ in range(rounds):
        for name, run in cases.items():
            samples[name].append(await run(calls))
    meters.shutdown()
    tracers.shutdown()
    return {name: statistics.median(values) for name, values in samples.items()}, samples


def checks(rounds: int) -> dict[str, float]:
    """The telemetry-off checks alone, in ns (median of rounds, an empty statement taken off)."""
    orchestrator = RetryOrchestrator()
    request = Request()
    statements = {
        "self._telemetry is not None (execute, off)": (
            "s._telemetry is not None and r._trace is None"
        ),
        "request._trace = None (Request())": "r._trace = None",
        "attempt() + succeed() reads (hand-wired, off)": (
            "t = r._trace\n"
            "if t is None and s._telemetry is not None: pass\n"
            "t = r._trace\n"
            "if t is not None: pass"
        ),
    }
    number = 2_000_000
    setup = "s = S; r = R"
    env = {"S": orchestrator, "R": request}
    out: dict[str, list[float]] = {name: [] for name in statements}
    for _ in range(rounds):
        empty = timeit.Timer("pass", setup, globals=env).timeit(number)
        for name, statement in statements.items():
            took = timeit.Timer(statement, setup, globals=env).timeit(number)
            out[name].append((took - empty) / number * 1e9)
    return {name: statistics.median(values) for name, values in out.items()}


async def main_async(calls: int, rounds: int) -> None:
    t, samples = await timings(calls, rounds)
    width = max(len(name) for name in t)
    for name, us in t.items():
        print(f"  {name:{width}s} {us:7.2f} us")
    print()
    for d in ("execute", "execute_sync"):
        noise = t[f"{d}, telemetry=None"] - t[f"{d}, RetryOrchestrator()"]
        print(
            f"  off, {d}: telemetry=None - RetryOrchestrator() {noise:+.2f} us (same code: noise)"
        )
    costs = checks(rounds)
    for name, ns in costs.items():
        print(f"  off: {name:46s} {ns:6.1f} ns")
    off = costs["self._telemetry is not None (execute, off)"]
    off += costs["request._trace = None (Request())"]
    verdict = "met" if off <= 100.0 else "MISSED"
    print(
        f"  off: a successful execute pays {off:.1f} ns for telemetry (target <= 100 ns: {verdict})"
    )
    print()
    for label in ("SDK", "no-op API"):
        for d in ("execute", "execute_sync"):
            on = samples[f"{d}, telemetry on ({label})"]
            off_ = samples[f"{d}, RetryOrchestrator()"]
            hand = samples[f"{d}, {label} calls by hand"]
            bare = samples[f"{d}, bare send"]
            added = [a - b for a, b in zip(on, off_, strict=True)]
            calls_ = [a - b for a, b in zip(hand, bare, strict=True)]
            shares = [a - b for a, b in zip(added, calls_, strict=True)]
            share = statistics.median(shares)
            verdict = "met" if share <= 1.0 else "MISSED"
            print(
                f"  on ({label}), {d}: adds {statistics.median(added):6.2f} us, of which the "
                f"{label} calls {statistics.median(calls_):6.2f} us; sdkcore's own share "
                f"{share:+.2f} us (rounds {min(shares):+.2f}..{max(shares):+.2f}; "
                f"target <= 1 us: {verdict})"
            )
    # The floor: the same calls from the least Python a per-request design can run.
    hand = samples["execute_sync, no-op API calls by hand"]
    bare = samples["execute_sync, bare send"]
    floors = [
        (f - r) - (h - b)
        for f, r, h, b in zip(
            samples["floor: request + Floor hooks (no-op API)"],
            samples["floor: request alone"],
            hand,
            bare,
            strict=True,
        )
    ]
    print(
        f"  floor (no-op API): an object per request with three methods and no guards, "
        f"around the same calls: {statistics.median(floors):+.2f} us beyond the calls "
        f"(rounds {min(floors):+.2f}..{max(floors):+.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )
    print(f"backend={args.backend} calls={args.calls} rounds={args.rounds} (medians)")
    anyio.run(main_async, args.calls, args.rounds, backend=args.backend)


if __name__ == "__main__":
    main()
