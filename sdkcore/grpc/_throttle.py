"""A6 retry throttling: a token bucket per server name, in exact milli-tokens."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from decimal import Decimal

from .. import _log
from .._untrusted import show as _show
from ._target import server_name

__all__ = ["RetryThrottler", "throttler_for_target"]


class RetryThrottler:
    """The A6 token bucket ("Throttling Retry Attempts and Hedged RPCs").

    Counts in thousandths of a token, as grpc C-core does, so ``tokenRatio``
    values like 0.1 add up exactly. Starts full; a failure removes one token
    (never below zero), a success adds ``token_ratio`` (never above
    ``max_tokens``); retries are allowed while the count is strictly above
    ``max_tokens / 2``.

    Thread-safe. When the service config for a target changes, the new
    throttler takes over the old one's fill ratio and the old one forwards to
    it (grpc C-core's replacement rule), so calls still holding the old one
    keep counting in the same bucket.

    Logs ``throttle.engaged`` (warning) when a failure brings the count to the
    threshold or below, and ``throttle.released`` (info) when a success lifts it
    above again, with ``refused``: the retries and hedges refused in between
    (fields ``target``, ``tokens``, ``max_tokens``, ``threshold``; rfc/0003).
    """

    __slots__ = (
        "__weakref__",
        "_engaged",
        "_engaged_at",
        "_lock",
        "_max",
        "_milli",
        "_ratio",
        "_refused",
        "_replaced_by",
        "_target",
    )

    def __init__(
        self, max_tokens: int | float, token_ratio: float, *, replaces: RetryThrottler | None = None
    ) -> None:
        if replaces is not None and not isinstance(replaces, RetryThrottler):
            raise TypeError(
                f"RetryThrottler(replaces=...) must be a RetryThrottler or None, got {replaces!r}"
            )
        max_milli, ratio_milli = _checked(max_tokens, token_ratio)
        self._lock = threading.Lock()
        self._max = max_milli
        self._ratio = ratio_milli
        self._replaced_by: RetryThrottler | None = None
        #: The server name it throttles (set by throttler_for_target), for its events.
        self._target = ""
        #: True from throttle.engaged to throttle.released.
        self._engaged = False
        #: Retries and hedges refused since it was made, and that count at engagement.
        self._refused = 0
        self._engaged_at = 0
        if replaces is None:
            self._milli = max_milli
        else:
            old = replaces._current()
            with old._lock:
                # Keep the same fill fraction in the new bucket.
                self._milli = old._milli * max_milli // old._max
                # ... and the episode it is in: its release is logged by this bucket.
                self._target = old._target
                self._engaged = old._engaged
                self._refused = old._refused
                self._engaged_at = old._engaged_at
                old._replaced_by = self

    def _current(self) -> RetryThrottler:
        t = self
        while t._replaced_by is not None:
            t = t._replaced_by
        return t

    @property
    def max_tokens(self) -> float:
        return self._max / 1000

    @property
    def token_ratio(self) -> float:
        return self._ratio / 1000

    @property
    def tokens(self) -> float:
        """The current token count (of the newest bucket when this one was replaced)."""
        return self._current()._milli / 1000

    @property
    def milli_tokens(self) -> int:
        return self._current()._milli

    @property
    def refused(self) -> int:
        """Retries and hedges refused since it was made (a counter; see :meth:`note_refusal`)."""
        return self._current()._refused

    @property
    def engaged(self) -> bool:
        """True while it refuses (from ``throttle.engaged`` to ``throttle.released``)."""
        return self._current()._engaged

    def record_failure(self) -> bool:
        """Take one token; True when retries are still allowed afterwards."""
        t = self._current()
        with t._lock:
            milli = t._milli - 1000
            if milli < 0:
                milli = 0
            t._milli = milli
            allowed = milli * 2 > t._max
            if allowed or t._engaged:
                return allowed
            t._engaged = True
            t._engaged_at = t._refused
        t._event(_log.EVENT_THROTTLE_ENGAGED, milli, None)
        return False

    def record_success(self) -> None:
        """Add ``token_ratio`` tokens (capped at ``max_tokens``)."""
        t = self._current()
        with t._lock:
            milli = t._milli + t._ratio
            milli = t._max if milli > t._max else milli
            t._milli = milli
            if not t._engaged or milli * 2 <= t._max:
                return
            t._engaged = False
            refused = t._refused - t._engaged_at
        t._event(_log.EVENT_THROTTLE_RELEASED, milli, refused)

    def allows_retry(self) -> bool:
        """True while the count is above the threshold (``max_tokens / 2``).

        The gate of a retry or hedge: a False answer counts as one refused (:attr:`refused`).
        """
        t = self._current()
        if t._milli * 2 > t._max:
            return True
        with t._lock:
            t._refused += 1
        return False

    def note_refusal(self) -> None:
        """Count a retry refused because :meth:`record_failure` answered False."""
        t = self._current()
        with t._lock:
            t._refused += 1

    def _event(self, event: str, milli: int, refused: int | None) -> None:
        # engaged (retries stop) starts an episode: a warning; released ends it: info.
        engaged = refused is None
        log = _log.enabled(_log.WARNING if engaged else _log.INFO)
        if log is None:
            return
        fields: dict[str, object] = {
            "target": self._target,
            "tokens": milli / 1000,
            "max_tokens": self._max / 1000,
            "threshold": self._max / 2000,
        }
        if engaged:
            log.warning(event, **fields)
        else:
            fields["refused"] = refused
            log.info(event, **fields)

    def __repr__(self) -> str:
        return (
            f"RetryThrottler(max_tokens={self.max_tokens}, token_ratio={self.token_ratio}, "
            f"tokens={self.tokens})"
        )


#: The largest token_ratio: a success then refills any bucket (max_tokens <= 1000).
_MAX_RATIO = 10**6


def _checked(max_tokens: object, token_ratio: object) -> tuple[int, int]:
    """(max_tokens, token_ratio) in thousandths, or TypeError / ValueError naming the field."""
    out = []
    for name, value, allowed in (
        ("max_tokens", max_tokens, "in (0, 1000]"),
        ("token_ratio", token_ratio, f"in [0.001, {_MAX_RATIO}] (3 decimals are used)"),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"RetryThrottler({name}) must be a number {allowed}, got {_show(value)} "
                f"({type(value).__name__})"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"RetryThrottler({name}) must be a finite number {allowed}, got {value!r}"
            )
        if not -_MAX_RATIO <= value <= _MAX_RATIO:
            raise ValueError(f"RetryThrottler({name}) must be {allowed}, got a number too large")
        out.append(_to_milli(value))
    max_milli, ratio_milli = out
    if not 0 < max_milli <= 1_000_000:
        raise ValueError(f"RetryThrottler(max_tokens) must be in (0, 1000], got {max_tokens!r}")
    if ratio_milli <= 0:
        raise ValueError(
            "RetryThrottler(token_ratio) must be >= 0.001 (3 decimals are used), "
            f"got {token_ratio!r}"
        )
    return max_milli, ratio_milli


def _to_milli(value: float) -> int:
    """Thousandths, truncated, decided on the number's decimal text (0.5466 -> 546)."""
    return int(Decimal(repr(value)) * 1000)


_registry: weakref.WeakValueDictionary[str, RetryThrottler] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def throttler_for_target(
    target: str, max_tokens: int | float, token_ratio: float
) -> RetryThrottler:
    """The process-wide throttler for ``target`` (one per server name: the target's
    spellings of one server share it, :func:`sdkcore.grpc._target.server_name`).

    Channels to the same target with the same settings share one bucket; new
    settings replace it (see :class:`RetryThrottler`). A bucket lives as long as
    some channel uses it.
    """
    return _acquire(target, max_tokens, token_ratio)[0]


def _acquire(
    target: str, max_tokens: int | float, token_ratio: float
) -> tuple[RetryThrottler, Callable[[], None]]:
    """:func:`throttler_for_target` plus an undo for a channel that is then not created.

    The undo puts back the bucket the new one replaced (or forgets the target);
    it does nothing when the bucket was shared or has been replaced since.
    """
    if not isinstance(target, str):
        raise TypeError(f"throttler_for_target(target) must be a str, got {target!r}")
    max_milli, ratio_milli = _checked(max_tokens, token_ratio)
    # One bucket per server name (A6), whatever the target's spelling: 127.0.0.1:50051,
    # dns:///127.0.0.1:50051 and ipv4:127.0.0.1:50051 are one server (grpc C-core's key).
    key = server_name(target)
    with _registry_lock:
        old = _registry.get(key)
        cur = None if old is None else old._current()
        if cur is not None and cur._max == max_milli and cur._ratio == ratio_milli:
            return cur, _nothing
        # Built before anything is changed: a bad max_tokens / token_ratio raises here.
        new = RetryThrottler(max_tokens, token_ratio, replaces=cur)
        new._target = target
        _registry[key] = new

    def undo() -> None:
        with _registry_lock:
            if _registry.get(key) is not new or new._replaced_by is not None:
                return
            if cur is None:
                del _registry[key]
                return
            with cur._lock:
                cur._replaced_by = None
            _registry[key] = cur

    return new, undo


def _nothing() -> None:
    return None
