"""ThresholdReporter and OrphanReporter against a brute-force model (rfc/0008, "Threshold
logging and orphan reporting"), on seeded random schedules.

The model keeps every record of the open interval in a list and, at each report, sorts
them: per service the ``sample_size`` slowest (equal durations: the earliest recorded),
``total_count`` all counted, services by name, fields in the rfc's table order, durations
in µs (rounded), the timeout in ms. Its interval rules are the rfc's: an interval opens at
the first kept record and is over ``emit_interval`` later; the first record at or after
its end (a threshold reporter's fast record too) logs the report, then counts itself in
a new interval; ``flush()`` logs at once; nothing is logged for an empty interval; a clock
that steps back restarts the pending interval at its new reading.

Clock readings and thresholds are on a binary grid (multiples of 1/8 s), so the model's
``opened + interval`` is the code's arithmetic exactly.

One ambiguity is not asserted: "the timeout truncated to the millisecond" is read as the
timeout rounded to µs (as every other duration) then truncated (0.0019999999 s is 2 ms,
not 1); the random timeouts here are whole µs, where both readings agree.
"""

from __future__ import annotations

import contextvars
import json
import math
import random
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from sdkcore._orphans import OrphanReporter
from sdkcore._threshold import ThresholdReporter
from sdkcore.testing import capture_retry_events

#: rfc/0008's table: (entry field, record() keyword, kind), after total_duration_us.
TABLE = [
    ("encode_duration_us", "encode_duration", "us"),
    ("last_dispatch_duration_us", "last_dispatch_duration", "us"),
    ("total_dispatch_duration_us", "total_dispatch_duration", "us"),
    ("last_server_duration_us", "last_server_duration", "us"),
    ("total_server_duration_us", "total_server_duration", "us"),
    ("operation_name", None, "text"),
    ("last_local_id", "last_local_id", "text"),
    ("operation_id", "operation_id", "text"),
    ("last_local_socket", "last_local_socket", "text"),
    ("last_remote_socket", "last_remote_socket", "text"),
    ("timeout_ms", "timeout", "ms"),
]
NAMED = ("kv", "query", "views", "search", "analytics")
OTHERS = ("management", "eventing", "transactions", "my-app", "other", "x" * 130, "x" * 100)
MAX_SERVICES = 64
INF = math.inf


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def micros(seconds: float) -> int:
    return round(seconds * 1_000_000)  # "rounded to the microsecond"


def cut(text: str) -> str:
    return text[:100]


class Model:
    """Every record of the open interval in a list; the report by sorting them."""

    def __init__(
        self, thresholds: dict[str, float] | None, default: float, size: int, interval: float
    ) -> None:
        self.thresholds = thresholds  # None: the orphan reporter, which keeps every record
        self.default = default
        self.size = size
        self.interval = interval
        self.records: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
        self.opened = INF  # when the pending interval opened (inf: nothing pending)
        self.seq = 0
        self.kept = 0

    def threshold(self, service: str) -> float:
        if self.thresholds is None:
            return 0.0
        return self.thresholds.get(service, self.default)

    def record(
        self, now: float, service: str, name: str, duration: float, kw: dict[str, Any]
    ) -> dict[str, Any] | None:
        """What the reporter emits for this record (None: nothing)."""
        due = self.opened + self.interval
        if duration < self.threshold(service):
            return self.take() if now >= due else None
        emitted = None
        if now >= due:
            emitted = self.take()
        elif now < self.opened:  # the clock stepped back
            self.opened = now
        if self.opened == INF:
            self.opened = now
        service = cut(service)
        if service not in self.records and len(self.records) >= MAX_SERVICES:
            service = "other"
        self.records.setdefault(service, []).append(
            (micros(duration), self.seq, entry(name, duration, kw))
        )
        self.seq += 1
        self.kept += 1
        return emitted

    def report(self) -> dict[str, Any] | None:
        if not self.records:
            return None
        out: dict[str, Any] = {}
        for service in sorted(self.records):
            rows = sorted(self.records[service], key=lambda r: (-r[0], r[1]))
            out[service] = {
                "total_count": len(rows),
                "top_requests": [r[2] for r in rows[: self.size]],
            }
        return out

    def take(self) -> dict[str, Any] | None:
        report = self.report()
        self.records = {}
        self.opened = INF
        return report


def entry(name: str, duration: float, kw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"total_duration_us": micros(duration)}
    for field, keyword, kind in TABLE:
        value: Any = name if keyword is None else kw.get(keyword)
        if value is None:
            continue
        if kind == "us":
            out[field] = micros(value)
        elif kind == "ms":
            out[field] = micros(value) // 1000
        else:
            out[field] = cut(value)
    return out


def line(report: dict[str, Any]) -> str:
    return json.dumps(report, separators=(",", ":"))


def event(kind: str, report: dict[str, Any], interval: float) -> dict[str, Any]:
    return {
        "event": kind,
        "log_level": "warning",
        "report": line(report),
        "emit_interval_s": interval,
    }


# -- random inputs ---------------------------------------------------------------------------


def random_kwargs(rng: random.Random) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for _, keyword, kind in TABLE:
        if keyword is None or rng.random() < 0.5:
            continue
        if kind == "us":
            kw[keyword] = rng.choice([0, 0.0, rng.random() * 3, rng.randrange(10**7) / 1e6, 1])
        elif kind == "ms":
            kw[keyword] = rng.choice([0, 2.5, rng.randrange(10**7) / 1e6, 75, 0.0009])
        else:
            kw[keyword] = rng.choice(
                ["", "0x23", f"10.0.0.{rng.randrange(256)}:11210", "é" * 120, f"id-{rng.random()}"]
            )
    return kw


def random_duration(rng: random.Random, threshold: float) -> float | int:
    return rng.choice(
        [
            threshold,
            math.nextafter(threshold, 0.0),
            math.nextafter(threshold, INF),
            threshold + 1e-6,
            max(0.0, threshold - 1e-6),
            threshold * rng.random(),
            threshold + rng.random() * 2,
            threshold + rng.randrange(8) / 1000,  # ties: few distinct values
            0,
            0.0,
            int(threshold) + rng.randrange(3),  # an int
        ]
    )


def random_thresholds(rng: random.Random) -> tuple[dict[str, Any], dict[str, float], float]:
    """ThresholdReporter kwargs (timedelta or seconds, some left None), the thresholds it
    should use per named service, and the default."""
    grid = [0.0, 0.125, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
    default = rng.choice(grid)
    kwargs: dict[str, Any] = {"default_threshold": default}
    used: dict[str, float] = {}
    for service in NAMED:
        value = rng.choice([*grid, None])
        used[service] = default if value is None else value
        if value is not None:
            kwargs[f"{service}_threshold"] = (
                timedelta(seconds=value) if rng.random() < 0.5 else value
            )
        elif service == "kv":
            used[service] = 0.5  # kv's own default, not default_threshold
    return kwargs, used, default


def random_service(rng: random.Random, many: bool) -> str:
    if many and rng.random() < 0.7:
        return f"svc{rng.randrange(150)}"  # past 64 distinct: "other"
    return rng.choice([*NAMED, *NAMED, *OTHERS])


def make(
    kind: str, rng: random.Random, clock: Clock
) -> tuple[ThresholdReporter | OrphanReporter, Model, str]:
    size = rng.choice([1, 2, 3, 10])
    interval = rng.choice([0.5, 2.5, 10.0])
    emit = timedelta(seconds=interval) if rng.random() < 0.5 else interval
    if kind == "threshold":
        kwargs, used, default = random_thresholds(rng)
        r: Any = ThresholdReporter(sample_size=size, emit_interval=emit, clock=clock, **kwargs)
        return r, Model(used, default, size, interval), "threshold.report"
    r = OrphanReporter(sample_size=size, emit_interval=emit, clock=clock)
    return r, Model(None, 0.0, size, interval), "orphan.report"


def advance(rng: random.Random, clock: Clock, interval: float) -> None:
    step = rng.choice(
        [0.0, 0.125, interval - 0.125, interval, interval + 0.125, 3 * interval, -1.0]
    )
    if step < 0 and rng.random() < 0.3:
        clock.now = max(0.0, clock.now - rng.choice([0.125, interval, 2 * interval]))  # steps back
    elif step >= 0:
        clock.now += step


# -- one thread, every step against the model -------------------------------------------------


def run_schedule(kind: str, seed: int, steps: int = 400) -> None:
    rng = random.Random(seed)
    clock = Clock()
    r, model, event_name = make(kind, rng, clock)
    many = seed % 3 == 0  # past 64 services in one interval: few flushes, few clock moves
    p_record, p_report, p_flush = (0.96, 0.97, 0.98) if many else (0.7, 0.8, 0.87)
    with capture_retry_events() as events:
        for step in range(steps):
            where = f"seed={seed} step={step}"
            seen = len(events)
            op = rng.random()
            if op < p_record:
                service = random_service(rng, many)
                duration = random_duration(rng, model.threshold(service))
                kw = random_kwargs(rng)
                name = rng.choice(["get", "upsert", "query", "n" * 150])
                r.record(service, name, duration, **kw)
                expected = model.record(clock.now, service, name, duration, kw)
                wanted = [] if expected is None else [event(event_name, expected, model.interval)]
                assert events[seen:] == wanted, where
            elif op < p_report:
                assert r.report() == model.report(), where
                assert events[seen:] == [], where
            elif op < p_flush:
                expected = model.take()
                got = r.flush()
                assert got == expected, where
                wanted = [] if expected is None else [event(event_name, expected, model.interval)]
                assert events[seen:] == wanted, where
                if got is not None:  # one compact line, the rfc's key order
                    text = events[-1]["report"]
                    assert "\n" not in text
                    assert json.loads(text) == got
                    assert list(json.loads(text)) == sorted(got)
            else:
                advance(rng, clock, model.interval)
        expected = model.take()
        assert r.flush() == expected
    assert model.kept == sum(
        json.loads(e["report"]).get(s, {}).get("total_count", 0)
        for e in events
        for s in json.loads(e["report"])
    ), "a record lost or counted twice across intervals"


@pytest.mark.parametrize("seed", range(40))
def test_threshold_reporter_matches_the_model(seed: int) -> None:
    run_schedule("threshold", seed)


@pytest.mark.parametrize("seed", range(30))
def test_orphan_reporter_matches_the_model(seed: int) -> None:
    run_schedule("orphans", seed)


def test_entry_fields_and_units_are_the_rfcs() -> None:
    r = ThresholdReporter(clock=Clock())
    r.record(
        "kv",
        "get",
        1.2,
        operation_id="0x23",
        timeout=2.5,
        last_remote_socket="10.112.180.101:11210",
        last_local_socket="10.211.55.3:52450",
        last_local_id="conn-1",
        encode_duration=0.000011,
        last_dispatch_duration=0.00004,
        total_dispatch_duration=0.0000415,
        last_server_duration=0.000002,
        total_server_duration=3,
    )
    with capture_retry_events() as events:
        report = r.flush()
    assert events[0]["report"] == (
        '{"kv":{"total_count":1,"top_requests":[{"total_duration_us":1200000,'
        '"encode_duration_us":11,"last_dispatch_duration_us":40,"total_dispatch_duration_us":42,'
        '"last_server_duration_us":2,"total_server_duration_us":3000000,"operation_name":"get",'
        '"last_local_id":"conn-1","operation_id":"0x23","last_local_socket":"10.211.55.3:52450",'
        '"last_remote_socket":"10.112.180.101:11210","timeout_ms":2500}]}}'
    )
    assert report == json.loads(events[0]["report"])


# -- bad input: a clear error, nothing recorded --------------------------------------------------

BAD_DURATIONS: list[tuple[Any, type[Exception]]] = [
    (-1.0, ValueError),
    (-0.000001, ValueError),
    (-1, ValueError),
    (math.nan, ValueError),
    (INF, ValueError),
    (-INF, ValueError),
    (timedelta(seconds=2), TypeError),
    (timedelta(0), TypeError),
    (True, TypeError),
    (False, TypeError),
    ("1", TypeError),
    (None, TypeError),
]
BAD_FIELDS: list[tuple[dict[str, Any], str, type[Exception]]] = [
    ({"timeout": -1}, "timeout", ValueError),
    ({"timeout": math.nan}, "timeout", ValueError),
    ({"encode_duration": "1"}, "encode_duration", TypeError),
    ({"last_dispatch_duration": -0.5}, "last_dispatch_duration", ValueError),
    ({"total_server_duration": timedelta(1)}, "total_server_duration", TypeError),
    ({"operation_id": 35}, "operation_id", TypeError),
    ({"last_local_socket": ("h", 1)}, "last_local_socket", TypeError),
    ({"last_local_id": b"x"}, "last_local_id", TypeError),
]


def bad_call(
    rng: random.Random, model: Model
) -> tuple[tuple[Any, ...], dict[str, Any], type[Exception], str]:
    pick = rng.random()
    if pick < 0.5:
        value, error = rng.choice(BAD_DURATIONS)
        return (rng.choice([*NAMED, "management"]), "get", value), {}, error, "duration"
    if pick < 0.6:  # a service that is not a str, fast or slow
        return (
            (rng.choice([7, None, b"kv"]), "get", rng.choice([0, 0.1, 5.0])),
            {},
            TypeError,
            "service",
        )
    if pick < 0.7:
        service = rng.choice(NAMED)
        slow = model.threshold(service) + 1
        return (service, rng.choice([None, 3, b"get"]), slow), {}, TypeError, "operation_name"
    kw, field, error = rng.choice(BAD_FIELDS)
    service = rng.choice(NAMED)
    return (service, "get", model.threshold(service) + 0.5), kw, error, field


@pytest.mark.parametrize("kind", ["threshold", "orphans"])
@pytest.mark.parametrize("seed", range(10))
def test_bad_input_is_refused_naming_the_field_and_records_nothing(kind: str, seed: int) -> None:
    """rfc/0008: record() raises TypeError or ValueError naming the field, "and records
    nothing then". Bad calls are made only while no report is due (whether a refused
    record may still log a due report is not said)."""
    rng = random.Random(1000 + seed)
    clock = Clock()
    r, model, event_name = make(kind, rng, clock)
    with capture_retry_events() as events:
        for step in range(200):
            where = f"seed={seed} step={step}"
            if rng.random() < 0.35 and clock.now < model.opened + model.interval:
                args, kw, error, field = bad_call(rng, model)
                before, seen = r.report(), len(events)
                with pytest.raises(error, match=rf"record\({field}\)"):
                    r.record(*args, **kw)
                assert r.report() == before, where
                assert events[seen:] == [], where
            elif rng.random() < 0.8:
                seen = len(events)
                service = rng.choice([*NAMED, "management"])
                duration = random_duration(rng, model.threshold(service))
                r.record(service, "get", duration)
                expected = model.record(clock.now, service, "get", duration, {})
                wanted = [] if expected is None else [event(event_name, expected, model.interval)]
                assert events[seen:] == wanted, where
            else:
                advance(rng, clock, model.interval)
        assert r.flush() == model.take()


# -- several threads at once ---------------------------------------------------------------------


def in_threads(work: Callable[[int], object], n: int) -> None:
    """``work(i)`` in ``n`` threads, each in a copy of this context (so a capture sees
    what they log), started together."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # many more interleavings
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(run, i)) for i in range(n)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors


@pytest.mark.parametrize("kind", ["threshold", "orphans"])
@pytest.mark.parametrize("seed", range(3))
def test_8_threads_one_interval_equals_the_model(kind: str, seed: int) -> None:
    """8 threads x 500 records in one interval: the report is the model's exactly (every
    duration distinct, so which of equal ones came first never matters)."""
    rng = random.Random(2000 + seed)
    clock = Clock()
    r, model, event_name = make(kind, rng, clock)
    plans: list[list[tuple[str, float, dict[str, Any]]]] = []
    distinct = iter(rng.sample(range(10**7), 8 * 500))
    for t in range(8):
        plan = []
        for i in range(500):
            service = rng.choice([*NAMED, "management", "my-app"])
            us = next(distinct)
            duration = model.threshold(service) + rng.choice([-1, 1]) * us / 1e7
            plan.append((service, max(0.0, duration), {"operation_id": f"{t}-{i}"}))
        plans.append(plan)
    with capture_retry_events() as events:
        in_threads(lambda t: [r.record(s, "get", d, **kw) for s, d, kw in plans[t]], 8)
        assert events == []  # the clock did not move: nothing due
        for plan in plans:  # the model: any order of the threads' records
            for s, d, kw in plan:
                model.record(0.0, s, "get", d, kw)
        expected = model.take()
        assert r.report() == expected
        assert r.flush() == expected
        assert events == ([] if expected is None else [event(event_name, expected, model.interval)])


@pytest.mark.parametrize("kind", ["threshold", "orphans"])
@pytest.mark.parametrize("seed", range(3))
def test_8_threads_with_flushes_and_a_moving_clock_lose_nothing(kind: str, seed: int) -> None:
    """8 threads x 500 records while the clock moves and flush() runs: every kept record is
    counted in exactly one report, each report is well formed (top slowest first, at most
    sample_size, each id once), and the slowest sample_size of a service over the whole run
    each appear in a report (the slowest overall are the slowest of their interval)."""
    rng = random.Random(3000 + seed)
    clock = Clock()
    r, model, _ = make(kind, rng, clock)
    size = model.size
    plans: list[list[tuple[str, float, str, bool]]] = []
    for t in range(8):
        plan = []
        for i in range(500):
            service = rng.choice([*NAMED, "management", "my-app"])
            thr = model.threshold(service)
            duration = random_duration(rng, thr)
            plan.append((service, duration, f"{t}-{i}", duration >= thr))
        plans.append(plan)
    flushed: list[dict[str, Any]] = []

    def work(t: int) -> None:
        local = random.Random(t)
        for service, duration, op_id, _ in plans[t]:
            r.record(service, "get", duration, operation_id=op_id)
            if local.random() < 0.02:
                clock.now += model.interval / 3
            if local.random() < 0.01:
                got = r.flush()
                if got is not None:
                    flushed.append(got)

    with capture_retry_events() as events:
        in_threads(work, 8)
        last = r.flush()
    reports = [json.loads(e["report"]) for e in events]
    assert len(reports) >= len(flushed) + (last is not None)  # and those record() logged
    for got in [*flushed, *([last] if last else [])]:
        assert got in reports  # each flush logged what it returned
    counts: dict[str, int] = {}
    ids: set[str] = set()
    for report in reports:
        assert list(report) == sorted(report)
        for service, part in report.items():
            counts[service] = counts.get(service, 0) + part["total_count"]
            top = part["top_requests"]
            assert len(top) == min(size, part["total_count"])
            us = [e["total_duration_us"] for e in top]
            assert us == sorted(us, reverse=True)
            for e in top:
                assert e["operation_id"] not in ids
                ids.add(e["operation_id"])
    kept: dict[str, list[tuple[int, str]]] = {}
    for plan in plans:
        for service, duration, op_id, slow in plan:
            if slow:
                kept.setdefault(service, []).append((micros(duration), op_id))
    assert counts == {s: len(v) for s, v in kept.items()}
    for service, rows in kept.items():
        rows.sort(reverse=True)
        must = [op for us, op in rows[:size] if us > rows[min(size, len(rows)) - 1][0]]
        assert set(must) <= ids, service  # strictly slower than the size-th: never dropped


# -- end to end: the memcached example client against a real memcached ---------------------------

sys.path.insert(0, str(Path(__file__).parent / "memcached"))
from fault_proxy import FaultProxy  # noqa: E402
from memcached_server import Memcached, memcached_binary  # noqa: E402

DELAY = 0.2  # the proxy holds each reply this long, one after the other


@pytest.fixture
def proxied() -> Iterator[FaultProxy]:
    """A real memcached behind the fault proxy (skipped without memcached unless CI=true)."""
    server = Memcached(memcached_binary()).start()
    try:
        proxy = FaultProxy(server.port).start()
        try:
            yield proxy
        finally:
            proxy.stop()
    finally:
        server.kill()


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [0])
@pytest.mark.usefixtures("no_gc_pauses")  # the deadline falls 0.1 s from the answers around it
async def test_memcached_late_answers_are_exactly_the_orphans(
    proxied: FaultProxy, seed: int
) -> None:
    """k random operations pipelined on one connection; the proxy answers them one per DELAY;
    the deadline ((m + 0.5) * DELAY) lets the first m through and cuts the others, whose
    answers then arrive on the open connection: those, and only those, are orphans."""
    from sdkcore import TimeoutException
    from sdkcore.examples.memcached import MemcachedClient

    rng = random.Random(4000 + seed)
    k = rng.randint(2, 4)
    m = rng.randint(1, k - 1)
    names = [rng.choice(["get", "set", "noop"]) for _ in range(k)]
    reporter = OrphanReporter(clock=lambda: 0.0)  # frozen: nothing logged by itself
    target = f"127.0.0.1:{proxied.port}"
    async with MemcachedClient(target) as direct:
        await direct.set("k", b"v")
    timed_out: list[str] = []
    answered: list[str] = []

    async def one(client: MemcachedClient, name: str) -> None:
        call: dict[str, Callable[[], Awaitable[object]]] = {
            "get": lambda: client.get("k"),
            "set": lambda: client.set("k", b"v"),
        }
        try:
            await call.get(name, client.noop)()
            answered.append(name)
        except TimeoutException:
            timed_out.append(name)

    timeout = (m + 0.5) * DELAY
    with anyio.fail_after(30):
        async with MemcachedClient(target, timeout=timeout, orphan_reporter=reporter) as client:
            await client.noop()  # connected before the operations are written back to back
            proxied.delay = DELAY
            proxied.reset_counts()
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(one, client, name)
            while (report := reporter.report()) is None or report["kv"]["total_count"] < k - m:  # noqa: ASYNC110
                await anyio.sleep(0.02)
            await anyio.sleep(DELAY)  # nothing more comes in
            report = reporter.report()
    _, _, requests = proxied.counts()
    assert sum(requests.values()) == k  # each operation sent once: no retry
    assert len(answered) == m
    assert len(timed_out) == k - m
    assert report is not None
    assert list(report) == ["kv"]
    assert report["kv"]["total_count"] == k - m == sum(requests.values()) - len(answered)
    top = report["kv"]["top_requests"]
    assert sorted(e["operation_name"] for e in top) == sorted(timed_out)
    assert len({e["operation_id"] for e in top}) == len(top)
    durations = [e["total_duration_us"] for e in top]
    assert durations == sorted(durations, reverse=True)
    for e in top:
        assert e["timeout_ms"] == micros(timeout) // 1000
        assert e["last_remote_socket"] == target
        assert 0 < e["last_dispatch_duration_us"] < e["total_duration_us"]
    with capture_retry_events() as events:
        assert reporter.flush() == report
    assert [json.loads(e["report"]) for e in events] == [report]
