"""A hedging delay learned from latency: the p(1 - max_extra_load) of a sliding window.

Finagle's ``BackupRequestFilter`` sends its backup request at the
``1 - maxExtraLoad`` percentile of a ``WindowedPercentileHistogram`` (30 s, in ten
buckets of 3 s, the percentile refreshed every 3 s, never below 1 ms); tower's
``hedge`` keeps a rotating histogram too. :class:`LatencyQuantile` is that window:
latencies go into a log-linear histogram (HDR-style: 64 linear sub-buckets per power
of two, a relative error of at most 1/64) kept in ten slices of ``window / 10``; the
delay is recomputed when a slice turns over. See rfc/0009, "Adaptive hedging".
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable
from datetime import timedelta
from itertools import accumulate, islice

from ._callables import clock_reading, slice_of, sync_callable
from ._duration import to_seconds
from ._untrusted import show

__all__ = ["RELATIVE_ERROR", "LatencyQuantile"]

_SUB = 64  # linear sub-buckets per power of two
_TWO_SUB = 2 * _SUB
#: The most a reported latency exceeds the true one, relative to it: a bucket's upper
#: bound over its lower bound, minus one.
RELATIVE_ERROR = 1.0 / _SUB
_E0 = -19  # math.frexp's exponent for 2**-20 s (about 0.95 us), the lowest bucket
_OCTAVES = 32  # 2**-20 s to 2**12 s (68 minutes)
_TOP = _OCTAVES * _SUB - 1
_LOW = math.ldexp(1.0, _E0 - 1)
_HIGH = math.ldexp(1.0, _E0 - 1 + _OCTAVES)
_OFFSET = _E0 * _SUB + _SUB  # bucket = exponent * _SUB + int(mantissa * _TWO_SUB) - _OFFSET
_INF = math.inf
_frexp = math.frexp
_FOLD = 256  # lock-free latencies waiting to be counted, at most (about)
_SLICES = 10  # the window moves by a tenth of itself (Finagle: 30 s in 3 s buckets)
_MIN_WINDOW = 1.0
_MAX_WINDOW = 86400.0
_MAX_SAMPLES = 2**31 - 1
#: Added to a cut copy's bucket: "longer than this", counted above every latency.
_CUT = _OCTAVES * _SUB
# q2 may have up to 40% of the budget again above it, at most 0.4% of the window more:
# issue 23 allows max_extra_load + 0.5%, and a window's count is a sample (at 1.5% in
# the window, 7 of 30 simulated runs at a 1% tail used 1.51-1.63%; at 1.4%, 1 of 30).
_SLACK = 0.4
_SLACK_CAP = 0.004


def _share(extra: float, count: int) -> int:
    """``_slack`` without its square-root term: the most of the body hedged above ``q2``."""
    return math.floor(min(extra * (1.0 + _SLACK), extra + _SLACK_CAP) * count + 1e-9)


def _slack(extra: float, count: int, above: int) -> int:
    """How many of ``count`` latencies may lie above ``q2``: ``above`` (the budget's,
    ``floor(extra * count)``) plus 40% of it again, at most 0.4% of the window, or plus
    two standard deviations of ``above`` if that is more. The latter matters in small
    windows: 3 of the first 100 at 1%, so that two tail latencies among them no longer
    put the first delay in the tail (a quarter of the simulated starts did, for up to
    a window). That term is for the tail: the body's top gets :func:`_share` at most."""
    return max(_share(extra, count), math.floor(above + 2.0 * math.sqrt(above + 1)))


# Once a tail past a gap is hedged whole, it stays so while it is within issue 23's
# allowance, max_extra_load + 0.5% of the window, plus two standard deviations of that count.
_STAY = 0.005
_STAY_SD = 2.0


#: A tail hedged whole stays so only while the body's top it keeps is at most this many
#: times the delay kept so far (see _refresh).
_KEEP_RISE = 2.0


def _stay(extra: float, count: int, above2: int) -> int:
    """How many of ``count`` latencies may lie past the gap and still be hedged whole,
    once they are (the hysteresis of :meth:`LatencyQuantile._refresh`):
    ``a = floor((extra + 0.005) * count)`` plus two standard deviations of it,
    ``2 * sqrt(a + 1)``; at least ``above2`` (k2). 4,500 latencies at 1%: 67 + 16 = 83,
    against k2 = 63; 460 (the first window, 3 s in): 11, against 8."""
    share = math.floor((extra + _STAY) * count + 1e-9)
    return max(above2, math.floor(share + _STAY_SD * math.sqrt(share + 1)))


def _at_rank(items: list[tuple[int, int]], rank: int) -> int:
    """The bucket holding the ``rank``-th latency (1-based) of ``items``, sorted (bucket, count)."""
    seen = 0
    for bucket, n in items:
        seen += n
        if seen >= rank:
            return bucket
    return _TOP  # unreachable: the counts add up to the window's count


#: A gap may hold stragglers: an octave above the body holding at most 1/8 as many
#: latencies as lie past it still parts the body from the tail (rfc/0009, "Stragglers").
_STRAGGLERS = 8


def _past_gap(items: list[tuple[int, int]], rank: int) -> tuple[int, float, int]:
    """From the ``rank``-th latency up: its bucket, the highest latency below the first gap
    above it, and how many latencies lie past that latency (the gap's stragglers and the
    tail beyond it; cut copies count as past every gap; 0 when there is no gap).

    A gap above a latency ``t`` is the octave ``(t, 2t]`` holding at most a
    ``1/_STRAGGLERS`` share of the latencies past it: none (an empty octave), or a few
    stragglers a real loop puts between the body and the tail (late ticks, collections),
    which an empty octave alone would not see past. A continuous tail (exponential,
    log-normal, Pareto) holds more in each octave than 1/8 of what lies beyond it.
    """
    seen = 0
    start = len(items)
    for i, (_, n) in enumerate(items):
        seen += n
        if seen >= rank:
            start = i
            break
    if start == len(items):
        return _TOP, 0.0, 0
    at = items[start][0]
    uppers: list[float] = []  # the latencies above, bucket by bucket (cut copies apart)
    counts: list[int] = []
    cut = 0
    for bucket, n in items[start + 1 :]:
        if bucket >= _CUT:
            cut += n
        else:
            uppers.append(_upper(bucket))
            counts.append(n)
    after = [*accumulate(reversed(counts))][::-1]
    after.append(0)  # after[j]: the latencies in buckets j and up
    top = _upper(at % _CUT)
    if at >= _CUT:  # q2 among the cut copies: only cut copies lie past it
        return at, top, cut
    j = -1  # top is uppers[j] (-1: the rank's own bucket)
    while True:
        edge = bisect_right(uppers, 2.0 * (1.0 + RELATIVE_ERROR) * top, j + 1)
        inside = after[j + 1] - after[edge]
        past = after[edge] + cut
        if past and inside * _STRAGGLERS <= past:
            return at, top, inside + past
        j += 1
        if j == len(uppers):
            return at, top, 0
        top = uppers[j]


def _bucket(seconds: float) -> int:
    if seconds < _LOW:
        return 0
    if seconds >= _HIGH:
        return _TOP
    mantissa, exponent = math.frexp(seconds)  # mantissa in [0.5, 1)
    return (exponent - _E0) * _SUB + int((mantissa - 0.5) * _TWO_SUB)


def _upper(bucket: int) -> float:
    """The highest latency bucket ``bucket`` holds (HdrHistogram's highest equivalent value)."""
    exponent, sub = divmod(bucket, _SUB)
    return math.ldexp(0.5 + (sub + 1) / _TWO_SUB, exponent + _E0)


class LatencyQuantile:
    """The latency below which ``1 - max_extra_load`` of recent requests answered.

    Give it as ``HedgePolicy(delay=LatencyQuantile(...))``: each hedged request then
    sends its next copy after :attr:`current_delay`, and records the latency of its copies
    here (as Finagle does: every copy that answered, and every copy cut because another
    won, at the time it was cut). One instance per endpoint or method, shared by every
    request to it.

    * ``max_extra_load``: the fraction of requests allowed to need a hedge (0.01: the
      delay is the p99 latency). Greater than 0, less than 1.
    * ``window``: how long latencies are remembered (1 s to 1 day; 30 s as Finagle). They
      leave in tenths (after between 0.9 and 1 ``window``), and the delay is recomputed
      whenever a tenth turns over (every 3 s by default, Finagle's refresh).
    * ``min_delay``: the delay is never shorter (default 1 ms, Finagle's floor: a p99 of
      0 ms would hedge every request at once).
    * ``max_delay``: the delay is never longer (default None: no bound).
    * ``min_samples``: no delay, and so no hedge sent for latency, until the window
      holds this many latencies (default 100: below ``1 / max_extra_load`` samples the
      p99 is just the slowest one seen).
    * ``clock``: seconds, monotonic (default ``time.monotonic``); it only ages latencies.

    The quantile is the nearest rank: the smallest recorded latency with at least
    ``1 - max_extra_load`` of the window at or below it, except at a tail past a gap
    that the budget only just covers: then the tail is hedged whole, the share above
    the delay up to ``1.4 * max_extra_load`` (at most ``max_extra_load + 0.004``; more
    in small windows for the tail, within two standard deviations of the count; once
    hedged whole, the tail stays so up to ``max_extra_load + 0.005`` of the window and
    two standard deviations, the delay at the body's top: see rfc/0009). A copy cut
    because another won counts as longer than every latency (see :meth:`record`).
    Each rank is reported as the upper bound of
    its histogram bucket (at most :data:`RELATIVE_ERROR`, 1/64, above the true value:
    never below, so hedges never exceed ``max_extra_load`` for lack of precision).
    Latencies from about 1 us to 68 minutes are told apart; shorter and longer ones
    count as the bounds. Thread-safe; fixed memory (at most 4096 counts per tenth: 2048
    buckets, twice: cut copies apart); :meth:`record` is O(1).
    """

    __slots__ = (
        "__weakref__",
        "_clock",
        "_cold",
        "_count",
        "_delay",
        "_extra",
        "_index",
        "_keep",
        "_lock",
        "_max_delay",
        "_min_delay",
        "_min_samples",
        "_pending",
        "_per_slice",
        "_sizes",
        "_slice_end",
        "_slices",
        "_window",
    )

    def __init__(
        self,
        max_extra_load: float = 0.01,
        *,
        window: timedelta | float = timedelta(seconds=30),
        min_delay: timedelta | float = timedelta(milliseconds=1),
        max_delay: timedelta | float | None = None,
        min_samples: int = 100,
        clock: Callable[[], float] | None = None,
    ) -> None:
        what = "LatencyQuantile"
        allowed = "an int or float greater than 0 and less than 1 (0.01: hedge at the p99 latency)"
        if isinstance(max_extra_load, bool) or not isinstance(max_extra_load, (int, float)):
            raise TypeError(
                f"{what}(max_extra_load) must be {allowed}, got {show(max_extra_load)} "
                f"({type(max_extra_load).__name__})"
            )
        try:
            extra = float(max_extra_load)
        except OverflowError:
            extra = math.inf
        if not 0.0 < extra < 1.0:  # NaN fails too
            raise ValueError(
                f"{what}(max_extra_load) must be {allowed}, got {show(max_extra_load)}"
            )
        seconds = to_seconds(window, f"{what}(window)")
        if not _MIN_WINDOW <= seconds <= _MAX_WINDOW:
            raise ValueError(
                f"{what}(window) must be between 1 second and 1 day (Finagle keeps 30 s), "
                f"got {show(window)}"
            )
        low = to_seconds(min_delay, f"{what}(min_delay)")
        high: float | None = None
        if max_delay is not None:
            high = to_seconds(max_delay, f"{what}(max_delay)", allow_zero=False)
            if high < low:
                raise ValueError(
                    f"{what}(max_delay) must be None or at least min_delay ({low:g} s), "
                    f"got {show(max_delay)}"
                )
        if isinstance(min_samples, bool) or not isinstance(min_samples, int):
            raise TypeError(
                f"{what}(min_samples) must be an integer >= 1, got {show(min_samples)} "
                f"({type(min_samples).__name__})"
            )
        if not 1 <= min_samples <= _MAX_SAMPLES:
            raise ValueError(
                f"{what}(min_samples) must be an integer from 1 to {_MAX_SAMPLES}, "
                f"got {show(min_samples)}"
            )
        sync_callable(clock, f"{what}(clock)", "() -> seconds", optional=True)
        if clock is None:
            clock = time.monotonic
        self._extra = extra
        self._window = seconds
        self._min_delay = low
        self._max_delay = high
        self._min_samples = min_samples
        self._clock = clock
        self._lock = threading.Lock()
        self._per_slice = _SLICES / seconds  # slice number = floor(now * per_slice)
        # Per tenth of the window: bucket -> count (only the buckets used: at most 2048),
        # and bucket + _CUT -> count for the cut copies (2048 more).
        self._slices: list[Counter[int]] = [Counter() for _ in range(_SLICES)]
        self._sizes = [0] * _SLICES
        self._count = 0  # in the slices; the pending ones aside
        # Once there is a delay, record() appends the bucket here (deque.append is atomic
        # in CPython: no lock) and the lock holder counts them in the current slice
        # (_fold), every _FOLD latencies and whenever the window is read or moves.
        self._pending: deque[int] = deque()
        self._delay = math.inf  # seconds; inf: fewer than min_samples latencies
        self._cold = True  # self._delay is math.inf
        self._keep = False  # the delay hedges a tail past a gap whole (see _refresh)
        self._index = math.floor(clock_reading(clock, f"{what}(clock)") * self._per_slice)
        self._slice_end = (self._index + 1) / self._per_slice

    # -- configuration -----------------------------------------------------------------
    @property
    def max_extra_load(self) -> float:
        return self._extra

    @property
    def window(self) -> timedelta:
        return timedelta(seconds=self._window)

    @property
    def min_delay(self) -> timedelta:
        return timedelta(seconds=self._min_delay)

    @property
    def max_delay(self) -> timedelta | None:
        return None if self._max_delay is None else timedelta(seconds=self._max_delay)

    @property
    def min_samples(self) -> int:
        return self._min_samples

    # -- reading -----------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Latencies in the window now."""
        now = self._clock()
        with self._lock:
            self._fold()
            if now >= self._slice_end:
                index = slice_of(now, self._per_slice)
                if index is not None:
                    self._roll(index)
            return self._count

    @property
    def delay_seconds(self) -> float:
        """:attr:`current_delay` in seconds, ``math.inf`` before ``min_samples``.

        A clock that raises gives the delay as it is: the doors read it while a hedged
        request is under way (a gRPC call's first copy already sent), where a broken
        clock must not end the request, as :meth:`record` records nothing then."""
        try:
            now = self._clock()
        except Exception:
            return self._delay
        if now >= self._slice_end:
            self._turn(now)
        return self._delay

    def total_seconds(self) -> float:
        """:attr:`delay_seconds`, read as ``timedelta.total_seconds()`` reads a fixed delay:
        code that reads ``HedgePolicy.delay.total_seconds()`` works with either."""
        return self.delay_seconds

    @property
    def current_delay(self) -> timedelta | None:
        """When the next copy of a hedged request goes out; None before ``min_samples``."""
        delay = self.delay_seconds
        return None if delay == math.inf else timedelta(seconds=delay)

    # -- recording ---------------------------------------------------------------------
    def record(self, latency: float | timedelta, *, cut: bool = False) -> None:
        """One copy's latency (seconds or a ``timedelta``; finite, >= 0).

        ``cut=True``: the copy was cut because another won, ``latency`` after it was sent.
        If that is at least :attr:`current_delay` (a first copy the hedge beat), it is
        only known to be longer: it counts as above every latency, not at the time it
        was cut (Finagle's). Placed there, a 1% tail cut at delay + 3 ms filled the
        gap above the body, the p99 fell among them and the delay crept up from 5 to
        13 ms. A shorter cut copy (a hedge the first copy beat) counts where it was cut.
        """
        if latency.__class__ is float and 0.0 <= latency < _INF:
            seconds = latency
        else:  # checked and converted (a timedelta, an int), or a clear error
            seconds = to_seconds(latency, "LatencyQuantile.record(latency)")
        if seconds < _LOW:
            bucket = 0
        elif seconds >= _HIGH:
            bucket = _TOP
        else:  # _bucket(), inlined: (exponent - _E0) * 64 + int((mantissa - 0.5) * 128)
            mantissa, exponent = _frexp(seconds)
            bucket = exponent * _SUB + int(mantissa * _TWO_SUB) - _OFFSET
        if cut and seconds >= self._delay:
            bucket += _CUT
        try:
            now = self._clock()
        except Exception:  # a broken clock records nothing: a copy's answer stands
            return
        if now < self._slice_end and not self._cold:  # the hot path: no lock
            pending = self._pending
            pending.append(bucket)
            if len(pending) >= _FOLD:
                with self._lock:
                    self._fold()
            return
        index = slice_of(now, self._per_slice)
        if index is None:  # NaN, an infinity, past a float's range: no slice to count it in
            return
        with self._lock:
            self._fold()
            if now >= self._slice_end:
                self._roll(index)
            slot = self._index % _SLICES
            self._slices[slot][bucket] += 1
            self._sizes[slot] += 1
            self._count += 1
            if self._cold and self._count >= self._min_samples:
                self._refresh()  # the first delay, without waiting for the next tenth

    # -- the window --------------------------------------------------------------------
    def _turn(self, now: float) -> None:
        index = slice_of(now, self._per_slice)
        if index is None:  # a reading no window can move to: the delay as it is
            return
        with self._lock:
            if now >= self._slice_end:
                self._fold()
                self._roll(index)

    def _fold(self) -> None:
        """Count the lock-free latencies in the current slice (under the lock).

        One that raced with a change of slice may be counted in the newer one: it then
        leaves the window up to a tenth later (the sloppiness RetryBudget accepts).
        """
        pending = self._pending
        n = len(pending)  # only the lock holder takes from it: n are there
        if n:
            slot = self._index % _SLICES
            self._slices[slot].update(islice(iter(pending.popleft, None), n))
            self._sizes[slot] += n
            self._count += n

    def _roll(self, index: int) -> None:
        """Move the window to slice ``index`` and recompute the delay (under the lock,
        the pending latencies folded)."""
        old = self._index
        if index <= old:  # a clock that went back stays in the newer slice
            return
        slices, sizes = self._slices, self._sizes
        for i in range(old + 1, min(index, old + _SLICES) + 1):
            j = i % _SLICES
            if sizes[j]:
                self._count -= sizes[j]
                sizes[j] = 0
                slices[j] = Counter()
        self._index = index
        self._slice_end = (index + 1) / self._per_slice
        self._refresh()

    def _refresh(self) -> None:
        """The delay from the window's histogram (under the lock; O(buckets used)).

        Two nearest ranks: ``q``, with at most ``k = floor(max_extra_load * n)`` of the
        ``n`` latencies above it, and ``q2``, with at most ``k2`` (:func:`_slack`: about
        ``1.4 k``). The delay is ``q2`` when the latencies past a gap above ``q2`` (the
        first octave holding at most 1/8 of what lies past it: :func:`_past_gap`; cut
        copies are past every gap) are within two standard
        deviations of ``k`` or more: a tail the budget only just covers, if at all, is
        hedged whole, the rest of ``k2`` spent on the body. Else it is ``q``.

        Why (issue 23; a simulation of bench/bench_hedge_adaptive.py's model, 1-2 ms
        frames and a tail at 50 ms, 150 requests/s, driving this class on a fake clock,
        median p99.9 over 10 seeds): with a 1% tail ``q`` sits on the body/tail
        boundary, the tail count drifts (45 +- 7 of 4,500 in 30 s) and the delay jumped
        between the body's top and the tail: p99.9 14.4 ms against 9.4 ms for the best
        fixed delay (5.5 ms, 1.18% extra). With ``q2`` and cut copies counted above
        (:meth:`record`): 9.15 ms, 1.38% extra. A 0.5% tail stays at ``q`` (8.7 ms
        before, 8.6 ms); a 1.2% tail, past the budget, 28.8 ms before, 11.5 ms (1.38%
        extra; the best fixed delay, 9.5 ms at 1.39%). A tail above ``k2``
        is not hedged: the delay is then in it, as Finagle's.

        When the tail is hedged whole, the body's top shares ``k2`` only up to
        ``1.4 k`` (at most ``k`` + 0.4%: ``q4``, :func:`_share`), not the square-root
        term, which is there for the tail count's sampling error: a tail past ``1.4 k``
        puts the delay at the body's top (the highest latency below the gap). In small
        windows that term let the body take up to 0.7% more (k2 = 8 of 460 latencies).

        Hysteresis: once the tail past the gap is hedged whole, it stays so while the
        latencies past the gap above ``q3`` (the rank with :func:`_stay`'s ``a3`` above
        it: ``k`` + 0.5% of the window, plus two standard deviations) are more than
        ``k2`` but at most ``a3``: the delay is then the body's top. Past ``a3``, or
        once the delay is back at ``q``, the tail must come down to ``k2`` to be hedged
        again. Entering and leaving at the same ``k2`` put the delay in the tail (51 ms)
        whenever a window's tail count crossed it, mostly while the first window
        filled but also later (one simulated 1% tail drifted to 66 of 4,100, 1.6%).

        Both, in the simulation above (30 seeds; 100 in brackets): runs with 3 s or
        more with the delay in the tail, 1% tail 3 -> 0 (11 -> 0), 1.2% tail 15 -> 0
        (46 -> 0); median p99.9 9.03 -> 9.05 ms (9.08 -> 9.08) at 1%, 11.26 -> 9.76 ms
        at 1.2%, 0.5% and 0.8% tails within 0.01 ms; extra load, mean and highest run,
        1.39 -> 1.39% and 1.55 -> 1.52% at 1%, 1.38 -> 1.42% and 1.56 -> 1.53% at
        1.2%. A 1.5% tail (100 seeds), at the allowance: p99.9 51.7 -> 10.8 ms, extra
        1.14 -> 1.53% (highest 1.76 -> 1.67%).
        """
        count = self._count
        if count < self._min_samples:
            self._delay = math.inf
            self._cold = True
            self._keep = False
            return
        merged: Counter[int] = Counter()
        for counts in self._slices:
            merged.update(counts)
        extra = self._extra
        above = math.floor(extra * count + 1e-9)  # at most this many above q
        above2 = _slack(extra, count, above)  # ... above q2
        above3 = _stay(extra, count, above2)  # ... past the gap, to keep hedging it
        body = min(_share(extra, count), above2)  # the body's share above q2, at most
        rank, rank2, rank3, rank4 = count - above, count - above2, count - above3, count - body
        items = sorted(merged.items())  # the cut copies last
        first = _at_rank(items, rank)
        fourth = _at_rank(items, rank4)
        _, previous, beyond = _past_gap(items, rank2)
        third, previous3, beyond3 = _past_gap(items, rank3)
        least = above - 2.0 * math.sqrt(above + 1)
        if (
            self._keep
            and third < _CUT
            and beyond3 > above2
            and beyond3 >= least
            and previous3 <= _KEEP_RISE * self._delay
        ):
            # The tail was hedged whole and is past k2 now, but within _stay's allowance
            # (beyond3 <= above3): keep hedging it whole, the delay at the body's top
            # (the highest latency below the gap), no share of the body hedged. Not when
            # that top is more than twice the delay kept so far: then what lies below the
            # gap is no longer the body it hedged (stragglers filled the octaves up to the
            # tail, and past the gap there are only the cut copies).
            self._set(previous3)
            return
        self._keep = bool(beyond) and beyond >= least
        if self._keep:
            # The tail hedged whole; the body's top too, up to the share without the
            # square-root term (q4), which is for the tail count's sampling error.
            if beyond > body:  # the tail alone is more: the delay at the body's top
                self._set(previous)
                return
            first = fourth  # (q among the cut copies: beyond > k, so this too)
        # Still a cut copy (more than k2 of them: the delay is too short): the time it
        # was cut, as Finagle records it, so that the delay moves up.
        self._set(_upper(first % _CUT))

    def _set(self, value: float) -> None:
        value = max(value, self._min_delay)
        if self._max_delay is not None:
            value = min(value, self._max_delay)
        self._delay = value
        self._cold = False

    def __repr__(self) -> str:
        delay = self.current_delay
        shown = "None" if delay is None else f"{delay.total_seconds() * 1000.0:.3f}ms"
        return (
            f"<LatencyQuantile p{(1.0 - self._extra) * 100:g} window={self._window:g}s "
            f"samples={self.count} current_delay={shown}>"
        )
