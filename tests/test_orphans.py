"""OrphanReporter: Couchbase RFC 67 orphaned response reporting (rfc/0008).

Every test runs on a virtual clock: no timing. The sample, the interval and the log
event are the threshold reporter's (tests/test_threshold.py); these tests pin what the
orphan reporter does with them.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import threading
import weakref
from datetime import timedelta
from typing import Any

import pytest

from sdkcore._orphans import OrphanReporter
from sdkcore.testing import capture_retry_events


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reporter(**kwargs: Any) -> tuple[OrphanReporter, Clock]:
    clock = Clock()
    return OrphanReporter(clock=clock, **kwargs), clock


def test_defaults_are_the_rfcs() -> None:
    r = OrphanReporter()
    assert r.sample_size == 10
    assert r.emit_interval == timedelta(seconds=10)
    assert repr(r) == "<OrphanReporter sample_size=10 emit_interval=10s>"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"sample_size": 0}, ValueError, r"OrphanReporter\(sample_size\) must be an int >= 1"),
        ({"sample_size": "10"}, TypeError, r"OrphanReporter\(sample_size\) must be an int"),
        ({"emit_interval": 0}, ValueError, r"OrphanReporter\(emit_interval\) must be > 0"),
        ({"emit_interval": math.nan}, ValueError, r"\(emit_interval\) must be a finite"),
        ({"emit_interval": "10s"}, TypeError, r"OrphanReporter\(emit_interval\) must be a"),
        ({"clock": None}, TypeError, r"OrphanReporter\(clock\) must be a callable"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        OrphanReporter(**kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("kv", "get", -0.1), {}, ValueError, r"OrphanReporter.record\(duration\) must be a"),
        (("kv", "get", None), {}, TypeError, r"OrphanReporter.record\(duration\) must be a"),
        (("kv", b"get", 1.0), {}, TypeError, r"record\(operation_name\) must be a str"),
        ((None, "get", 1.0), {}, TypeError, r"OrphanReporter.record\(service\) must be a str"),
        (("kv", "get", 1.0), {"timeout": timedelta(1)}, TypeError, r"\.total_seconds\(\)"),
        (("kv", "get", 1.0), {"last_local_id": 1}, TypeError, r"record\(last_local_id\) must"),
    ],
)
def test_bad_records_name_the_field(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, message: str
) -> None:
    r, _ = reporter()
    with pytest.raises(error, match=message):
        r.record(*args, **kwargs)
    assert r.report() is None


def test_every_orphan_counts_however_fast() -> None:
    """No threshold: an answer nobody waits for any more is an orphan."""
    r, _ = reporter()
    r.record("kv", "noop", 0.0)
    r.record("kv", "get", 0.000123)
    report = r.report()
    assert report is not None
    assert report["kv"]["total_count"] == 2
    assert [e["total_duration_us"] for e in report["kv"]["top_requests"]] == [123, 0]


def test_the_json_shape_and_field_names_are_the_rfcs() -> None:
    r, _ = reporter()
    r.record(
        "kv",
        "get",
        2.004113,
        operation_id="0x2",
        timeout=1.5,
        last_dispatch_duration=1.50022,
        last_remote_socket="127.0.0.1:11211",
        last_local_socket="127.0.0.1:50412",
        last_server_duration=0.000002,
    )
    assert r.report() == {
        "kv": {
            "total_count": 1,
            "top_requests": [
                {
                    "total_duration_us": 2004113,
                    "last_dispatch_duration_us": 1500220,
                    "last_server_duration_us": 2,
                    "operation_name": "get",
                    "operation_id": "0x2",
                    "last_local_socket": "127.0.0.1:50412",
                    "last_remote_socket": "127.0.0.1:11211",
                    "timeout_ms": 1500,
                }
            ],
        }
    }


def test_top_n_by_total_duration_slowest_first() -> None:
    r, _ = reporter(sample_size=2)
    for seconds, opaque in ((1.0, "0x1"), (3.0, "0x2"), (2.0, "0x3"), (0.5, "0x4")):
        r.record("kv", "get", seconds, operation_id=opaque, last_server_duration=4 - seconds)
    r.record("query", "query", 9.0)
    report = r.report()
    assert report is not None
    assert report["kv"]["total_count"] == 4
    assert [e["operation_id"] for e in report["kv"]["top_requests"]] == ["0x2", "0x3"]
    assert report["query"]["total_count"] == 1


def test_lazy_interval_and_the_event() -> None:
    r, clock = reporter()
    with capture_retry_events() as events:
        r.record("kv", "get", 1.0, operation_id="0x1")
        clock.now = 9.5
        r.record("kv", "get", 1.0, operation_id="0x2")
        assert events == []
        clock.now = 10.0
        r.record("kv", "get", 1.0, operation_id="0x3")  # emits 0x1 and 0x2, keeps 0x3
        assert r.flush() is not None  # and 0x3, now
        assert r.flush() is None
    assert [(e["event"], e["log_level"], e["emit_interval_s"]) for e in events] == [
        ("orphan.report", "warning", 10.0),
        ("orphan.report", "warning", 10.0),
    ]
    first, second = (json.loads(e["report"]) for e in events)
    assert [e["operation_id"] for e in first["kv"]["top_requests"]] == ["0x1", "0x2"]
    assert first["kv"]["total_count"] == 2
    assert second == {
        "kv": {
            "total_count": 1,
            "top_requests": [
                {"total_duration_us": 1000000, "operation_name": "get", "operation_id": "0x3"}
            ],
        }
    }


def test_nothing_recorded_nothing_emitted() -> None:
    r, clock = reporter()
    with capture_retry_events() as events:
        clock.now = 100.0
        assert r.flush() is None
        assert r.report() is None
    assert events == []


def test_32_threads() -> None:
    threads, per_thread = 32, 400
    r, _ = reporter()
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            r.record("kv", "get", (i * threads + t) / 1e6, operation_id=f"0x{i * threads + t:x}")

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    with capture_retry_events() as events:
        report = r.flush()
    assert report is not None
    assert report["kv"]["total_count"] == threads * per_thread
    largest = threads * per_thread - 1
    assert [e["operation_id"] for e in report["kv"]["top_requests"]] == [
        f"0x{largest - k:x}" for k in range(10)
    ]
    assert len(events) == 1


# -- on the real clock, a report is logged on time (the one real-time test here) -------------


class _Records(logging.Handler):
    """The reports of one kind (another test's reporter on the real clock may log too)."""

    def __init__(self, event: str) -> None:
        super().__init__(logging.WARNING)
        self.event = event
        self.reports: list[str] = []
        self.arrived = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "sdkcore", {})
        if fields.get("event") == self.event:
            self.reports.append(fields["report"])
            self.arrived.set()


@pytest.mark.parametrize("kind", ["orphan", "threshold"])
def test_a_burst_then_silence_is_reported_at_the_intervals_end(kind: str) -> None:
    """The report waited for the next record: orphans seen during an incident, then none,
    were never logged (RFC 67's worker logs every interval). On the real clock one timer
    thread for the process logs it at the interval's end, and holds no reporter alive."""
    from sdkcore import ThresholdReporter

    logger = logging.getLogger("sdkcore")
    handler = _Records(f"{kind}.report")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        reporter_: Any
        if kind == "orphan":
            reporter_ = OrphanReporter(emit_interval=0.05)
            reporter_.record("kv", "get", 2.0, operation_id="0x1")
        else:
            reporter_ = ThresholdReporter(emit_interval=0.05)
            reporter_.record("kv", "get", 2.0)
        assert handler.arrived.wait(10), "no report within 10 s of a 50 ms interval"
        assert len(handler.reports) == 1
        assert '"total_count":1' in handler.reports[0]
        assert reporter_.report() is None  # taken by the timer
        held = weakref.ref(reporter_._sample)
        reporter_.record("kv", "get", 2.0)  # opens another interval: scheduled, held weakly
        del reporter_
        gc.collect()
        assert held() is None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert sum(t.name == "sdkcore-report" for t in threading.enumerate()) == 1


def test_an_injected_clock_arms_no_timer() -> None:
    from sdkcore._sample import _TIMER

    r, _clock = reporter(emit_interval=0.01)
    r.record("kv", "get", 1.0)
    assert all(ref() is not r._sample for _, _, ref in _TIMER._heap)
    assert r.report() is not None  # pending until a record or flush() on that clock


def test_the_timer_keeps_one_entry_per_reporter() -> None:
    """Every interval that opened pushed an entry, and flush() left it there until it came
    due: 100,000 record-and-flush cycles on one reporter kept 100,000 entries."""
    from sdkcore._sample import _TIMER

    r = OrphanReporter(emit_interval=3600)  # the real clock: the timer is used
    for _ in range(1000):
        r.record("kv", "get", 1.0)
        r.flush()
    mine = [ref for _, _, ref in _TIMER._heap if ref() is r._sample]
    assert len(mine) == 1
