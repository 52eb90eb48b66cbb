"""The slowdown scenario: an endpoint that slows down as its load grows past its capacity.

An in-process endpoint (no socket, no grpc: a coroutine) serves :data:`CAPACITY`
requests at a time, each for :data:`SERVICE` seconds, first come first served; what
it cannot serve at once waits in its queue, and it serves what it queued even when
the caller has given up (as a real server does: it cannot know). Offered load is
twice its capacity, open loop, for :data:`SECONDS`. Two runs, at the same time, on
two such endpoints: without a limiter, and with ``sdkcore.AdaptiveConcurrencyLimiter()``
(its defaults: 20, 1, 200; no queue) guarding each dispatch inside ``send`` (rfc/0009's
order: throttle, limiter, breaker, send; here only the limiter). Every request is a
read (``kv_request(GET)``) run by ``RetryOrchestrator.execute`` with the default
strategy and a :data:`TIMEOUT` timeout.

Outcomes per request: ``answered``; ``timed_out`` (cut while an attempt was in
flight: the endpoint did, or will do, the work, and nobody gets the answer); ``shed``
(ended without an attempt in flight: refused by the limiter until its deadline, or
ended between attempts). Latencies are of answered requests, from the request's start.
Runs on asyncio and trio (anyio).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs

from sdkcore import (
    AdaptiveConcurrencyLimiter,
    CouchbaseException,
    Request,
    RetryOrchestrator,
)
from sdkcore.mapping import KvOpcode, kv_request

from ._metrics import CountingOrchestrator, Counts, percentile

__all__ = [
    "CAPACITY",
    "NAME",
    "OFFERED",
    "SECONDS",
    "SERVICE",
    "TIMEOUT",
    "Run",
    "SlowEndpoint",
    "Slowdown",
    "planned_requests",
    "run_slowdown",
]

NAME = "slowdown"
#: The endpoint serves this many requests at a time, each for SERVICE seconds.
CAPACITY = 4
SERVICE = 0.01
#: Offered load, as a multiple of the endpoint's capacity (CAPACITY / SERVICE per second).
OFFERED = 2.0
#: How long requests are issued, in seconds.
SECONDS = 2.0
#: Every request's timeout, in seconds (ten service times).
TIMEOUT = 0.1
#: The two runs (JSON keys) and their labels.
RUNS = (
    ("without_limiter", "no limiter"),
    ("with_adaptive_limiter", "AdaptiveConcurrencyLimiter()"),
)


def rate() -> float:
    """Requests issued per second."""
    return OFFERED * CAPACITY / SERVICE


def planned_requests() -> int:
    """How many requests the scenario sends (both runs, for a progress bar)."""
    return len(RUNS) * int(rate() * SECONDS)


class SlowEndpoint:
    """``capacity`` servers of ``service`` seconds each, first come first served.

    A call books the first free server at once (its answer time is fixed when it
    arrives) and sleeps until then; a caller that gives up does not free its
    booking: the endpoint still does the work. The in-flight count beyond
    ``capacity`` is the queue, and each queued request waits its turn.
    """

    def __init__(self, capacity: int = CAPACITY, service: float = SERVICE) -> None:
        self.capacity = capacity
        self.service = service
        self._free: list[float] = [0.0] * capacity  # when each server is next free
        self.served = 0

    async def call(self) -> None:
        now = anyio.current_time()
        start = max(now, self._free[0])
        done = start + self.service
        heapq.heapreplace(self._free, done)
        self.served += 1
        await anyio.sleep(done - now)


@attrs.define
class Run:
    """One run: what the requests got."""

    key: str
    label: str
    sent: int = 0
    answered: int = 0
    timed_out: int = 0
    shed: int = 0
    #: Latencies of answered requests, seconds.
    latencies: list[float] = attrs.field(factory=list, repr=False)
    #: The limiter's limit at the end (None without a limiter).
    final_limit: int | None = None
    #: The limiter's limit, read as each request was issued (empty without a limiter).
    limits: list[int] = attrs.field(factory=list, repr=False)
    #: The most requests in flight at the endpoint at once.
    peak_in_flight: int = 0
    seconds: float = SECONDS

    @property
    def settled_limit(self) -> int | None:
        """The limiter's limit over the last quarter of the run: the median of the last
        quarter of :attr:`limits` (None without a limiter). Offered twice the capacity
        from the start, the limiter first grows (its baseline is the overloaded latency
        itself, so the gradient reads flat: 20 -> 27 in the first second here), then comes
        down, most runs about 1.1 s in, and moves about a few (1 to 13); its last reading
        alone ranged from 2 to 21, and this median from 3 to 19 (the fall comes at a
        different time in each run): a reading of the run, not a bound."""
        if not self.limits:
            return None
        later = sorted(self.limits[len(self.limits) * 3 // 4 :])
        return later[len(later) // 2]

    @property
    def goodput(self) -> float:
        """Answered requests per second of the run."""
        return self.answered / self.seconds

    def to_json(self) -> dict[str, Any]:
        ms = [x * 1000.0 for x in self.latencies]
        return {
            "label": self.label,
            "sent": self.sent,
            "answered": self.answered,
            "timed_out": self.timed_out,
            "shed": self.shed,
            "goodput_per_s": round(self.goodput, 1),
            "p50_ms": round(percentile(ms, 50), 2),
            "p99_ms": round(percentile(ms, 99), 2),
            "peak_in_flight": self.peak_in_flight,
            "final_limit": self.final_limit,
            "settled_limit": self.settled_limit,
        }


@attrs.define
class Slowdown:
    """The scenario's result: both runs."""

    runs: dict[str, Run] = attrs.field(factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """The scenario claims nothing it could fail for a timing: always True (its
        qualitative outcome is tested, not checked at run time)."""
        return True

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": {
                "capacity": CAPACITY,
                "service_ms": SERVICE * 1000.0,
                "capacity_per_s": CAPACITY / SERVICE,
                "offered_per_s": rate(),
                "seconds": SECONDS,
                "timeout_ms": TIMEOUT * 1000.0,
            },
            "runs": {key: run.to_json() for key, run in self.runs.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }


async def _one_run(
    run: Run,
    limiter: AdaptiveConcurrencyLimiter | None,
    orchestrator: RetryOrchestrator,
    on_done: Callable[[], None],
) -> None:
    endpoint = SlowEndpoint()
    in_flight = 0

    async def send(request: Request) -> None:
        nonlocal in_flight
        in_flight += 1
        run.peak_in_flight = max(run.peak_in_flight, in_flight)
        try:
            await endpoint.call()
        finally:
            in_flight -= 1

    async def guarded(request: Request) -> None:
        assert limiter is not None
        with limiter.guard():  # rfc/0009: throttle -> limiter -> breaker -> send
            await send(request)

    dispatch = send if limiter is None else guarded

    async def one() -> None:
        began = time.monotonic()
        request = kv_request(KvOpcode.GET, timeout=TIMEOUT)
        try:
            await orchestrator.execute(request, dispatch)
        except CouchbaseException as exc:
            context = exc.context
            if context is not None and context.in_flight:
                run.timed_out += 1
            else:
                run.shed += 1
        else:
            run.answered += 1
            run.latencies.append(time.monotonic() - began)
        finally:
            on_done()

    per_s = rate()
    total = int(per_s * SECONDS)
    async with anyio.create_task_group() as tg:
        start = anyio.current_time()
        while run.sent < total:
            due = min(total, int((anyio.current_time() - start) * per_s) + 1)
            while run.sent < due:
                tg.start_soon(one)
                run.sent += 1
                if limiter is not None:
                    run.limits.append(limiter.limit)
            await anyio.sleep(1.0 / per_s)
    if limiter is not None:
        run.final_limit = limiter.limit


def _nothing() -> None:
    pass


async def run_slowdown(
    *,
    on_done: Callable[[], None] = _nothing,
    counts: Counts | None = None,
    telemetry: Any = None,
) -> Slowdown:
    """Both runs at once, on two endpoints; ``on_done`` after each request ends."""
    started = time.perf_counter()
    counts = Counts() if counts is None else counts
    result = Slowdown()
    limiter = AdaptiveConcurrencyLimiter(name="slowdown")
    if telemetry is not None:
        telemetry.watch(limiter)
        counts.watched.append(limiter)
    async with anyio.create_task_group() as tg:
        for key, label in RUNS:
            run = result.runs[key] = Run(key, label)
            orchestrator = CountingOrchestrator(counts, telemetry=telemetry)
            tg.start_soon(
                _one_run, run, limiter if key != "without_limiter" else None, orchestrator, on_done
            )
    result.elapsed_s = time.perf_counter() - started
    return result
