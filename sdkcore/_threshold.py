"""Threshold request logging: the slowest requests of each service, logged every interval.

Couchbase SDK RFC 67 ("Extended SDK Observability"), "ThresholdLoggingTracer": a
request slower than its service's threshold is counted, the ``sample_size`` slowest
of each service are kept, and every ``emit_interval`` one line of JSON in the RFC's
shape is logged (warning ``threshold.report``). See rfc/0008.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._duration import to_seconds
from ._log import EVENT_THRESHOLD_REPORT
from ._sample import Sample, details, total_micros

__all__ = ["EVENT_THRESHOLD_REPORT", "ThresholdReporter"]


_NAMED = ("kv", "query", "views", "search", "analytics")


class ThresholdReporter:
    """Counts the requests slower than their service's threshold; logs the slowest per interval.

    Call :meth:`record` once per finished request (success or failure), with how long
    it took in seconds. A request at or over its service's threshold is counted, and
    kept if it is among the ``sample_size`` slowest of its service in the current
    interval. Once ``emit_interval`` has passed since the first such request, the next
    :meth:`record` logs the report (or call :meth:`flush`): a warning
    ``threshold.report`` whose ``report`` field is one line of JSON::

        {"kv":{"total_count":12,"top_requests":[{"total_duration_us":1200000,
        "operation_name":"get","operation_id":"0x23","last_remote_socket":"10.0.0.1:11210",
        "timeout_ms":2500}, ...]}}

    Nothing is logged for an interval with no slow request. A report is logged by the
    next record at or after its interval's end (any record, fast or slow, once one is
    pending), by :meth:`flush`, or, on the real clock, by the process's report thread
    at the interval's end (one daemon thread for every reporter, holding none alive).

    Thresholds (a ``timedelta`` or seconds, >= 0): ``kv_threshold`` 500 ms; the
    ``query``, ``views``, ``search`` and ``analytics`` ones default to
    ``default_threshold`` (1 s), which every other service name uses (``management``,
    ``eventing``, ``transactions``, or an application's own).

    Thread-safe and loop-agnostic. A request under its threshold costs a dict lookup
    and three comparisons; a slow one O(log sample_size) under a lock.
    """

    __slots__ = ("_default", "_sample", "_thresholds")

    def __init__(
        self,
        *,
        kv_threshold: timedelta | float = timedelta(milliseconds=500),
        query_threshold: timedelta | float | None = None,
        views_threshold: timedelta | float | None = None,
        search_threshold: timedelta | float | None = None,
        analytics_threshold: timedelta | float | None = None,
        default_threshold: timedelta | float = timedelta(seconds=1),
        sample_size: int = 10,
        emit_interval: timedelta | float = timedelta(seconds=10),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        what = "ThresholdReporter"
        default = to_seconds(default_threshold, f"{what}(default_threshold)")
        given = (kv_threshold, query_threshold, views_threshold, search_threshold)
        thresholds: dict[str, float] = {}
        for service, value in zip(_NAMED, (*given, analytics_threshold), strict=True):
            field = f"{what}({service}_threshold)"
            thresholds[service] = default if value is None else to_seconds(value, field)
        self._thresholds = thresholds
        self._default = default
        self._sample = Sample(EVENT_THRESHOLD_REPORT, what, sample_size, emit_interval, clock)

    def threshold(self, service: str) -> timedelta:
        """The threshold of ``service`` (``default_threshold`` for a service not named)."""
        if not isinstance(service, str):
            raise TypeError(f"ThresholdReporter.threshold(service) must be a str, got {service!r}")
        return timedelta(seconds=self._thresholds.get(service, self._default))

    @property
    def sample_size(self) -> int:
        return self._sample.sample_size

    @property
    def emit_interval(self) -> timedelta:
        return timedelta(seconds=self._sample.emit_interval)

    def record(
        self,
        service: str,
        operation_name: str,
        duration: float,
        *,
        operation_id: str | None = None,
        timeout: float | None = None,
        last_remote_socket: str | None = None,
        last_local_socket: str | None = None,
        last_local_id: str | None = None,
        encode_duration: float | None = None,
        last_dispatch_duration: float | None = None,
        total_dispatch_duration: float | None = None,
        last_server_duration: float | None = None,
        total_server_duration: float | None = None,
    ) -> None:
        """One finished request of ``service`` that took ``duration`` seconds (its total).

        The keywords are the RFC's optional fields, each left out of the report when
        None: durations and ``timeout`` in seconds (reported in µs, the timeout in
        ms), the others strings (sockets as ``"host:port"``, a KV opaque as
        ``"0x23"``). See rfc/0008 for what each one holds.
        """
        threshold = self._thresholds.get(service, self._default)
        try:
            # A fast record of the usual types: the rest is checked below, fast or not.
            fast = (
                0.0 <= duration < threshold and type(service) is str and type(duration) is not bool
            )
        except TypeError:
            fast = False  # not a number: total_micros says what is wrong
        if not fast:
            if not isinstance(service, str):
                raise TypeError(f"ThresholdReporter.record(service) must be a str, got {service!r}")
            what = "ThresholdReporter.record"
            total_us = total_micros(duration, what)  # refuses what is not seconds >= 0
            fast = duration < threshold  # e.g. a service given as a str subclass
        if fast:
            if self._sample.due != math.inf:  # a report is pending: it may be due
                self._sample.poll()
            return
        fields = details(
            what,
            operation_name,
            encode_duration,
            last_dispatch_duration,
            total_dispatch_duration,
            last_server_duration,
            total_server_duration,
            last_local_id,
            operation_id,
            last_local_socket,
            last_remote_socket,
            timeout,
        )
        self._sample.add(service, total_us, fields)

    def report(self) -> dict[str, Any] | None:
        """The pending report (RFC 67's shape, as a dict), left pending; None if empty."""
        return self._sample.peek()

    def flush(self) -> dict[str, Any] | None:
        """Log the pending report now and start a new interval; returns it (None: nothing)."""
        return self._sample.flush()

    def __repr__(self) -> str:
        kv = self._thresholds["kv"]
        return (
            f"<ThresholdReporter kv={kv * 1000:g}ms default={self._default * 1000:g}ms "
            f"sample_size={self.sample_size} emit_interval={self._sample.emit_interval:g}s>"
        )
