"""A concurrency limit that follows the endpoint's latency.

rfc/0009, "Adaptive concurrency limiter".

Netflix concurrency-limits' ``Gradient2Limit`` (the version with ``rttTolerance``)
fed by windows as its ``WindowedLimit`` feeds it, with their parameters. Gradient2:
smoothing 0.2, RTT tolerance 1.5, a long-term RTT averaged over 600 windows after
10 warm-up windows, a gradient clamped to [0.5, 1], no growth while fewer than half
the permits were used. A window is
the average round trip of at least 10 samples (WindowedLimit's ``windowSize``; a
window waits for them, as failsafe-go's AdaptiveLimiter does, rather than being
dropped) and lasts twice the smallest round trip of the one before, bounded to
[0.1 s, 1 s] (the floor is WindowedLimit's lowest allowed ``minWindowTime`` and
Envoy's ``concurrency_update_interval``; the ceiling WindowedLimit's default). The
headroom added while latency is flat is ``max(4, sqrt(limit))`` (concurrency-limits'
``SquareRootFunction.create(4)``; Gradient2's own default is 4).

Where this differs from upstream (a window with a drop halves the limit at once,
unsmoothed; only timeouts and cuts that ran 1.5 baselines count as drops; a window
keeps collecting until it has its samples; the probe below...): rfc/0009, "Where we
differ". The probe, measured there: upstream, a steady overload teaches the
long-term RTT its own queue, and the limit drifts up with it to ``max_limit``. Here
a baseline that no unloaded window confirmed for 30 windows in a row (saturated,
above the baseline) is re-measured by a probe, as Envoy's adaptive_concurrency
re-measures its minimum RTT: the limit is held at half while 10 dispatches per permit,
at most 50 (Envoy's ``request_count``), go out at that concurrency, and their average,
once every one of them has ended, is the new baseline. A probe that finds it 10 % lower probes again
at half as much; warm-up windows that were all saturated end with a probe.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from . import _log
from ._breaker import _cut_at_deadline, default_is_failure
from ._callables import clock_reading, sync_callable
from ._context import AttemptEffect
from ._errors import sent_nothing
from ._permits import TOKEN, Permits, permits, text
from ._request import dispatching

__all__ = ["AdaptiveAcquire", "AdaptiveConcurrencyLimiter", "AdaptiveGuard", "AdaptivePermit"]

SMOOTHING = 0.2  # Gradient2 ``smoothing``
TOLERANCE = 1.5  # Gradient2 ``rttTolerance``
LONG_WINDOW = 600  # Gradient2 ``longWindow``: the long-term RTT's EWMA, 2 / (600 + 1)
WARMUP = 10  # ExpAvgMeasurement's warm-up: a plain average of the first 10 windows
MIN_GRADIENT = 0.5  # Gradient2's clamp; also the gradient of a window with a drop
MIN_HEADROOM = 4.0  # SquareRootFunction.create(4)
WINDOW_SAMPLES = 10  # WindowedLimit ``windowSize``: a window waits for this many samples
MIN_WINDOW = 0.1  # seconds: the floor of a window (see the module's docstring)
MAX_WINDOW = 1.0  # WindowedLimit ``maxWindowTime``
PROBE_INTERVAL = 30  # saturated windows without an unloaded one before the baseline is re-measured
PROBE_SAMPLES = 50  # samples at half the limit that make the new baseline (Envoy's request_count)
PROBE_PER_PERMIT = 10  # ... but no more than this many per permit of the probe (10 at 1, 50 from 5)
PROBE_AGAIN = 0.9  # a probe that finds the baseline this much lower probes again at half

#: Samples waiting to be counted (appended without the lock) before the next caller
#: counts them: memory stays bounded whatever the rate.
PENDING = 256

_FACTOR = 2.0 / (LONG_WINDOW + 1)
_INF = math.inf
_NAN = math.nan
_KEEP = 1.0 - SMOOTHING
_NOT_SENT = AttemptEffect.NOT_SENT
_CAUSES = 4  # how far down ``raise ... from`` chains a timeout is looked for

# What a dispatch's end says about the endpoint's latency.
_IGNORE = 0  # nothing: not sent, not answered (refused, reset), or cancelled from elsewhere
_SAMPLE = 1  # an answer (a success, or an error the endpoint answered with): its RTT
_DROP = 2  # a timeout, or the request's deadline cutting the dispatch: overload


def _timed_out(error: BaseException) -> bool:
    for _ in range(_CAUSES):
        if isinstance(error, TimeoutError):
            return True
        if sys.version_info < (3, 11):  # pragma: no cover - asyncio.TimeoutError is separate
            asyncio = sys.modules.get("asyncio")
            if asyncio is not None and isinstance(error, asyncio.TimeoutError):
                return True
        cause = error.__cause__
        if cause is None:
            return False
        error = cause
    return False


def _judge(error: BaseException) -> int:
    """What a dispatch that ended with ``error`` says (see ``_IGNORE``, ``_SAMPLE``, ``_DROP``)."""
    if not isinstance(error, Exception):  # a cancellation, KeyboardInterrupt
        return _IGNORE if _cut_at_deadline(dispatching(), error) is None else _DROP
    if sent_nothing(error):
        return _IGNORE  # refused before the write (a breaker, no connection)
    if _timed_out(error):
        return _DROP
    if default_is_failure(error):
        return _IGNORE  # refused, reset, unreachable: the breaker's business, not latency
    return _SAMPLE


class AdaptiveConcurrencyLimiter(Permits):
    """A concurrency limit between ``min_limit`` and ``max_limit`` that follows latency.

    The interface of :class:`ConcurrencyLimiter` (``guard()``, ``acquire()``,
    ``limit``, ``in_flight``, ``queued``, ``max_queued``, ``name``); ``limit`` starts
    at ``initial_limit`` and moves once per window of at least 10 dispatches (about
    two round trips, 0.1 s to 1 s): up while their average latency stays within 1.5
    times the endpoint's unloaded round trip and the permits are used, down when it
    rises past that or a dispatch times out. So it grows to what the endpoint serves
    without queueing (and up to half as much again) and shrinks when concurrency
    makes the endpoint slower. The algorithm and its parameters: rfc/0009.

    Unlike :class:`ConcurrencyLimiter`'s one shared guard, ``guard()`` and
    ``acquire()`` return a new object per call: it times its dispatch. Write
    ``with limiter.guard():`` (``async with limiter.acquire():``) around each
    dispatch; an object entered again while in use raises RuntimeError and takes
    nothing.

    What a dispatch's end counts for: an answer (the block returned, or raised an
    error the endpoint answered with) is a round-trip sample; a timeout (a
    ``TimeoutError`` in the error or its ``__cause__`` chain, or the request's
    deadline cutting the block) is a drop; a refusal before anything was sent
    (``RetryableError`` with effect ``NOT_SENT``), a connection refused, reset or
    unreachable, and a cancellation from elsewhere count for nothing.

    A refusal's ``retry_after`` is the last measured round trip (about when the
    dispatches in flight start to end). Memory and work per dispatch are O(1);
    thread-safe (one lock, never held while the dispatch runs); ``clock`` (seconds,
    monotonic; default ``time.monotonic``) is injectable for tests.

    Events (info; ``limiter`` is ``name``): ``limiter.limit_changed`` when the limit
    has moved by a factor of 2 or more from the last one reported (``initial_limit``
    at first): ``limit``, ``previous`` (the last reported), ``baseline_rtt_ms``,
    ``rtt_ms`` (what the change was computed from) and ``cause``: ``gradient``
    (latency), ``drop`` (a timeout), ``probe`` (held at half to re-measure the
    baseline) or ``probe_end`` (restored after it). A limit that wiggles logs
    nothing. ``limiter.refusing`` and ``limiter.recovered`` as
    :class:`ConcurrencyLimiter`'s.
    """

    __slots__ = (
        "_baseline",
        "_before",
        "_changes",
        "_clock",
        "_estimate",
        "_last_rtt",
        "_max",
        "_min",
        "_pending",
        "_probe_n",
        "_probe_open",
        "_probe_out",
        "_probe_samples",
        "_probe_sum",
        "_probing",
        "_reported",
        "_stale",
        "_warm",
        "_warm_sum",
        "_window_drop",
        "_window_end",
        "_window_held",
        "_window_least",
        "_window_n",
        "_window_sum",
    )

    def __init__(
        self,
        initial_limit: int = 20,
        min_limit: int = 1,
        max_limit: int = 200,
        *,
        max_queued: int = 0,
        name: str = "",
        clock: Callable[[], float] | None = None,
    ) -> None:
        what = "AdaptiveConcurrencyLimiter"
        initial = permits(initial_limit, f"{what}(initial_limit)", 1)
        low = permits(min_limit, f"{what}(min_limit)", 1)
        high = permits(max_limit, f"{what}(max_limit)", 1)
        if low > high:
            raise ValueError(
                f"{what}(min_limit) must be <= max_limit, got min_limit={low}, max_limit={high}"
            )
        if not low <= initial <= high:
            raise ValueError(
                f"{what}(initial_limit) must be between min_limit and max_limit "
                f"({low} to {high}), got {initial}"
            )
        queue = permits(max_queued, f"{what}(max_queued)", 0)
        sync_callable(clock, f"{what}(clock)", "() -> seconds", optional=True)
        if clock is not None:
            clock_reading(clock, f"{what}(clock)")  # a clock that returns no seconds: here
        Permits.__init__(self, initial, queue, text(name, f"{what}(name)"), clock)
        self._min = low
        self._max = high
        self._estimate = float(initial)  # Gradient2's estimatedLimit; _cap = int(it)
        self._baseline = 0.0  # the long-term RTT: the endpoint's latency without our queue
        self._warm = 0  # warm-up windows so far
        self._warm_sum = 0.0
        self._last_rtt: float | None = None
        self._stale = 0  # saturated windows since an unloaded one confirmed the baseline
        self._probing = False
        self._before = 0.0  # the estimate a probe restores
        self._probe_out = 0  # the probe's dispatches let through so far
        self._probe_samples = PROBE_SAMPLES  # ... of this many
        self._probe_open = 0  # ... and not ended yet
        self._probe_n = 0  # ... ended with a round trip
        self._probe_sum = 0.0
        # (ended at, round trip or -1.0 for a drop, permits held): appended lock-free
        self._pending: deque[tuple[float, float, int]] = deque()
        # the current window (WindowedLimit's AverageSampleWindow)
        self._window_end = -math.inf  # the first sample opens the first window
        self._window_n = 0
        self._window_sum = 0.0
        self._window_least = math.inf
        self._window_held = 0  # the most permits held when one of its samples was let through
        self._window_drop = False
        # limiter.limit_changed: the limit last reported, and the events noted under the
        # lock (limit, previous, baseline, rtt, cause), logged once it is released
        self._reported = initial
        self._changes: list[tuple[int, int, float | None, float | None, str]] = []

    # -- reading --------------------------------------------------------------------
    @property
    def limit(self) -> int:
        """The current limit: permits that may be in flight now."""
        return self._cap

    @property
    def min_limit(self) -> int:
        return self._min

    @property
    def max_limit(self) -> int:
        return self._max

    @property
    def baseline_rtt(self) -> float | None:
        """The long-term round trip (seconds) the latency is compared with; None before any."""
        return self._baseline if self._warm else None

    def __repr__(self) -> str:
        label = f" {self._name!r}" if self._name else ""
        return (
            f"<AdaptiveConcurrencyLimiter{label} limit={self._cap} in_flight={self.in_flight} "
            f"queued={len(self._waiters)} min_limit={self._min} max_limit={self._max}>"
        )

    # -- the dispatch side ----------------------------------------------------------
    def guard(self) -> AdaptiveGuard:
        """``with limiter.guard():``: a permit now, or a refusal (no queue).

        A new object per call (it times one dispatch): entered again while in use, it
        raises RuntimeError.
        """
        permit = _new(AdaptiveGuard)  # built as __init__ would, without its frame
        permit._limiter = self
        permit._free = True
        permit._held = 0
        return permit

    def acquire(self) -> AdaptiveAcquire:
        """``async with limiter.acquire():``: a permit, waiting in line if ``max_queued`` allows.

        A new object per call, as :meth:`guard`'s.
        """
        permit = _new(AdaptiveAcquire)
        permit._limiter = self
        permit._free = True
        permit._held = 0
        return permit

    def _hint(self) -> float | None:
        return self._last_rtt

    # -- counting samples (under the lock) ------------------------------------------------
    def _count_now(self) -> None:
        with self._lock:
            woken = self._count()
            changes = self._changes
            if changes:
                self._changes = []
        if woken is not None:
            self._wake(woken)
        if changes:
            self._report(changes)

    # -- limiter.limit_changed ---------------------------------------------------------------
    def _moved(self, cause: str, rtt: float | None) -> None:
        """The limit was set (under the lock): noted for ``limiter.limit_changed`` when it
        is at least twice, or at most half, the last one reported (never per dispatch:
        at most once per window or probe)."""
        cap = self._cap
        last = self._reported
        if cap >= 2 * last or 2 * cap <= last:
            self._reported = cap
            baseline = self._baseline if self._warm else None
            self._changes.append((cap, last, baseline, rtt, cause))

    def _report(self, changes: list[tuple[int, int, float | None, float | None, str]]) -> None:
        """Log the changes :meth:`_moved` noted (the lock released)."""
        log = _log.enabled(_log.INFO)
        if log is None:
            return
        series = _log.metric_endpoint(self)
        for limit, previous, baseline, rtt, cause in changes:
            log.info(
                _log.EVENT_LIMITER_LIMIT_CHANGED,
                limiter=self._name,
                limit=limit,
                previous=previous,
                baseline_rtt_ms=None if baseline is None else round(baseline * 1000.0, 3),
                rtt_ms=None if rtt is None else round(rtt * 1000.0, 3),
                cause=cause,
                **series,
            )

    def _count(self) -> list[Any] | None:
        """Count the pending samples into windows; the waiters a higher limit lets in."""
        pending = self._pending
        if self._probing:
            pending.clear()  # only the probe's own dispatches count (``_probed``)
            return None
        cap = self._cap
        popleft = pending.popleft
        # the window in locals: this loop runs once per sample
        n, total, least = self._window_n, self._window_sum, self._window_least
        most, drop, end = self._window_held, self._window_drop, self._window_end
        rtt = -1.0
        while pending:
            now, rtt, held = popleft()
            if rtt < 0.0:
                drop = True
            else:
                n += 1
                total += rtt
                if rtt < least:
                    least = rtt
            if held > most:
                most = held
            if now >= end and (n >= WINDOW_SAMPLES or drop):
                self._window_n, self._window_sum, self._window_least = n, total, least
                self._window_held, self._window_drop = most, drop
                self._close_window(now)  # may start a probe: the rest is not counted
                if self._probing:
                    pending.clear()
                    break
                n, total, least, most, drop = 0, 0.0, math.inf, 0, False
                end = self._window_end
        else:
            self._window_n, self._window_sum, self._window_least = n, total, least
            self._window_held, self._window_drop = most, drop
        if rtt >= 0.0:
            self._last_rtt = rtt
        if self._cap > cap and self._waiters:
            return self._settle_locked()
        return None

    def _close_window(self, now: float) -> None:
        """The window is over and holds enough samples (or a drop): update the limit."""
        n = self._window_n
        least = self._window_least
        length = 2.0 * least if least != math.inf else MIN_WINDOW
        if self._window_drop:
            # after a cut, the next verdict comes after one round trip, not the 0.1 s floor:
            # the dispatches a too-high limit let in time out together, and every 0.1 s
            # they run on feeds the breaker (rfc/0009, "Under overload")
            rtt = self._last_rtt
            length = MIN_WINDOW if rtt is None or rtt > MIN_WINDOW else rtt
            self._window_end = now + length
        else:
            self._window_end = now + (
                MIN_WINDOW if length < MIN_WINDOW else MAX_WINDOW if length > MAX_WINDOW else length
            )
        self._update(self._window_sum / n if n else 0.0, self._window_held, self._window_drop)
        self._window_n = self._window_held = 0
        self._window_sum = 0.0
        self._window_least = math.inf
        self._window_drop = False

    def _update(self, rtt: float, held: int, drop: bool) -> None:
        """Gradient2: one window's average round trip ``rtt``, most permits ``held``."""
        estimate = self._estimate
        saturated = 2 * held >= estimate  # Gradient2: not app-limited
        if drop:
            # A dispatch waited out its whole timeout: cut at once, unsmoothed (Envoy's
            # gradient floor, TCP's halving on loss). Gradient2's smoothed 0.9 per window
            # left 20 permits queueing a timeout deep at a server of 2 until the breaker
            # opened (rfc/0009, "Under overload").
            if self._warm < WARMUP:  # the warm-up measured our own queue: start it again
                self._warm = 0
                self._warm_sum = 0.0
            estimate *= MIN_GRADIENT
            if estimate < self._min:
                estimate = self._min
            self._estimate = estimate
            if int(estimate) != self._cap:
                self._resize(int(estimate))
                self._moved("drop", rtt if rtt > 0.0 else None)  # 0: only drops
            return
        else:
            warm = self._warm
            if warm < WARMUP:
                warm = self._warm = warm + 1
                self._warm_sum += rtt
                baseline = self._warm_sum / warm
                self._stale = self._stale + 1 if saturated else 0
                if warm == WARMUP and saturated:
                    # learned while the permits were in use: it may be our own queue, so
                    # it is measured once at half the concurrency, as Envoy measures its
                    # minimum RTT at start (requiring all ten windows saturated let one
                    # unsaturated first window skip it: rfc/0009, "Under overload")
                    self._baseline = baseline
                    self._probe(rtt)
                    return
            else:
                baseline = self._baseline
                if rtt <= baseline or not saturated:
                    self._stale = 0  # a window without our queue in it confirms the baseline
                else:  # may include the queue this client built
                    self._stale += 1
                    if self._stale >= PROBE_INTERVAL:
                        self._probe(rtt)
                        return
                baseline += (rtt - baseline) * _FACTOR
            if baseline > 2.0 * rtt:  # Gradient2: latency is back to normal, catch up
                baseline *= 0.95
            self._baseline = baseline
            gradient = TOLERANCE * baseline / rtt
        if gradient >= 1.0:
            if not saturated:
                return  # app-limited: no evidence the endpoint takes more
            headroom = math.sqrt(estimate)
            estimate += SMOOTHING * (headroom if headroom > MIN_HEADROOM else MIN_HEADROOM)
            if estimate > self._max:
                estimate = self._max
        else:
            if gradient < MIN_GRADIENT:
                gradient = MIN_GRADIENT
            estimate *= _KEEP + SMOOTHING * gradient
            if estimate < self._min:
                estimate = self._min
        self._estimate = estimate
        if int(estimate) != self._cap:
            self._resize(int(estimate))
            self._moved("gradient", rtt)

    def _probe(self, rtt: float) -> None:
        """Re-measure the baseline: the limit is held at half while ``PROBE_SAMPLES``
        dispatches let through at that concurrency go out and all come back."""
        self._stale = 0
        self._probing = True
        self._before = self._estimate
        self._probe_out = self._probe_open = self._probe_n = 0
        self._probe_sum = 0.0
        half = int(self._estimate / 2)
        self._probe_at(half if half > self._min else self._min, rtt)

    def _probe_at(self, cap: int, rtt: float | None) -> None:
        """Hold the limit at ``cap`` for the probe's dispatches: 10 per permit, up to 50
        (at a limit of 1, fifty round trips one at a time left the endpoint half idle
        for half a second at 100/s: rfc/0009, "Under overload")."""
        samples = PROBE_PER_PERMIT * cap
        self._probe_samples = samples if samples < PROBE_SAMPLES else PROBE_SAMPLES
        self._resize(cap)
        self._moved("probe", rtt)

    def _tag(self) -> bool:
        """A dispatch let through while probing: is it one of the probe's?"""
        if self._probe_out < self._probe_samples:
            self._probe_out += 1
            self._probe_open += 1
            return True
        return False

    def _probed(self, rtt: float, outcome: int) -> list[Any] | None:
        """One of the probe's dispatches ended; the last one ends the probe.

        The average is over every one of them that was answered, slow ones included:
        ending at the first ``PROBE_SAMPLES`` to come back would measure the fast ones
        only. A timeout or a deadline's cut (a drop) is no round trip: its time is how
        long the caller waited, not the endpoint's latency (one 1 s timeout among 50
        probe dispatches tripled a 10 ms baseline; cuts at 0.5 ms pulled it down).
        """
        self._probe_open -= 1
        if outcome == _SAMPLE and 0.0 < rtt < math.inf:
            self._probe_sum += rtt
            self._probe_n += 1
        if self._probe_open or self._probe_out < self._probe_samples:
            return None
        measured = None
        if self._probe_n:
            baseline = measured = self._probe_sum / self._probe_n
            old = self._baseline
            lower = baseline < PROBE_AGAIN * old
            self._baseline = baseline
            if lower and old > 0.0:
                # The limit was learned against a baseline holding our own queue: by
                # Little's law it is too high by as much (the same throughput at the
                # lower latency needs that many fewer permits).
                scaled = self._before * baseline / old
                self._before = scaled if scaled > self._min else float(self._min)
            if lower and self._cap > self._min:
                # the old baseline held a queue: there may be more of it at half as much
                self._probe_out = self._probe_open = self._probe_n = 0
                self._probe_sum = 0.0
                half = self._cap // 2
                self._probe_at(half if half > self._min else self._min, baseline)
                return None
        self._probing = False
        self._estimate = self._before
        self._resize(int(self._before))
        self._moved("probe_end", measured)
        self._pending.clear()  # what ended during the probe says nothing
        self._window_end = -math.inf  # a fresh window from the next sample
        self._window_n = self._window_held = 0
        self._window_sum = 0.0
        self._window_least = math.inf
        self._window_drop = False
        return self._settle_locked() if self._waiters else None


class AdaptivePermit:
    """One dispatch's permit: what ``guard()``'s and ``acquire()``'s objects share.

    Unlike :class:`ConcurrencyLimiter`'s one shared guard, each call of ``guard()`` or
    ``acquire()`` builds one of these: it times its dispatch. The common path takes
    no lock: a token popped on enter, appended on exit, and the round trip appended to
    the limiter's pending samples, counted by whoever next finds a window over or
    ``PENDING`` samples waiting.

    Its state: ``_free`` is there while no dispatch uses the object. The enter that
    claims it deletes it, one step (CPython deletes a slot at once, or fails if it is
    gone), so a second enter while it is in use (a ``guard()`` kept and shared by
    overlapping dispatches) is refused with a RuntimeError and takes nothing, rather
    than overwriting the first one's state and leaking its permit; the exit puts it
    back, and the object may be entered again. ``_held`` is 0 unless a permit is
    held: then the permits in flight when it was taken, this one included, negative
    for one of a probe's. ``_start`` is when the dispatch started.
    """

    __slots__ = ("_free", "_held", "_limiter", "_start")

    _limiter: AdaptiveConcurrencyLimiter
    _free: bool
    _held: int
    _start: float

    def _in_use(self, usage: str) -> RuntimeError:
        """The error of a second enter while the object is in use (``usage``: the fix)."""
        name = self._limiter._name
        label = f" {name!r}" if name else ""
        return RuntimeError(
            f"AdaptiveConcurrencyLimiter{label}: this permit object is in use by another "
            f"dispatch: write `{usage}` around each dispatch, a new object each time "
            "(unlike ConcurrencyLimiter's shared guard, it times one dispatch); "
            "nothing was taken"
        )

    def _take_slow(self) -> bool:
        """A permit while a debt is owed or a probe runs (under the lock)."""
        limiter = self._limiter
        with limiter._lock:
            if not limiter._take_locked():
                return False
            self._hold_locked()
        return True

    def _hold_locked(self) -> None:
        limiter = self._limiter
        held = limiter._cap + limiter._debt - len(limiter._tokens)
        held = held if held > 0 else 1
        self._held = -held if limiter._probing and limiter._tag() else held

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """The dispatch ended: give the permit back and count its round trip."""
        held = self._held
        if not held:
            return  # holds no permit: never entered, or its block ended already
        if exc is not None or held < 0:
            try:
                self._end(exc, held)
            finally:
                self._free = True
            return
        # an answer (the common case), written out: this runs once per dispatch
        self._held = 0
        limiter = self._limiter
        start = self._start
        self._free = True  # its state read: the object may take another dispatch
        # The permit first, then the clock: an interrupt (KeyboardInterrupt) raised by or
        # after the clock's read must not keep it for good.
        limiter._tokens.append(TOKEN)
        try:
            end = limiter._clock()
        except Exception:  # a clock that raises: no sample
            end = _NAN
        rtt = end - start
        try:
            if 0.0 < rtt < _INF:  # also refuses NaN (a broken clock)
                pending = limiter._pending
                pending.append((end, rtt, held))
                if end >= limiter._window_end or len(pending) >= PENDING:
                    limiter._count_now()
        finally:  # a log handler's interrupt in the count's report: the queue still moves
            if limiter._waiters or limiter._debt:
                limiter._settle()

    def _undo(self) -> None:
        """Give a held permit back as a dispatch that counts for nothing (its enter failed)."""
        self._end(None, self._held, ignore=True)

    def _end(self, exc: BaseException | None, held: int, ignore: bool = False) -> None:
        """The exit of a dispatch that raised, or of one of a probe's; ``ignore``:
        of one that never ran."""
        if not held:
            return  # already ended
        self._held = 0
        limiter = self._limiter
        limiter._tokens.append(TOKEN)  # first: nothing below may keep the permit (see _exit)
        interrupted: BaseException | None = None
        try:
            end = limiter._clock()
            rtt = end - self._start
            outcome = _IGNORE if ignore else _SAMPLE if exc is None else _judge(exc)
        except Exception:  # a clock or an error's __cause__ that raises: no sample
            end = rtt = 0.0
            outcome = _IGNORE
        except BaseException as exc:  # an interrupt there: no sample, re-raised at the end,
            end = rtt = 0.0  # once a probe's dispatch is closed (else the probe never ends)
            outcome = _IGNORE
            interrupted = exc
        try:
            if held < 0:  # one of a probe's
                with limiter._lock:
                    woken = limiter._probed(rtt, outcome)
                    changes = limiter._changes
                    if changes:
                        limiter._changes = []
                if woken is not None:
                    limiter._wake(woken)
                if changes:
                    limiter._report(changes)
            elif outcome == _DROP and rtt >= TOLERANCE * limiter._baseline:
                # a cut after less than a tolerable round trip is the request's deadline (a
                # retry sent with little time left), not the endpoint's latency: nothing
                pending = limiter._pending
                pending.append((end, -1.0, held))
                if end >= limiter._window_end or len(pending) >= PENDING:
                    limiter._count_now()
            elif outcome == _SAMPLE and 0.0 < rtt < _INF:
                pending = limiter._pending
                pending.append((end, rtt, held))
                if end >= limiter._window_end or len(pending) >= PENDING:
                    limiter._count_now()
        finally:  # a log handler's interrupt in a report: the queue still moves
            if limiter._waiters or limiter._debt:
                limiter._settle()
        if interrupted is not None:
            raise interrupted


class AdaptiveGuard(AdaptivePermit):
    """What :meth:`AdaptiveConcurrencyLimiter.guard` returns: ``with`` only, as
    :class:`ConcurrencyLimiter`'s guard (``async with`` is a TypeError)."""

    __slots__ = ()

    def __enter__(self) -> None:
        try:
            del self._free  # claimed: an overlapping enter of this object fails here
        except AttributeError:
            raise self._in_use("with limiter.guard():") from None
        limiter = self._limiter
        try:
            self._start = limiter._clock()  # before the permit: a clock that raises takes none
            if limiter._waiters or limiter._debt or limiter._probing:
                if limiter._waiters or not self._take_slow():
                    raise limiter._full()
            else:
                tokens = limiter._tokens
                try:
                    tokens.pop()
                except IndexError:
                    raise limiter._full() from None
                held = limiter._cap - len(tokens)
                self._held = held if held > 0 else 1  # racing a falling limit: never 0
            if limiter._shedding:  # the first permit after refusals (else False)
                limiter._regained(self._undo)
        except BaseException:
            self._free = True  # refused, or its permit given back (_undo): nothing held
            raise

    __exit__ = AdaptivePermit._exit  # no frame more per dispatch


class AdaptiveAcquire(AdaptivePermit):
    """What :meth:`AdaptiveConcurrencyLimiter.acquire` returns: ``async with`` only, as
    :class:`ConcurrencyLimiter`'s (a plain ``with`` would skip the queue: a TypeError)."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        try:
            del self._free  # claimed (see AdaptivePermit), across the wait in line too
        except AttributeError:
            raise self._in_use("async with limiter.acquire():") from None
        limiter = self._limiter
        try:
            self._start = limiter._clock()
            if not limiter._waiters and not limiter._debt and not limiter._probing:
                tokens = limiter._tokens
                try:
                    tokens.pop()
                except IndexError:
                    pass
                else:
                    held = limiter._cap - len(tokens)
                    self._held = held if held > 0 else 1
                    if limiter._shedding:
                        limiter._regained(self._undo)
                    return
            elif not limiter._waiters and self._take_slow():
                if limiter._shedding:
                    limiter._regained(self._undo)
                return
            await limiter._queue()  # the permit is ours from here: no await until held
            try:
                self._start = limiter._clock()  # the round trip starts with the permit
            except BaseException:
                limiter._give_back()
                raise
            with limiter._lock:
                self._hold_locked()
        except BaseException:
            self._free = True  # refused, cut in line, or its permit given back: nothing held
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._exit(exc_type, exc, tb)


_new = object.__new__  # a permit object without an __init__ frame: one per dispatch
