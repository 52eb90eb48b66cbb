"""The slowest requests per service, kept for one interval and logged as one JSON line (rfc/0008).

The common part of :class:`~sdkcore.ThresholdReporter` and
:class:`~sdkcore.OrphanReporter` (Couchbase SDK RFC 67): per service, a count and a
min-heap of at most ``sample_size`` entries keyed by their total duration, so a new
entry costs O(log sample_size) and one slower than none of the kept ones costs one
comparison. The report of an interval is emitted by the first record at or after its
end (or by ``flush()``), and, on the real clock, by one daemon thread for the process
(:class:`_Timer`, started by the first interval that opens) at the interval's end: a
burst followed by silence is reported on time, as RFC 67's worker does.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from . import _log
from ._callables import sync_callable
from ._duration import MAX_SECONDS, to_seconds
from ._untrusted import show

__all__ = [
    "MAX_SERVICES",
    "MAX_TEXT",
    "OTHER_SERVICE",
    "Details",
    "Sample",
    "details",
    "positive_int",
]

#: Distinct services kept per interval; records for more are counted under OTHER_SERVICE.
MAX_SERVICES = 64
OTHER_SERVICE = "other"
#: Texts (service, operation name, ids, sockets) are cut at this many characters, as
#: sdkcore.Telemetry cuts its attribute values.
MAX_TEXT = 100

# An entry's fields after total_duration_us, in the order of RFC 67's example; a field
# whose value is None is left out of the entry, as the RFC asks.
_FIELDS = (
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
)

#: The values of _FIELDS for one record, already in the report's units (ints, strs).
Details = tuple[Any, ...]
# (total_duration_us, -sequence, details): the heap's smallest is the fastest kept, the
# newest among equals, so ties keep the earliest records.
_Entry = tuple[int, int, Details]


_MAX_INT = 2**31 - 1  # past any sample a process could hold: a bigger one is a typo


def positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 1, got {show(value)} ({type(value).__name__})")
    if not 1 <= value <= _MAX_INT:
        raise ValueError(f"{what} must be an int >= 1 (at most {_MAX_INT}), got {show(value)}")
    return int(value)


def _micros(value: object, what: str) -> int | None:
    """Seconds (int or float, finite, >= 0) as whole microseconds; None stays None."""
    if value is None:
        return None
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, int)):
        hint = " (use .total_seconds())" if isinstance(value, timedelta) else ""
        raise TypeError(
            f"{what} must be a number of seconds (int or float){hint}, "
            f"got {show(value)} ({type(value).__name__})"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int past what a float holds
        seconds = math.inf
    if not 0.0 <= seconds <= MAX_SECONDS:  # also NaN; past it, whole µs overflow
        raise ValueError(
            f"{what} must be a finite number of seconds >= 0 (at most {MAX_SECONDS:.0f}, what "
            f"a timedelta holds), got {show(value)}"
        )
    return round(seconds * 1_000_000)


def _text(value: object, what: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT]
    raise TypeError(f"{what} must be a str or None, got {show(value)} ({type(value).__name__})")


def details(
    what: str,
    operation_name: object,
    encode_duration: object,
    last_dispatch_duration: object,
    total_dispatch_duration: object,
    last_server_duration: object,
    total_server_duration: object,
    last_local_id: object,
    operation_id: object,
    last_local_socket: object,
    last_remote_socket: object,
    timeout: object,
) -> Details:
    """One record's fields, checked and converted (seconds to µs, the timeout to ms)."""
    if not isinstance(operation_name, str):
        raise TypeError(
            f"{what}(operation_name) must be a str, got {show(operation_name)} "
            f"({type(operation_name).__name__})"
        )
    if len(operation_name) > MAX_TEXT:
        operation_name = operation_name[:MAX_TEXT]
    timeout_us = _micros(timeout, f"{what}(timeout)")
    return (
        _micros(encode_duration, f"{what}(encode_duration)"),
        _micros(last_dispatch_duration, f"{what}(last_dispatch_duration)"),
        _micros(total_dispatch_duration, f"{what}(total_dispatch_duration)"),
        _micros(last_server_duration, f"{what}(last_server_duration)"),
        _micros(total_server_duration, f"{what}(total_server_duration)"),
        operation_name,
        _text(last_local_id, f"{what}(last_local_id)"),
        _text(operation_id, f"{what}(operation_id)"),
        _text(last_local_socket, f"{what}(last_local_socket)"),
        _text(last_remote_socket, f"{what}(last_remote_socket)"),
        None if timeout_us is None else timeout_us // 1000,
    )


def total_micros(duration: object, what: str) -> int:
    micros = _micros(duration, f"{what}(duration)")
    if micros is None:
        raise TypeError(f"{what}(duration) must be a number of seconds (int or float), got None")
    return micros


class Sample:
    """Per service: how many records, and the ``size`` slowest; one report per interval.

    Thread-safe (one lock, held for a few dict and heap operations; the report is
    built and logged outside it). ``due`` is when the pending report is due on
    ``clock`` (``math.inf``: nothing pending): the threshold reporter's fast path
    reads it without the lock.
    """

    __slots__ = (
        "__weakref__",  # the report timer holds reporters weakly
        "_armed",
        "_clock",
        "_counts",
        "_event",
        "_heaps",
        "_interval",
        "_lock",
        "_seq",
        "_size",
        "_timed",
        "due",
    )

    def __init__(
        self,
        event: str,
        what: str,
        sample_size: object,
        emit_interval: object,
        clock: object,
    ) -> None:
        self._event = event
        self._size = positive_int(sample_size, f"{what}(sample_size)")
        self._interval = to_seconds(emit_interval, f"{what}(emit_interval)", allow_zero=False)
        sync_callable(clock, f"{what}(clock)", "() -> seconds")
        self._clock: Callable[[], float] = clock  # type: ignore[assignment]
        # On the real clock a timer logs each report at its interval's end; an injected
        # clock (a test's) is moved by its owner, and reports wait for a record or flush().
        self._timed = clock is time.monotonic
        self._armed = False  # the report timer has an entry for it (one at most)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._heaps: dict[str, list[_Entry]] = {}
        self._counts: dict[str, int] = {}
        self.due = math.inf

    @property
    def sample_size(self) -> int:
        return self._size

    @property
    def emit_interval(self) -> float:
        return self._interval

    def add(self, service: str, total_us: int, fields: Details) -> None:
        """Count one record of ``service``; keep it if it is among the ``size`` slowest."""
        now = self._clock()
        taken = None
        with self._lock:
            if now >= self.due:  # the interval is over: its report goes first
                taken = self._take()
            # this record opens an interval: the timer is told, unless it has an entry already
            arm = self._timed and self.due == math.inf and not self._armed
            if arm:
                self._armed = True
            if now < self.due - self._interval:  # the clock stepped back (or none is open)
                self.due = now + self._interval
            heaps = self._heaps
            heap = heaps.get(service)
            if heap is None:
                if len(service) > MAX_TEXT:
                    service = service[:MAX_TEXT]
                if len(heaps) >= MAX_SERVICES and service not in heaps:
                    service = OTHER_SERVICE
                heap = heaps.get(service)
                if heap is None:
                    heap = heaps[service] = []
                    self._counts[service] = 0
            self._counts[service] += 1
            if len(heap) < self._size:
                heapq.heappush(heap, (total_us, -next(self._seq), fields))
            elif total_us > heap[0][0]:
                heapq.heapreplace(heap, (total_us, -next(self._seq), fields))
        if taken is not None:
            self._emit(taken)
        if arm:
            _TIMER.schedule(now + self._interval, self)

    def _timer_fired(self) -> float | None:
        """The timer's entry came due: report if the interval is over. Returns when to
        come back (an interval opened since), or None: nothing pending, entry dropped."""
        with contextlib.suppress(Exception):  # a record or flush() reports it later
            self.poll()
        with self._lock:
            if self.due == math.inf:
                self._armed = False
                return None
            return self.due

    def poll(self) -> None:
        """Emit the pending report if its interval is over (a record that kept nothing)."""
        now = self._clock()
        if now >= self.due:
            with self._lock:
                taken = self._take() if now >= self.due else None
            if taken is not None:
                self._emit(taken)

    def peek(self) -> dict[str, Any] | None:
        """The pending report, left pending (None: nothing recorded)."""
        with self._lock:
            state = {s: (self._counts[s], list(h)) for s, h in self._heaps.items()}
        return _report(state) if state else None

    def flush(self) -> dict[str, Any] | None:
        """Take the pending report now and log it; None (and nothing logged) if empty."""
        with self._lock:
            taken = self._take()
        if taken is None:
            return None
        report = _report(taken)
        self._log(report)
        return report

    # -- under the lock ---------------------------------------------------------------
    def _take(self) -> dict[str, tuple[int, list[_Entry]]] | None:
        heaps, counts = self._heaps, self._counts
        self.due = math.inf
        if not heaps:
            return None
        self._heaps, self._counts = {}, {}
        return {service: (counts[service], heap) for service, heap in heaps.items()}

    # -- outside the lock ---------------------------------------------------------------
    def _emit(self, taken: dict[str, tuple[int, list[_Entry]]]) -> None:
        if _log.enabled(_log.WARNING) is not None:  # built only for a logger that wants it
            self._log(_report(taken))

    def _log(self, report: dict[str, Any]) -> None:
        log = _log.enabled(_log.WARNING)
        if log is not None:
            log.warning(self._event, report=_line(report), emit_interval_s=self._interval)


class _Timer:
    """The one thread that logs reports at their interval's end (real clock only).

    A heap of (due, seq, reporter held weakly), at most one entry per reporter (moved to
    its next interval when that opened before the entry came due): a reporter that is
    gone is skipped when its entry comes due, and the thread holds none alive. Started by
    the first interval that opens (a thread start is about 0.1 ms, once per process); a
    daemon, so it never holds the process open; a wait is capped at an hour, so any
    ``emit_interval`` is waited out in steps. A thread that cannot be started leaves
    reports to records and ``flush()``, as on an injected clock. A forked child starts
    its own for what it inherited.
    """

    _MAX_WAIT = 3600.0

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, weakref.ref[Sample]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, due: float, sample: Sample) -> None:
        """Have ``sample`` polled once ``time.monotonic()`` reaches ``due``."""
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), weakref.ref(sample)))
            if self._thread is None:
                if not self._start():  # no thread can be started now: the next interval tries
                    self._heap.clear()  # this entry only: none is pushed without a thread
                    sample._armed = False
            elif self._heap[0][0] == due:
                self._cond.notify()  # the earliest now: the thread waits for a later one

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due = self._heap[0][0]
                    left = due - time.monotonic()
                    if left <= 0.0:
                        ref = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(min(left, self._MAX_WAIT))
            sample = ref()
            if sample is not None:
                again = sample._timer_fired()
                if again is not None:  # a later interval is pending: one entry, moved
                    self.schedule(again, sample)
            del sample, ref  # hold nothing while waiting

    def _forked(self) -> None:
        """In a forked child: the parent's thread is not there, and its lock may be held.
        The child times what it inherited with a thread of its own."""
        self._cond = threading.Condition(threading.Lock())
        self._thread = None
        if self._heap:
            self._start()

    def _start(self) -> bool:
        """Start the thread (under the condition's lock, or in a forked child); False when
        none can be started."""
        thread = threading.Thread(target=self._run, name="sdkcore-report", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            return False
        self._thread = thread
        return True


_TIMER = _Timer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_TIMER._forked)


def _line(report: dict[str, Any]) -> str:
    """The report as one line of compact JSON (RFC 67: non-pretty)."""
    # Imported here: ``import sdkcore`` loads no json (tests/test_first_call.py). A report
    # is built after its requests ended, never on a request's clock.
    import json

    return json.dumps(report, separators=(",", ":"))


def _report(taken: dict[str, tuple[int, list[_Entry]]]) -> dict[str, Any]:
    """RFC 67's shape: ``{service: {"total_count": n, "top_requests": [entry, ...]}}``.

    Services in name order; entries slowest first (equal durations: earliest first).
    """
    report: dict[str, Any] = {}
    for service in sorted(taken):
        count, heap = taken[service]
        top = []
        for total_us, _, fields in sorted(heap, reverse=True):
            entry: dict[str, Any] = {"total_duration_us": total_us}
            for name, value in zip(_FIELDS, fields, strict=True):
                if value is not None:
                    entry[name] = value
            top.append(entry)
        report[service] = {"total_count": count, "top_requests": top}
    return report
