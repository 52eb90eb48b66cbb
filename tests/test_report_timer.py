"""The report timer's promises (``sdkcore._sample._Timer``): a forked child times the
intervals it inherited with a thread of its own, and a process that cannot start a
thread still gets its reports, from records and ``flush()``, and tries again later.

Each case runs in a fresh interpreter: a fork, and a ``threading.Thread.start`` that
fails, must not touch the test process's own timer thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

#: Collects the sdkcore report lines of one kind; the script prints what it saw.
_PRELUDE = textwrap.dedent(
    """
    import logging, os, sys, threading, time
    from sdkcore import ThresholdReporter

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.reports = []
            self.arrived = threading.Event()

        def emit(self, record):
            fields = getattr(record, "sdkcore", {})
            if fields.get("event") == "threshold.report":
                self.reports.append(fields["report"])
                self.arrived.set()

    records = Records()
    logger = logging.getLogger("sdkcore")
    logger.addHandler(records)
    logger.setLevel(logging.WARNING)
    """
)


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_forked_child_reports_the_interval_it_inherited() -> None:
    """The parent's timer thread does not exist in a child (and its lock may be held): the
    child's pending interval would never be reported. The fork handler starts a thread
    of the child's own, and the parent's keeps working."""
    result = _run(
        """
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with a thread running
        reporter = ThresholdReporter(emit_interval=0.3)
        reporter.record("kv", "get", 2.0)  # opens an interval: the timer has its entry
        pid = os.fork()
        if pid == 0:
            got = records.arrived.wait(10)
            os._exit(0 if got and '"total_count":1' in records.reports[0] else 3)
        got = records.arrived.wait(10)
        _, status = os.waitpid(pid, 0)
        print("parent", got, "child", os.waitstatus_to_exitcode(status))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["parent", "True", "child", "0"], result.stderr


def test_no_thread_leaves_reports_to_records_and_flush_then_tries_again() -> None:
    """``threading.Thread.start`` fails (a process at its thread limit): recording does not
    raise, the report is taken by ``flush()`` (as on an injected clock), and a later
    interval starts the thread once threads can start again."""
    result = _run(
        """
        start = threading.Thread.start

        def refuse(self):
            raise RuntimeError("can't start new thread")

        threading.Thread.start = refuse
        reporter = ThresholdReporter(emit_interval=0.05)
        reporter.record("kv", "get", 2.0)  # no timer thread: nothing raised
        time.sleep(0.2)
        timerless = not records.arrived.is_set()
        reporter.flush()  # the interval is over: logged now
        flushed = len(records.reports) == 1
        threading.Thread.start = start
        reporter.record("kv", "get", 2.0)  # a new interval: the thread starts now
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(records.reports) < 2:
            time.sleep(0.01)
        threads = sum(t.name == "sdkcore-report" for t in threading.enumerate())
        print(timerless, flushed, len(records.reports), threads)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "2", "1"], result.stderr
