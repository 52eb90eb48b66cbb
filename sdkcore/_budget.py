"""A retry budget shared by every request: retries stay a fraction of first attempts.

Finagle's ``RetryBudget`` (a leaky token bucket over twitter/util's windowed
adder), with its bounds and its integer arithmetic: a withdrawal costs
``1000 / retry_ratio`` tokens (truncated), a deposit adds 1000, and a
reserve of ``min_retries_per_sec * ttl`` withdrawals is always there. Deposits and
withdrawals live in the slice of ``ttl / 10`` they were made in and leave the
window ten slices later (after between 0.9 and 1 ``ttl``). See rfc/0007.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from fractions import Fraction
from typing import Any

from . import _log
from ._callables import clock_reading, slice_of, sync_callable
from ._duration import to_seconds
from ._log import EPISODE_QUIET
from ._untrusted import show

__all__ = ["RetryBudget"]

_SCALE = 1000  # tokens per deposit: lets retry_ratio be fractional with int tokens
_SLICES = 10
_NEVER = 1 << 62  # the cost of a withdrawal from a budget that never allows one
_RATIO = "a ratio in [0, 1000] (retries per first attempt: 0.2 is one per five)"
_RENAMED: object = object()  # percent_can_retry was not given (it is now retry_ratio)


class RetryBudget:
    """How many retries may be sent now: ``retry_ratio`` of deposits plus a reserve.

    * ``ttl``: deposits and withdrawals expire after it (1 s to 60 s).
    * ``min_retries_per_sec``: the reserve, ``min_retries_per_sec * ttl`` retries that
      are always available (a client that has just started, or sends little).
    * ``retry_ratio``: retries earned per first attempt; each :meth:`deposit` adds this
      fraction of a retry. A ratio, not a percentage: 0.2 is one retry per five first
      attempts (Finagle's ``percentCanRetry``, which despite its name is a ratio too);
      0 to 1000, Finagle's range.

    A fresh default budget holds 100 retries (10/s over 10 s). With
    ``min_retries_per_sec=0`` and ``retry_ratio=0`` every withdrawal is refused.
    Thread-safe and loop-agnostic: one budget may be shared by every request,
    thread and event loop. A refused withdrawal after a granted one logs
    ``budget.exhausted`` once (until a withdrawal is granted again); the first
    withdrawal granted a second (``EPISODE_QUIET``) or more after the last refusal
    logs ``budget.recovered``, with the withdrawals refused in between and how long
    they were refused (a budget that grants and refuses in turn is one episode).
    ``name`` is the ``budget`` field of both (None when unnamed, as a breaker's
    ``endpoint``). ``clock``: monotonic seconds (default ``time.monotonic``; a test's
    virtual clock).
    """

    __slots__ = (
        "__weakref__",  # Telemetry.watch holds it weakly
        "_clock",
        "_deposit",
        "_dry_last",
        "_dry_refused",
        "_dry_since",
        "_exhausted",
        "_index",
        "_last",
        "_lock",
        "_min",
        "_name",
        "_per_slice",
        "_ratio",
        "_refused",
        "_reserve",
        "_slice_end",
        "_slices",
        "_sum",
        "_telemetry",
        "_ticks",
        "_ttl",
        "_withdraw",
    )

    def __init__(
        self,
        *,
        ttl: timedelta | float = timedelta(seconds=10),
        min_retries_per_sec: float = 10,
        retry_ratio: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
        percent_can_retry: object = _RENAMED,
    ) -> None:
        what = "RetryBudget"
        seconds = to_seconds(ttl, f"{what}(ttl)")
        if not 1.0 <= seconds <= 60.0:
            raise ValueError(f"{what}(ttl) must be between 1 and 60 seconds, got {ttl!r}")
        minimum = _number(min_retries_per_sec, f"{what}(min_retries_per_sec)", "a number >= 0")
        if minimum < 0:
            raise ValueError(f"{what}(min_retries_per_sec) must be >= 0, got {minimum!r}")
        if percent_can_retry is not _RENAMED:
            raise TypeError(
                f"{what}(percent_can_retry=...) is now {what}(retry_ratio=...): the retries "
                "earned per first attempt, a ratio (0.2: one retry per five requests; 0 to "
                f"1000), not a 0-100 percentage; got percent_can_retry={show(percent_can_retry)}"
            )
        ratio = _number(retry_ratio, f"{what}(retry_ratio)", _RATIO)
        if not 0.0 <= ratio <= _SCALE:
            raise ValueError(f"{what}(retry_ratio) must be {_RATIO}, got {show(retry_ratio)}")
        sync_callable(clock, f"{what}(clock)", "() -> seconds")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{what}(name) must be a str or None, got {name!r}")
        self._ttl = seconds
        self._min = minimum
        self._ratio = ratio
        self._clock = clock
        self._name = name
        # Finagle: with a zero ratio, deposits earn nothing and a retry costs one token.
        self._deposit = 0 if ratio == 0.0 else _SCALE
        # A ratio so small that a withdrawal costs more than any deposit could ever
        # add (5e-324 would overflow int()): only the reserve pays for retries.
        cost = _SCALE / ratio if ratio else 1.0
        self._withdraw = _NEVER if cost >= _NEVER else int(cost)
        empty = minimum == 0 and ratio == 0.0
        # minimum * ttl retries, exactly as written (2.05/s for 60 s is 123, where floats
        # give 122.99999999999999 and int() 122)
        exact = Fraction(repr(float(minimum))) * Fraction(repr(float(seconds)))
        self._reserve = 0 if empty else int(exact * self._withdraw)
        if empty:  # Finagle's RetryBudget.Empty: no token is ever enough
            self._withdraw = _NEVER
        self._per_slice = _SLICES / seconds  # slice number = floor(now * per_slice)
        self._lock = threading.Lock()
        self._slices = [0] * _SLICES
        self._sum = 0
        self._index = math.floor(clock_reading(clock, "RetryBudget(clock)") * self._per_slice)
        self._slice_end = (self._index + 1) / self._per_slice
        # Deposits in the current slice are counted by an itertools.count (atomic in
        # CPython: no lock on the hot path); the lock holder moves them into the slice.
        self._ticks = itertools.count()
        self._last = next(self._ticks)
        # True from a refused withdrawal to the next granted one (an episode): only
        # the refusal path sets it, and a grant reads it (False on the common path).
        self._exhausted = False
        self._refused = 0
        self._dry_since = 0.0  # the clock at the episode's first refusal
        self._dry_last = 0.0  # ... and at its latest
        self._dry_refused = 0  # ``_refused`` before it
        self._telemetry: Any = None  # set by Telemetry.watch

    @property
    def name(self) -> str | None:
        """The name its events, refusals and telemetry show (None when unnamed)."""
        return self._name

    @property
    def ttl(self) -> timedelta:
        return timedelta(seconds=self._ttl)

    @property
    def min_retries_per_sec(self) -> float:
        return self._min

    @property
    def retry_ratio(self) -> float:
        return self._ratio

    @property
    def balance(self) -> int:
        """The whole retries that can be made now (never negative): a gauge."""
        index = slice_of(self._clock(), self._per_slice)
        with self._lock:
            self._catch_up(index)
            tokens = self._sum + self._reserve
        if tokens <= 0:
            return 0
        return int(tokens // self._withdraw)

    @property
    def refused(self) -> int:
        """How many withdrawals were refused since the budget was made."""
        return self._refused

    def deposit(self) -> None:
        """A first attempt: credits ``retry_ratio`` of a retry."""
        if not self._deposit:
            return
        now = self._clock()
        if now < self._slice_end:  # the hot path: one atomic count, no lock
            next(self._ticks)
            return
        index = slice_of(now, self._per_slice)
        with self._lock:
            self._catch_up(index)
            self._slices[self._index % _SLICES] += self._deposit
            self._sum += self._deposit

    def try_withdraw(self) -> bool:
        """A retry about to be sent: True and one retry taken, or False and nothing changed."""
        now = self._clock()
        index = slice_of(now, self._per_slice)
        cost = self._withdraw
        with self._lock:
            self._catch_up(index)
            tokens = self._sum + self._reserve
            if tokens >= cost:
                self._slices[self._index % _SLICES] -= cost
                self._sum -= cost
                if not self._exhausted:  # the common case: no refusal since the last grant
                    return True
                if now - self._dry_last < EPISODE_QUIET:
                    return True  # refused within the last second: the episode goes on
                # the first grant a quiet second after the last refusal ends the episode
                self._exhausted = False
                refused = self._refused - self._dry_refused
                since = self._dry_since
            else:
                first = not self._exhausted
                if first:  # an episode starts
                    self._exhausted = True
                    self._dry_since = now
                    self._dry_refused = self._refused
                self._refused += 1
                self._dry_last = now
                refused = -1
        if refused >= 0:
            log = _log.enabled(_log.INFO)
            if log is not None:
                try:
                    log.info(
                        _log.EVENT_BUDGET_RECOVERED,
                        budget=self._name,
                        refused=refused,
                        duration_ms=_log.duration_ms(since, now),
                        balance=(tokens - cost) // cost,
                        **_log.metric_endpoint(self),
                    )
                except BaseException:  # a log handler that raised: the door sends no retry
                    self.refund()
                    raise
            return True
        telemetry = self._telemetry
        if telemetry is not None:
            telemetry.budget_rejected(self)
        if first:  # an episode starts: a warning, as a breaker opening (rfc/0001, "Levels")
            log = _log.enabled(_log.WARNING)
            if log is not None:
                log.warning(
                    _log.EVENT_BUDGET_EXHAUSTED,
                    budget=self._name,
                    balance=max(0, tokens // cost),
                    min_retries_per_sec=self._min,
                    retry_ratio=self._ratio,
                    ttl_s=self._ttl,
                    **_log.metric_endpoint(self),
                )
        return False

    def refund(self) -> None:
        """Give back one granted withdrawal whose retry was never sent.

        Whatever kept the retry (or hedged copy) from going out after its withdrawal:
        refused before anything was written (an OPEN circuit breaker), or cut before it
        was sent. Call it once per such withdrawal, soon after it. The tokens go into
        the current slice, so they may outlive the withdrawal's slice by that delay.
        """
        cost = self._withdraw
        if cost >= _NEVER and self._reserve == 0:
            return  # no withdrawal is ever granted (Finagle's Empty): nothing to give back
        index = slice_of(self._clock(), self._per_slice)
        with self._lock:
            self._catch_up(index)
            self._slices[self._index % _SLICES] += cost
            self._sum += cost

    def _catch_up(self, index: int | None) -> None:
        """Count the lock-free deposits, then move the window to slice ``index`` (under the lock;
        None, a broken clock reading's (``slice_of``): the window stays where it is).

        A deposit that raced with a slice change may land in the newer slice: it then
        expires up to one slice (``ttl / 10``) later, the sloppiness Finagle accepts too.
        """
        tick = next(self._ticks)
        pending = tick - self._last - 1
        self._last = tick
        if pending:
            amount = pending * self._deposit
            self._slices[self._index % _SLICES] += amount
            self._sum += amount
        old = self._index
        if index is None or index <= old:  # same slice, a clock that went back or broke: stay
            return
        slices = self._slices
        if index - old >= _SLICES:
            for i in range(_SLICES):
                slices[i] = 0
            self._sum = 0
        else:
            for i in range(old + 1, index + 1):
                j = i % _SLICES
                self._sum -= slices[j]
                slices[j] = 0
        self._index = index
        self._slice_end = (index + 1) / self._per_slice

    def __repr__(self) -> str:
        label = "" if self._name is None else f" {self._name!r}"
        return (
            f"<RetryBudget{label} balance={self.balance} ttl={self._ttl:g}s "
            f"min_retries_per_sec={self._min:g} retry_ratio={self._ratio:g}>"
        )


def _number(value: object, what: str, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be {allowed}, got {show(value)} ({type(value).__name__})")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float: out of every range here
        number = math.inf
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"{what} must be {allowed}, got {show(value)}")
    return number
