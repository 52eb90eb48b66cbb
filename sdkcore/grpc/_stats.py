"""A6 "Retry and Hedging Statistics": per-method retry counters and histogram."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from .._untrusted import show as _show

__all__ = ["HISTOGRAM_BUCKETS", "MethodRetryStats", "RetryStats"]

#: Lower bounds of the A6 histogram buckets (">=1", ">=2", ..., ">=1000").
HISTOGRAM_BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 5, 10, 100, 1000)

# A repr lists this many methods, then says how many more there are.
_REPR_METHODS = 8


def _bad_retry_number(retry_number: object) -> None:
    """Raise for a ``retry_number`` that is not an int >= 1 (an int subclass >= 1 passes)."""
    if isinstance(retry_number, bool) or not isinstance(retry_number, int):
        raise TypeError(
            f"RetryStats.record_retry(retry_number) must be an int >= 1 (1 for the first "
            f"retry), got {_show(retry_number)} ({type(retry_number).__name__})"
        )
    if retry_number < 1:
        raise ValueError(f"retry_number must be >= 1, got {_show(retry_number)}")


def _bad_method(method: object, what: str) -> TypeError:
    return TypeError(
        f'{what} must be a str, the full method name ("/pkg.Service/Method"), got {_show(method)}'
    )


def bucket_of(retry_number: int) -> int:
    """The bucket (its lower bound) the ``retry_number``-th retry (1-based) is counted in."""
    if type(retry_number) is not int or retry_number < 1:
        _bad_retry_number(retry_number)
    if retry_number >= 1000:
        return 1000
    if retry_number >= 100:
        return 100
    if retry_number >= 10:
        return 10
    if retry_number >= 5:
        return 5
    return retry_number


@attrs.frozen(slots=True)
class MethodRetryStats:
    """A snapshot of one method's counters."""

    #: Retry attempts started (the original attempt and transparent retries excluded).
    retry_attempts: int = 0
    #: Retry attempts that ended with a non-OK status.
    failed_retry_attempts: int = 0
    #: Transparent retries (A6 "Transparent Retries"; not counted above).
    transparent_retries: int = 0
    #: Retry attempts per histogram bucket, keyed by the bucket's lower bound.
    histogram: Mapping[int, int] = attrs.field(
        factory=lambda: MappingProxyType(dict.fromkeys(HISTOGRAM_BUCKETS, 0))
    )

    def __repr__(self) -> str:
        used = {bucket: n for bucket, n in self.histogram.items() if n}
        return (
            f"MethodRetryStats(retry_attempts={self.retry_attempts}, "
            f"failed_retry_attempts={self.failed_retry_attempts}, "
            f"transparent_retries={self.transparent_retries}, histogram={used})"
        )


#: Methods counted apart; the ones past it are counted as :data:`OTHER` (a channel of a
#: gateway that calls thousands of generic methods grew by one entry per method).
MAX_METHODS = 10_000
OTHER = "other"


class _Counters:
    __slots__ = ("failed", "hist", "retries", "transparent")

    def __init__(self) -> None:
        self.retries = 0
        self.failed = 0
        self.transparent = 0
        self.hist = dict.fromkeys(HISTOGRAM_BUCKETS, 0)


class RetryStats:
    """Per-method retry statistics for one or more channels.

    Read with :meth:`for_method` / :meth:`snapshot`. At most ``MAX_METHODS`` (10,000)
    methods are counted apart; the ones after are counted together as ``"other"``. For
    OpenTelemetry, give the
    channel a telemetry instead (``insecure_channel(..., telemetry=sdkcore.Telemetry())``):
    it records gRPC's standard A66/A96 metrics (rfc/0008).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._methods: dict[str, _Counters] = {}

    def _get(self, method: str, what: str) -> _Counters:
        # Checked only for a method not seen yet: a counted one is a str already.
        try:
            c = self._methods.get(method)
        except TypeError:  # unhashable
            raise _bad_method(method, what) from None
        if c is None:
            if not isinstance(method, str):
                raise _bad_method(method, what)
            if len(self._methods) >= MAX_METHODS:  # bounded: the methods past it as one
                method = OTHER
            c = self._methods.setdefault(method, _Counters())
        return c

    def record_retry(self, method: str, retry_number: int) -> None:
        """The ``retry_number``-th retry attempt (1-based) of one call was started.

        ``method`` is a str and ``retry_number`` an int >= 1 (TypeError / ValueError
        naming it otherwise; nothing is counted then).
        """
        bucket = bucket_of(retry_number)
        with self._lock:
            c = self._get(method, "RetryStats.record_retry(method)")
            c.retries += 1
            c.hist[bucket] += 1

    def record_failed_retry(self, method: str) -> None:
        """A retry attempt ended with a non-OK status."""
        with self._lock:
            self._get(method, "RetryStats.record_failed_retry(method)").failed += 1

    def record_transparent_retry(self, method: str) -> None:
        with self._lock:
            self._get(method, "RetryStats.record_transparent_retry(method)").transparent += 1

    def for_method(self, method: str) -> MethodRetryStats:
        """A snapshot for ``"/pkg.Service/Method"`` (all zero if never seen)."""
        with self._lock:
            try:
                c = self._methods.get(method)
            except TypeError:  # unhashable
                raise _bad_method(method, "RetryStats.for_method(method)") from None
            if c is None:
                if not isinstance(method, str):
                    raise _bad_method(method, "RetryStats.for_method(method)")
                return MethodRetryStats()
            return MethodRetryStats(
                c.retries, c.failed, c.transparent, MappingProxyType(dict(c.hist))
            )

    def snapshot(self) -> dict[str, MethodRetryStats]:
        """Snapshots of every method seen so far."""
        with self._lock:
            names = list(self._methods)
        return {name: self.for_method(name) for name in names}

    def __repr__(self) -> str:
        with self._lock:
            items = [
                (name, c.retries, c.failed, c.transparent) for name, c in self._methods.items()
            ]
        shown = "; ".join(
            f"{name}: retries={retries} failed={failed} transparent={transparent}"
            for name, retries, failed, transparent in items[:_REPR_METHODS]
        )
        more = len(items) - _REPR_METHODS
        tail = f" ... and {more} more" if more > 0 else ""
        return f"<RetryStats methods={len(items)}{' ' if shown else ''}{shown}{tail}>"

    def export_to_opentelemetry(self, meter: Any = None) -> None:
        """Removed: its ``grpc.client.retry.*`` counters matched no standard.

        Raises AttributeError saying what replaces it: a channel made with
        ``telemetry=sdkcore.Telemetry(meter_provider=...)`` records gRPC's standard
        metrics (A66, A96) for every call and attempt (rfc/0008).
        """
        raise AttributeError(
            "RetryStats.export_to_opentelemetry() was removed: its grpc.client.retry.* "
            "counters matched no standard. Give the channel an sdkcore.Telemetry instead: "
            "sdkcore.grpc.insecure_channel(target, ..., telemetry=sdkcore.Telemetry("
            "meter_provider=provider)) records gRPC's A66/A96 metrics "
            "(grpc.client.attempt.started, grpc.client.call.retries, "
            "grpc.client.call.transparent_retries, ...; rfc/0008)"
        )
