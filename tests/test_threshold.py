"""ThresholdReporter: Couchbase RFC 67 threshold request logging (rfc/0008).

Every test runs on a virtual clock (a list read by the reporter): no timing.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from sdkcore import _sample
from sdkcore._threshold import ThresholdReporter
from sdkcore.testing import capture_retry_events

#: Every field RFC 67 names for an entry, in the order of its example.
RFC_FIELDS = [
    "total_duration_us",
    "encode_duration_us",
    "last_dispatch_duration_us",
    "total_dispatch_duration_us",
    "last_server_duration_us",
    "total_server_duration_us",
    "operation_name",
    "last_local_id",
    "operation_id",
    "last_local_socket",
    "last_remote_socket",
    "timeout_ms",
]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reporter(**kwargs: Any) -> tuple[ThresholdReporter, Clock]:
    clock = Clock()
    return ThresholdReporter(clock=clock, **kwargs), clock


# -- defaults and configuration ----------------------------------------------------------


def test_defaults_are_the_rfcs() -> None:
    r = ThresholdReporter()
    assert r.threshold("kv") == timedelta(milliseconds=500)
    for service in ("query", "views", "search", "analytics", "management", "eventing", "mine"):
        assert r.threshold(service) == timedelta(seconds=1)
    assert r.sample_size == 10
    assert r.emit_interval == timedelta(seconds=10)
    assert repr(r) == (
        "<ThresholdReporter kv=500ms default=1000ms sample_size=10 emit_interval=10s>"
    )


def test_named_thresholds_and_the_default() -> None:
    r = ThresholdReporter(
        kv_threshold=0.1,
        query_threshold=timedelta(seconds=3),
        default_threshold=2,
        analytics_threshold=0,
    )
    assert r.threshold("kv") == timedelta(milliseconds=100)
    assert r.threshold("query") == timedelta(seconds=3)
    assert r.threshold("search") == timedelta(seconds=2)  # not given: the default
    assert r.threshold("views") == timedelta(seconds=2)
    assert r.threshold("analytics") == timedelta(0)  # every analytics request is kept
    assert r.threshold("management") == timedelta(seconds=2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"kv_threshold": -0.5}, ValueError, r"ThresholdReporter\(kv_threshold\) must be >= 0"),
        ({"query_threshold": "1s"}, TypeError, r"ThresholdReporter\(query_threshold\) must be"),
        ({"views_threshold": math.nan}, ValueError, r"\(views_threshold\) must be a finite"),
        ({"search_threshold": math.inf}, ValueError, r"\(search_threshold\) must be a finite"),
        ({"analytics_threshold": []}, TypeError, r"\(analytics_threshold\) must be a datetime"),
        ({"default_threshold": None}, TypeError, r"\(default_threshold\) must be a datetime"),
        ({"sample_size": 0}, ValueError, r"ThresholdReporter\(sample_size\) must be an int >= 1"),
        ({"sample_size": 2.5}, TypeError, r"\(sample_size\) must be an int >= 1, got 2.5"),
        ({"sample_size": True}, TypeError, r"\(sample_size\) must be an int >= 1, got True"),
        ({"emit_interval": 0}, ValueError, r"ThresholdReporter\(emit_interval\) must be > 0"),
        ({"emit_interval": -1}, ValueError, r"\(emit_interval\) must be > 0 seconds"),
        ({"clock": 5}, TypeError, r"ThresholdReporter\(clock\) must be a callable"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        ThresholdReporter(**kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("kv", "get", "slow"), {}, TypeError, r"record\(duration\) must be a number of seconds"),
        (
            ("kv", "get", timedelta(seconds=2)),
            {},
            TypeError,
            r"record\(duration\) must be .* \(use \.total_seconds\(\)\)",
        ),
        (("kv", "get", math.nan), {}, ValueError, r"record\(duration\) must be a finite"),
        (("kv", "get", math.inf), {}, ValueError, r"record\(duration\) must be a finite"),
        (("kv", None, 2.0), {}, TypeError, r"record\(operation_name\) must be a str"),
        ((7, "get", 2.0), {}, TypeError, r"record\(service\) must be a str, got 7"),
        (("kv", "get", 2.0), {"timeout": -1}, ValueError, r"record\(timeout\) must be a finite"),
        (("kv", "get", 2.0), {"operation_id": 35}, TypeError, r"record\(operation_id\) must be"),
        (
            ("kv", "get", 2.0),
            {"last_remote_socket": ("h", 1)},
            TypeError,
            r"record\(last_remote_socket\) must be a str or None",
        ),
        (
            ("kv", "get", 2.0),
            {"last_dispatch_duration": "1"},
            TypeError,
            r"record\(last_dispatch_duration\) must be a number",
        ),
    ],
)
def test_bad_records_name_the_field(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, message: str
) -> None:
    r, _ = reporter()
    with pytest.raises(error, match=message):
        r.record(*args, **kwargs)
    assert r.report() is None  # nothing half-recorded


# -- what is kept ------------------------------------------------------------------------


def test_under_the_threshold_is_not_kept_at_the_threshold_is() -> None:
    r, _ = reporter()
    r.record("kv", "get", 0.499999)
    r.record("query", "query", 0.999)
    assert r.report() is None
    r.record("kv", "get", 0.5)  # at the threshold: kept (as the Java SDK's >=)
    r.record("query", "query", 1.0)
    report = r.report()
    assert report is not None
    assert report["kv"]["total_count"] == 1
    assert report["query"]["total_count"] == 1


def test_the_json_shape_and_field_names_are_the_rfcs() -> None:
    r, _ = reporter()
    r.record(
        "kv",
        "upsert",
        1.2,
        operation_id="0x23",
        timeout=75,
        last_remote_socket="10.112.180.101:11210",
        last_local_socket="10.211.55.3:52450",
        last_local_id="66388CF5BFCF7522/18CC8791579B567C",
        encode_duration=0.0001,
        last_dispatch_duration=0.00004,
        total_dispatch_duration=0.00004,
        last_server_duration=0.000002,
        total_server_duration=0.000002,
    )
    assert r.report() == {
        "kv": {
            "total_count": 1,
            "top_requests": [
                {
                    "total_duration_us": 1200000,
                    "encode_duration_us": 100,
                    "last_dispatch_duration_us": 40,
                    "total_dispatch_duration_us": 40,
                    "last_server_duration_us": 2,
                    "total_server_duration_us": 2,
                    "operation_name": "upsert",
                    "last_local_id": "66388CF5BFCF7522/18CC8791579B567C",
                    "operation_id": "0x23",
                    "last_local_socket": "10.211.55.3:52450",
                    "last_remote_socket": "10.112.180.101:11210",
                    "timeout_ms": 75000,
                }
            ],
        }
    }
    [entry] = r.report()["kv"]["top_requests"]  # type: ignore[index]
    assert list(entry) == RFC_FIELDS


def test_fields_not_given_are_left_out() -> None:
    r, _ = reporter()
    r.record("query", "query", 3)
    r.record("kv", "get", 0.75, timeout=2.5)
    assert r.report() == {
        "kv": {
            "total_count": 1,
            "top_requests": [
                {"total_duration_us": 750000, "operation_name": "get", "timeout_ms": 2500}
            ],
        },
        "query": {
            "total_count": 1,
            "top_requests": [{"total_duration_us": 3000000, "operation_name": "query"}],
        },
    }


def test_top_n_per_service_slowest_first_total_count_counts_all() -> None:
    r, _ = reporter(sample_size=3)
    for ms in (600, 900, 700, 1500, 800, 650, 1200):
        r.record("kv", f"op{ms}", ms / 1000)
    r.record("search", "search", 1.1)
    report = r.report()
    assert report is not None
    assert list(report) == ["kv", "search"]  # services by name
    assert report["kv"]["total_count"] == 7
    assert [e["operation_name"] for e in report["kv"]["top_requests"]] == [
        "op1500",
        "op1200",
        "op900",
    ]
    assert report["search"]["total_count"] == 1


def test_sample_size_ten_by_default() -> None:
    r, _ = reporter()
    for i in range(100):
        r.record("kv", "get", 0.5 + (i * 37 % 100) / 1000)  # 100 distinct durations, shuffled
    report = r.report()
    assert report is not None
    top = [e["total_duration_us"] for e in report["kv"]["top_requests"]]
    assert top == [599000 - 1000 * i for i in range(10)]
    assert report["kv"]["total_count"] == 100


def test_equal_durations_keep_the_earliest() -> None:
    r, _ = reporter(sample_size=2)
    for i in range(5):
        r.record("kv", f"op{i}", 1.0, operation_id=str(i))
    report = r.report()
    assert report is not None
    assert [e["operation_id"] for e in report["kv"]["top_requests"]] == ["0", "1"]


def test_services_beyond_the_bound_are_counted_as_other() -> None:
    r, _ = reporter(default_threshold=0)
    for i in range(_sample.MAX_SERVICES + 6):
        r.record(f"svc{i:03d}", "op", 1.0)
    report = r.report()
    assert report is not None
    assert len(report) == _sample.MAX_SERVICES + 1
    assert report["other"]["total_count"] == 6


def test_texts_are_cut_at_100_characters() -> None:
    r, _ = reporter(default_threshold=0)
    long = "x" * 250
    r.record("s" * 150, long, 1.0, operation_id=long, last_remote_socket=long)
    report = r.report()
    assert report is not None
    assert list(report) == ["s" * 100]
    [entry] = report["s" * 100]["top_requests"]
    assert entry["operation_name"] == entry["operation_id"] == "x" * 100
    assert entry["last_remote_socket"] == "x" * 100


# -- the interval --------------------------------------------------------------------------


def test_the_report_is_emitted_by_the_first_record_after_the_interval() -> None:
    r, clock = reporter()
    with capture_retry_events() as events:
        r.record("kv", "get", 0.6)  # opens the interval at t=0: due at 10
        clock.now = 9.999
        r.record("kv", "get", 0.7)
        r.record("kv", "get", 0.1)  # fast, the report is not due yet
        assert events == []
        clock.now = 10.0
        r.record("kv", "get", 0.1)  # fast: emits the pending report, keeps nothing
        assert [e["event"] for e in events] == ["threshold.report"]
        assert r.report() is None
        clock.now = 15.0
        r.record("kv", "get", 0.1)
        assert len(events) == 1  # nothing pending: nothing emitted
    report = json.loads(events[0]["report"])
    assert report["kv"]["total_count"] == 2
    assert [e["total_duration_us"] for e in report["kv"]["top_requests"]] == [700000, 600000]


def test_a_slow_record_after_the_interval_opens_the_next_one() -> None:
    r, clock = reporter()
    with capture_retry_events() as events:
        r.record("kv", "get", 0.6, operation_id="first")
        clock.now = 25.0
        r.record("kv", "get", 0.8, operation_id="second")  # emits the first, then is kept
        assert len(events) == 1
        [first] = json.loads(events[0]["report"])["kv"]["top_requests"]
        assert first["operation_id"] == "first"
        pending = r.report()
        assert pending is not None
        assert pending["kv"]["top_requests"][0]["operation_id"] == "second"
        clock.now = 34.999  # the second interval started at 25
        r.record("kv", "get", 0.1)
        assert len(events) == 1
        clock.now = 35.0
        r.record("kv", "get", 0.1)
        assert len(events) == 2


def test_nothing_is_emitted_when_nothing_was_slow() -> None:
    r, clock = reporter()
    with capture_retry_events() as events:
        for i in range(1000):
            clock.now = i * 0.5
            r.record("kv", "get", 0.25)
            r.record("query", "query", 0.75)
        assert r.flush() is None
    assert events == []


def test_flush_emits_now_and_report_does_not() -> None:
    r, clock = reporter()
    r.record("kv", "get", 2.0)
    with capture_retry_events() as events:
        pending = r.report()
        assert r.report() == pending  # left pending
        assert events == []
        assert r.flush() == pending
        assert r.report() is None
        assert r.flush() is None  # nothing more
    assert len(events) == 1
    # a new interval opens at the next slow record
    clock.now = 3.0
    r.record("kv", "get", 2.0)
    with capture_retry_events() as events:
        clock.now = 12.9
        r.record("kv", "get", 0.0)
        assert events == []
        clock.now = 13.0
        r.record("kv", "get", 0.0)
    assert len(events) == 1


def test_a_clock_stepping_back_never_stretches_the_interval() -> None:
    r, clock = reporter()
    clock.now = 1000.0
    r.record("kv", "get", 1.0)  # due at 1010
    clock.now = 5.0  # a virtual clock reset
    with capture_retry_events() as events:
        r.record("kv", "get", 1.0)  # the interval restarts at 5: due at 15
        clock.now = 15.0
        r.record("kv", "get", 0.0)
    assert len(events) == 1
    assert json.loads(events[0]["report"])["kv"]["total_count"] == 2


# -- the log event ---------------------------------------------------------------------------


def test_the_event_is_one_json_line_through_sdkcores_logger() -> None:
    r, _ = reporter(emit_interval=timedelta(seconds=30))
    r.record("kv", "get", 0.9, operation_id="0x1f", last_remote_socket="127.0.0.1:11210")
    with capture_retry_events() as events:
        report = r.flush()
    assert events == [
        {
            "event": "threshold.report",
            "log_level": "warning",
            "report": events[0]["report"],
            "emit_interval_s": 30.0,
        }
    ]
    line = events[0]["report"]
    assert isinstance(line, str)
    assert "\n" not in line
    assert " " not in line  # compact: no pretty-printing
    assert json.loads(line) == report


@pytest.fixture
def sdkcore_records() -> Iterator[list[logging.LogRecord]]:
    """The records of the stdlib logger ``sdkcore`` (structlog not configured here)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("sdkcore")
    handler = Keep(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_an_application_using_logging_gets_a_warning(
    sdkcore_records: list[logging.LogRecord],
) -> None:
    r, _ = reporter()
    r.record("kv", "get", 1.5, operation_id="0x2")
    report = r.flush()
    [record] = sdkcore_records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith('threshold.report report=\'{"kv":')
    fields = record.sdkcore  # type: ignore[attr-defined]
    assert json.loads(fields["report"]) == report
    assert fields["emit_interval_s"] == 10.0


def test_a_filtered_level_builds_no_report(
    monkeypatch: pytest.MonkeyPatch, sdkcore_records: list[logging.LogRecord]
) -> None:
    """Lazy emission asks the level first: no dict, no JSON when warnings are filtered."""
    built: list[object] = []
    real = _sample._report

    def counting(taken: Any) -> dict[str, Any]:
        built.append(taken)
        return real(taken)

    monkeypatch.setattr(_sample, "_report", counting)
    logger = logging.getLogger("sdkcore")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        r, clock = reporter()
        r.record("kv", "get", 1.0)
        clock.now = 10.0
        r.record("kv", "get", 0.0)  # the interval is over: taken, but not built
    finally:
        logger.setLevel(level)
    assert built == []
    assert sdkcore_records == []
    assert r.report() is None  # and dropped: memory stays bounded


def run(prelude: str) -> subprocess.CompletedProcess[str]:
    """``prelude`` then EMIT in a fresh interpreter (logging is process-global)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prelude) + EMIT],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


EMIT = """
from sdkcore._threshold import ThresholdReporter
from sdkcore._orphans import OrphanReporter
now = [0.0]
for cls in (ThresholdReporter, OrphanReporter):
    r = cls(clock=lambda: now[0])
    r.record("kv", "get", 2.0)
    now[0] += 10
    r.record("kv", "get", 2.0)  # emits the first interval's report
    r.flush()  # and the second's
"""


def test_an_unconfigured_application_sees_nothing() -> None:
    done = run("")
    assert done.stdout == ""
    assert done.stderr == ""


def test_logging_basic_config_shows_the_reports() -> None:
    done = run("import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n")
    lines = done.stderr.splitlines()
    assert [line.split(" ")[:2] for line in lines] == [
        ["WARNING", "threshold.report"],
        ["WARNING", "threshold.report"],
        ["WARNING", "orphan.report"],
        ["WARNING", "orphan.report"],
    ]


def test_a_structlog_application_gets_the_event_through_its_pipeline() -> None:
    done = run(
        """
        import json, structlog
        def keep(logger, method, event_dict):
            print(json.dumps({"method": method, **event_dict}))
            raise structlog.DropEvent
        structlog.configure(processors=[keep])
        """
    )
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["method"], e["event"]) for e in events] == [
        ("warning", "threshold.report"),
        ("warning", "threshold.report"),
        ("warning", "orphan.report"),
        ("warning", "orphan.report"),
    ]
    assert json.loads(events[0]["report"])["kv"]["total_count"] == 1


# -- threads ---------------------------------------------------------------------------------


def test_32_threads_record_nothing_lost_top_n_exact(
    sdkcore_records: list[logging.LogRecord],
) -> None:
    """32 threads record fast and slow requests while the clock moves: reports emitted
    meanwhile (by whichever thread) plus the final flush count every slow request once,
    and a single interval's top 10 are the 10 slowest overall."""
    threads, per_thread = 32, 500
    clock = Clock()
    r = ThresholdReporter(clock=clock, emit_interval=1.0)
    tick = threading.Lock()
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            r.record("kv", "get", 0.5 + (t * per_thread + i) / 1e6, operation_id=f"{t}:{i}")
            r.record("kv", "get", 0.01)  # fast
            r.record("query", "query", 0.5)  # under query's 1 s
            if i % 50 == 0:
                with tick:
                    clock.now += 0.3

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    final = r.flush()
    reports = [json.loads(rec.sdkcore["report"]) for rec in sdkcore_records]  # type: ignore[attr-defined]
    assert final is not None
    assert reports[-1] == final
    assert len(reports) > 2  # emitted along the way, from the recording threads
    assert sum(rep["kv"]["total_count"] for rep in reports) == threads * per_thread
    assert all(set(rep) == {"kv"} for rep in reports)
    for rep in reports:
        top = [e["total_duration_us"] for e in rep["kv"]["top_requests"]]
        assert len(top) == min(10, rep["kv"]["total_count"])
        assert top == sorted(top, reverse=True)
    ids = [e["operation_id"] for rep in reports for e in rep["kv"]["top_requests"]]
    assert len(ids) == len(set(ids))  # no entry reported twice


def test_32_threads_one_interval_keeps_the_10_slowest() -> None:
    threads, per_thread = 32, 300
    r, _ = reporter()
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        start.wait()
        for i in range(per_thread):
            r.record("kv", "get", 0.5 + (i * threads + t) / 1e6)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    report = r.report()
    assert report is not None
    assert report["kv"]["total_count"] == threads * per_thread
    largest = threads * per_thread - 1
    assert [e["total_duration_us"] for e in report["kv"]["top_requests"]] == [
        500000 + largest - k for k in range(10)
    ]
