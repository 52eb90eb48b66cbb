"""Orphaned response reporting: answers that arrived after their request ended.

Couchbase SDK RFC 67 ("Extended SDK Observability"), "Orphaned Response Reporting":
when a response comes in for a request that timed out or was cancelled, the client
records it here; every ``emit_interval`` the ``sample_size`` slowest per service are
logged as one line of JSON in the RFC's shape (warning ``orphan.report``). See
rfc/0008.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._log import EVENT_ORPHAN_REPORT
from ._sample import Sample, details, total_micros

__all__ = ["EVENT_ORPHAN_REPORT", "OrphanReporter"]


class OrphanReporter:
    """Counts responses that arrived after their request ended; logs the slowest per interval.

    A client calls :meth:`record` when it reads a response whose request is no longer
    waiting for it (it timed out, or was cancelled): e.g. a KV response whose opaque
    belongs to an attempt that was cut. Every orphan is counted; the ``sample_size``
    slowest (by ``duration``) of each service in the current interval are kept. Once
    ``emit_interval`` has passed since the first orphan, the next :meth:`record` logs
    the report (or call :meth:`flush`): a warning ``orphan.report`` whose ``report``
    field is one line of JSON::

        {"kv":{"total_count":1,"top_requests":[{"total_duration_us":2004113,
        "last_dispatch_duration_us":1500220,"operation_name":"get","operation_id":"0x2",
        "last_local_socket":"127.0.0.1:50412","last_remote_socket":"127.0.0.1:11211",
        "timeout_ms":1500}]}}

    Nothing is logged for an interval without orphans. On the real clock the process's
    report thread logs the report at its interval's end if no record did (one daemon
    thread for every reporter, holding none alive); on an injected clock only records
    and :meth:`flush` do.
    Thread-safe and loop-agnostic; a record costs O(log sample_size) under a lock.
    ``clock``: monotonic seconds (default ``time.monotonic``; a test's virtual clock).
    """

    __slots__ = ("_sample",)

    def __init__(
        self,
        *,
        sample_size: int = 10,
        emit_interval: timedelta | float = timedelta(seconds=10),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sample = Sample(
            EVENT_ORPHAN_REPORT, "OrphanReporter", sample_size, emit_interval, clock
        )

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
        """One orphaned response of ``service``; ``duration`` (seconds) orders the sample.

        ``duration`` is reported as ``total_duration_us``: how long the request took
        until this response arrived (the memcached example: from the write of its frame
        to the late response). The keywords are the RFC's optional fields, as in
        :meth:`ThresholdReporter.record <sdkcore.ThresholdReporter.record>`.
        """
        if not isinstance(service, str):
            raise TypeError(f"OrphanReporter.record(service) must be a str, got {service!r}")
        what = "OrphanReporter.record"
        total_us = total_micros(duration, what)
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
        return (
            f"<OrphanReporter sample_size={self.sample_size} "
            f"emit_interval={self._sample.emit_interval:g}s>"
        )
