"""A circuit breaker per endpoint: stop sending into a dead endpoint (see rfc/0007).

The model is Couchbase Java core-io's lazy breaker (no timer, no background task:
the state is brought up to date by whoever calls next), with two differences:
an outcome that arrives while the breaker is OPEN never extends the sleep window,
and a probe that does not report within ``canary_timeout`` counts as failed.

Intervals are half-open: a sleep window opened at ``t`` is over at
``t + sleep_window``; a counting window started at ``t`` is over at
``t + rolling_window``; a probe granted at ``t`` has run out at ``t + canary_timeout``.
A clock that steps back never stretches a window: one that started after the clock's
new reading restarts at it (as the budget stays in its newest slice).

While HALF_OPEN only the probe decides. The probe is known by the task (asyncio, trio)
or thread it was granted to: the grant puts a token in a context variable, and an
outcome reported from a context without the current token (a dispatch let through
before the trip, an expired probe) is ignored, as outcomes are while OPEN.
"""

from __future__ import annotations

import enum
import errno
import itertools
import math
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from datetime import timedelta
from types import TracebackType
from typing import Any

from . import _log
from ._callables import clock_reading, sync_callable
from ._context import AttemptEffect, describe_error
from ._duration import to_seconds
from ._errors import RetryableError, TimeoutException
from ._reason import RetryReason
from ._request import Request, dispatching
from ._retry_state import RequestState
from ._untrusted import show

__all__ = ["BreakerGuard", "CircuitBreaker", "CircuitState", "default_is_failure"]


class CircuitState(enum.Enum):
    """Where a :class:`CircuitBreaker` stands."""

    #: Dispatches go through; outcomes are counted.
    CLOSED = "closed"
    #: Dispatches are refused until the sleep window is over.
    OPEN = "open"
    #: One probe is out; every other dispatch is refused until it reports.
    HALF_OPEN = "half_open"

    def __repr__(self) -> str:
        return f"<CircuitState.{self.name}>"


_CLOSED = CircuitState.CLOSED
_OPEN = CircuitState.OPEN
_HALF_OPEN = CircuitState.HALF_OPEN

# What the default rule counts: timeouts (builtin TimeoutError; sdkcore's timeouts) and
# an endpoint that cannot be reached or went away before the reply: ConnectionError is
# refused, reset, aborted and BrokenPipeError; EOFError a stream that ended early
# (asyncio.IncompleteReadError is one). On Python 3.10 asyncio.TimeoutError is a separate
# class (from 3.11 on it is the builtin one). Classes of asyncio, anyio and trio are
# looked up in the loaded modules: an error of theirs exists only once the program
# imported them, and importing them here would cost every program its import time (and
# load asyncio into a trio or threaded one).
_FAILURES: tuple[type[BaseException], ...] = (
    TimeoutException,
    TimeoutError,
    ConnectionError,
    EOFError,
)
# OSErrors that are not ConnectionErrors but say the endpoint cannot be reached
_UNREACHABLE = frozenset(
    getattr(errno, name)
    for name in ("EHOSTUNREACH", "ENETUNREACH", "EHOSTDOWN", "ENETDOWN")
    if hasattr(errno, name)
)
# anyio's and trio's "the stream broke / was closed / ended" (EndOfStream: anyio only)
_STREAM_ERRORS = ("BrokenResourceError", "ClosedResourceError", "EndOfStream")
_stream_errors: dict[str, tuple[Any, tuple[type[BaseException], ...]]] = {}
_CAUSES = 4  # how far down ``raise ... from`` chains the default rule looks


def _lost_stream(error: BaseException, name: str) -> bool:
    module = sys.modules.get(name)
    if module is None:
        return False
    known = _stream_errors.get(name)
    if known is None or known[0] is not module:
        classes = tuple(
            cls
            for cls in (getattr(module, attr, None) for attr in _STREAM_ERRORS)
            if isinstance(cls, type) and issubclass(cls, BaseException)
        )
        if len(classes) < 2:  # a module still being imported: ask again next time
            return isinstance(error, classes)
        known = _stream_errors[name] = (module, classes)
    return isinstance(error, known[1])


def _says_down(error: BaseException) -> bool:
    if isinstance(error, _FAILURES):
        return True
    if isinstance(error, OSError):
        return error.errno in _UNREACHABLE
    if _lost_stream(error, "anyio") or _lost_stream(error, "trio"):
        return True
    if sys.version_info < (3, 11):  # pragma: no cover - exercised on 3.10 only
        asyncio = sys.modules.get("asyncio")
        return asyncio is not None and isinstance(error, asyncio.TimeoutError)
    return False


def default_is_failure(error: BaseException) -> bool:
    """The default rule: a timeout, or an endpoint that cannot be reached or went away.

    Counts as a failure:

    * a timeout: the builtin ``TimeoutError`` (also ``asyncio.TimeoutError`` and socket
      timeouts), sdkcore's ``TimeoutException`` family;
    * an endpoint that refused, reset or aborted the connection, or closed it before
      the reply: ``ConnectionError`` (``ConnectionRefusedError``,
      ``ConnectionResetError``, ``ConnectionAbortedError``, ``BrokenPipeError``),
      ``EOFError`` (``asyncio.IncompleteReadError``), an ``OSError`` whose errno says
      the host or network is unreachable or down, and anyio's and trio's
      ``BrokenResourceError``, ``ClosedResourceError`` and ``EndOfStream``;
    * an error raised from one of these (``raise RetryableError(...) from exc``: the
      ``__cause__`` chain, a few links deep).

    Anything else (a server that answers with an error) is alive: Couchbase's rule.
    """
    for _ in range(_CAUSES):
        if _says_down(error):
            return True
        cause = error.__cause__
        if cause is None:
            return False
        error = cause
    return False


# The request's deadline cut a dispatch when the cancellation leaving it arrives at the
# deadline. The door arms its scope on the event loop's clock (trio's is not
# time.monotonic) from the time left read on the request's clock, a moment earlier:
# when the scope fires, the request's clock can read a hair before the deadline
# (rounding, and time.monotonic's resolution: 15.6 ms on some Windows). A cancellation
# from elsewhere that lands within this slack of the deadline counts as the cut: both
# are the request running out of time.
_CUT_SLACK = max(0.001, time.get_clock_info("monotonic").resolution)
_NOT_A_CUT = (KeyboardInterrupt, SystemExit, GeneratorExit)
_PENDING = RequestState.PENDING


def _cut_at_deadline(request: Request | None, error: BaseException) -> TimeoutError | None:
    """The timeout ``error`` (a cancellation) stands for, if ``request``'s deadline cut it."""
    if request is None or isinstance(error, _NOT_A_CUT) or request.state is not _PENDING:
        return None  # Request.cancel() completes the request before it cuts
    if request.clock() < request.deadline - _CUT_SLACK:  # math.inf: never
        return None
    cut = TimeoutError(
        f"{request.name} (request {request.id}) was cut at its deadline "
        f"({type(error).__name__} in the dispatch)"
    )
    cut.__cause__ = error
    return cut


# The probes this task or thread holds: one token per grant (see CircuitBreaker._token).
_PROBES: ContextVar[tuple[object, ...]] = ContextVar("sdkcore_breaker_probes", default=())
_HELD = 16  # tokens kept per context: probes granted and never reported fall off


#: Reasons whose failure, unless it names its effect, means the dispatch was refused on the
#: client before anything was written. Not the terminal reasons (AUTHENTICATION_ERROR...),
#: which also default to NOT_SENT but are the endpoint's answer: it is alive.
_REFUSED_LOCALLY = frozenset(
    {
        RetryReason.CIRCUIT_BREAKER_OPEN,
        RetryReason.CONCURRENCY_LIMITED,
        RetryReason.CLIENT_THROTTLED,
        RetryReason.SOCKET_NOT_AVAILABLE,
        RetryReason.NODE_NOT_AVAILABLE,
        RetryReason.SERVICE_NOT_AVAILABLE,
    }
)


def _never_left(error: BaseException) -> bool:
    """``error`` says the dispatch never reached the endpoint: a RetryableError whose
    ``effect`` is NOT_SENT, or without an effect, whose reason is a local refusal."""
    if not isinstance(error, RetryableError):
        return False
    effect = error.effect
    if effect is None:
        return error.reason in _REFUSED_LOCALLY
    return effect is AttemptEffect.NOT_SENT


def _hold(token: object) -> None:
    _PROBES.set((*_PROBES.get()[-(_HELD - 1) :], token))


def _release(token: object) -> None:
    held = _PROBES.get()
    if token in held:
        _PROBES.set(tuple(t for t in held if t is not token))


#: The longest ``sleep_window`` and ``canary_timeout`` (rfc/0007, "Circuit breaker"): an
#: endpoint cut off for more than an hour between probes, or a probe given more than an
#: hour to answer, is no deployment's setting; it is a number in milliseconds
#: (``sleep_window=5000``: 83 minutes).
_MAX_WAIT = 3600.0


def _wait(value: object, what: str) -> float:
    """A sleep window or canary timeout in seconds: > 0 and at most :data:`_MAX_WAIT`."""
    seconds = to_seconds(value, what, allow_zero=False)
    if seconds > _MAX_WAIT:
        hint = ""
        if not isinstance(value, timedelta) and seconds / 1000.0 <= _MAX_WAIT:
            hint = (
                f" (a number of seconds; for {show(value)} milliseconds give "
                f"{seconds / 1000.0:g} or timedelta(milliseconds={show(value)}))"
            )
        raise ValueError(
            f"{what} must be > 0 and at most {_MAX_WAIT:.0f} seconds (1 hour), "
            f"got {show(value)}{hint}"
        )
    return seconds


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 1, got {show(value)} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {show(value)}")
    return int(value)


def _percentage(value: object, what: str) -> float:
    """The percentage as a float (for display); :func:`_exact` gives the rule its ratio."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} must be a number in (0, 100], got {show(value)} ({type(value).__name__})"
        )
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not 0.0 < number <= 100.0:  # also rejects NaN
        raise ValueError(f"{what} must be a number in (0, 100], got {show(value)}")
    return number


def _exact(value: float | int) -> tuple[int, int]:
    """The percentage as written, as (numerator, denominator): ``16.1`` is 161/10.

    ``fractions`` (with ``decimal``, which it imports) is imported here, when a breaker
    is made, not with sdkcore: about a tenth of ``import sdkcore``'s own time.
    """
    from fractions import Fraction

    ratio = Fraction(value) if isinstance(value, int) else Fraction(repr(float(value)))
    return ratio.numerator, ratio.denominator


class CircuitBreaker:
    """Counts the outcomes of one endpoint's dispatches and refuses dispatches while it is down.

    * CLOSED: :meth:`try_acquire` is True. Outcomes are counted in a tumbling window of
      ``rolling_window`` (it restarts at the first outcome after the window is over).
      When at least ``volume_threshold`` outcomes were counted and at least
      ``error_threshold_percentage`` percent of them are failures, the breaker opens.
    * OPEN: :meth:`try_acquire` is False until ``sleep_window`` has passed; then exactly
      one caller gets True (the probe) and the breaker turns HALF_OPEN.
    * HALF_OPEN: every caller gets False. The probe's success closes the breaker
      (counters zero); its failure, or no outcome within ``canary_timeout``, opens it
      again with a new sleep window (from the failure, or from the moment
      ``canary_timeout`` ran out). Only the probe decides: it is known by the task or
      thread it was granted to, and any other outcome (a dispatch let through before
      the trip, a probe that ran out) is ignored. To report the probe's outcome from
      another task or thread, run the report in the granted context:
      ``ctx = contextvars.copy_context()`` right after the grant, later
      ``ctx.run(breaker.record_success)``.

    ``is_failure(error)`` decides which errors count as failures (default:
    :func:`default_is_failure`: timeouts, and an endpoint refused, reset or closed
    before the reply); an error it does not count is a success. An error that is not
    an :class:`Exception` (a cancellation) is no outcome, unless it is the request's
    own deadline cutting the dispatch (see :meth:`record_failure`): then it is a
    timeout. Outcomes reported while OPEN are ignored: they never extend the sleep
    window.

    Thread-safe and loop-agnostic: one breaker per endpoint, shared by every door.
    ``name`` (e.g. ``"10.0.0.1:11210"``) is the ``endpoint`` field of the events
    ``breaker.opened``, ``breaker.half_open`` and ``breaker.closed``. ``clock``:
    monotonic seconds (default ``time.monotonic``; a test's virtual clock).
    """

    __slots__ = (
        "__weakref__",  # Telemetry.watch holds it weakly
        "_canary_timeout",
        "_clock",
        "_error_pct",
        "_error_ratio",
        "_failures",
        "_guard",
        "_is_failure",
        "_last",
        "_last_error",
        "_lock",
        "_name",
        "_opened_at",
        "_probe_at",
        "_rolling_window",
        "_sleep_window",
        "_state",
        "_telemetry",
        "_ticks",
        "_token",
        "_total",
        "_volume",
        "_window_end",
    )

    def __init__(
        self,
        *,
        volume_threshold: int = 20,
        error_threshold_percentage: float = 50,
        sleep_window: timedelta | float = timedelta(seconds=5),
        rolling_window: timedelta | float = timedelta(seconds=60),
        canary_timeout: timedelta | float = timedelta(seconds=5),
        is_failure: Callable[[BaseException], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
    ) -> None:
        what = "CircuitBreaker"
        self._volume = _positive_int(volume_threshold, f"{what}(volume_threshold)")
        self._error_pct = _percentage(
            error_threshold_percentage, f"{what}(error_threshold_percentage)"
        )
        # exact arithmetic (rfc/0007): trip when failures * 100 * d >= n * outcomes
        numerator, denominator = _exact(error_threshold_percentage)
        self._error_ratio = (numerator, 100 * denominator)
        self._sleep_window = _wait(sleep_window, f"{what}(sleep_window)")
        self._rolling_window = to_seconds(
            rolling_window, f"{what}(rolling_window)", allow_zero=False
        )
        self._canary_timeout = _wait(canary_timeout, f"{what}(canary_timeout)")
        sync_callable(is_failure, f"{what}(is_failure)", "(error) -> bool", optional=True)
        sync_callable(clock, f"{what}(clock)", "() -> seconds")
        clock_reading(clock, f"{what}(clock)")  # a clock that returns no seconds: here
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{what}(name) must be a str or None, got {name!r}")
        self._is_failure = default_is_failure if is_failure is None else is_failure
        self._clock = clock
        self._name = name
        self._lock = threading.Lock()
        # guard()'s context manager holds nothing but this breaker: one, shared by every
        # dispatch (saves an allocation per call: bench/README "bench_protect.py")
        self._guard = BreakerGuard(self)
        self._state = _CLOSED
        self._total = 0
        self._failures = 0
        self._window_end = -float("inf")  # the first outcome starts a window
        self._opened_at = 0.0  # start of the current sleep window (OPEN)
        self._probe_at = 0.0  # when the probe was granted (HALF_OPEN)
        # The current probe's token (HALF_OPEN), also held in the _PROBES context variable
        # of the task or thread it was granted to: only an outcome from there decides.
        self._token: object | None = None
        # Successes while CLOSED with no failure in the window are counted by an
        # itertools.count (atomic in CPython: no lock on the hot path); the lock holder
        # adds them to _total (see _flush).
        self._ticks = itertools.count()
        self._last = next(self._ticks)
        # The last failure counted, as "Type: message" (the events' last_error): described
        # when counted, outside the lock; the error itself is not kept (its traceback
        # holds the frames of the dispatch, which may hold this breaker).
        self._last_error: str | None = None
        self._telemetry: Any = None  # set by Telemetry.watch

    # -- configuration and diagnostics -------------------------------------------
    @property
    def name(self) -> str | None:
        return self._name

    @property
    def sleep_window(self) -> timedelta:
        return timedelta(seconds=self._sleep_window)

    @property
    def canary_timeout(self) -> timedelta:
        return timedelta(seconds=self._canary_timeout)

    @property
    def state(self) -> CircuitState:
        """The current state (a HALF_OPEN past ``canary_timeout`` reads OPEN)."""
        state = self._state
        if state is _HALF_OPEN:
            with self._lock:
                event = self._expire_probe(self._now())
                state = self._state
            if event is not None:
                _emit(*event)
        return state

    @property
    def counts(self) -> tuple[int, int]:
        """``(outcomes, failures)`` counted in the current window (zero after closing)."""
        with self._lock:
            self._flush()
            return self._total, self._failures

    def probe_after(self) -> float | None:
        """Seconds until a probe may go (0 if it may go now); None while CLOSED.

        While HALF_OPEN: the time until ``canary_timeout`` runs out plus a sleep
        window, the earliest a new probe can go if this one never reports.
        """
        with self._lock:
            now = self._now()
            event = self._expire_probe(now)
            state = self._state
            if state is _CLOSED:
                left = None
            elif state is _OPEN:
                left = max(0.0, self._opened_at + self._sleep_window - now)
            elif self._token is None:  # the probe was cancelled: the next dispatch probes
                left = 0.0
            else:
                left = self._probe_at + self._canary_timeout + self._sleep_window - now
        if event is not None:
            _emit(*event)
        return left

    def __repr__(self) -> str:
        label = "" if self._name is None else f" {self._name!r}"
        outcomes, failures = self.counts
        return f"<CircuitBreaker{label} {self._state.name} outcomes={outcomes} failures={failures}>"

    # -- the dispatch side -------------------------------------------------------
    def try_acquire(self) -> bool:
        """May a dispatch go now? True while CLOSED, and for the one probe after a sleep window."""
        if self._state is _CLOSED:  # one attribute read: the hot path takes no lock
            return True
        return self._admit_slow() is not None

    def admit(self) -> CircuitState | None:
        """:meth:`try_acquire` that also says whether this dispatch is the probe.

        None: refused. ``CircuitState.CLOSED``: go, an ordinary dispatch.
        ``CircuitState.HALF_OPEN``: go, this dispatch is the probe; its outcome (or a
        cheap canary's, sent first, e.g. a NOOP) decides whether the breaker closes.
        """
        if self._state is _CLOSED:
            return _CLOSED
        return self._admit_slow()

    def _admit_slow(self) -> CircuitState | None:
        events: list[tuple[Any, ...]] = []
        with self._lock:
            state = self._state
            if state is _CLOSED:  # closed meanwhile
                return _CLOSED
            now = self._now()
            expired = self._expire_probe(now)
            if expired is not None:
                events.append(expired)
            half_open = self._state is _HALF_OPEN
            if half_open:
                busy = self._token is not None  # a probe is out
            else:
                busy = now < self._opened_at + self._sleep_window  # still sleeping
            if busy:
                granted = token = None
            else:  # the probe goes (again, after a probe cancelled without an outcome)
                self._state = _HALF_OPEN
                self._probe_at = now
                self._token = token = object()
                granted = _HALF_OPEN
                if not half_open:
                    events.append(
                        self._event(_log.EVENT_BREAKER_HALF_OPEN, _log.INFO, self._tripped({}))
                    )
        if token is not None:
            _hold(token)  # this task or thread holds the probe
        try:
            for event in events:
                _emit(*event)
        except BaseException:  # a log handler that raised: the probe was granted, not sent
            if token is not None:
                self._probe_cancelled()  # free for the next dispatch, as a cancelled probe
            raise
        if granted is None:
            # Counted here, whichever way the dispatch asked (guard, admit, try_acquire).
            telemetry = self._telemetry
            if telemetry is not None:
                telemetry.breaker_rejected(self)
        return granted

    def guard(self, request: Request | None = None) -> BreakerGuard:
        """The one line that guards a dispatch: ``with breaker.guard(): reply = await io()``.

        Refused (OPEN, or a probe already out): raises ``RetryableError(
        CIRCUIT_BREAKER_OPEN)`` before anything is written, so the attempt is
        unambiguous. OPEN: its ``retry_after`` is the seconds until a probe may go, and
        BestEffort waits for the probe (never past the deadline); HALF_OPEN with the probe
        out: no ``retry_after`` (when the probe ends is unknown), the strategy's backoff.
        Let through: the ``with`` block's outcome is reported (an exception through
        :meth:`record_failure`, else :meth:`record_success`); ``as`` gives the admitted state
        (``CircuitState.HALF_OPEN``: this dispatch is the probe).

        A block cut by its request's deadline is a timeout (a failure by the default
        rule); a cancellation from elsewhere is no outcome. Inside ``execute``,
        ``execute_sync`` and ``attempt(request)`` the breaker knows the request; a loop
        that bounds its dispatch by other means (``anyio.fail_after(...)``) passes it:
        ``breaker.guard(request)``.
        """
        if request is None:
            return self._guard  # one object shared by every dispatch: no allocation
        if not isinstance(request, Request):
            raise TypeError(
                "CircuitBreaker.guard(request) must be a sdkcore.Request or None, "
                f"got {show(request)} ({type(request).__name__})"
            )
        return BreakerGuard(self, request)

    # -- outcomes -----------------------------------------------------------------
    def record_success(self) -> None:
        """A dispatch that was let through got an answer."""
        if self._state is _CLOSED and not self._failures and self._clock() < self._window_end:
            next(self._ticks)  # the hot path: no failure to weigh, one atomic count
            return
        self._record(False)

    def record_failure(self, error: BaseException) -> None:
        """A dispatch that was let through failed with ``error``.

        ``is_failure(error)`` decides whether it counts as a failure; if not, it is a
        success. An error that is not an :class:`Exception` (a cancellation, e.g.
        ``asyncio.CancelledError``) is no outcome, except when the request a door is
        sending in this task or thread (``execute``, ``execute_sync``, ``attempt``)
        has reached its deadline: the deadline cut the dispatch, and that is a timeout
        (``is_failure`` is asked about a ``TimeoutError`` whose ``__cause__`` is the
        cancellation). While HALF_OPEN only the probe's task or thread reports.
        """
        if not isinstance(error, BaseException):
            raise TypeError(
                f"CircuitBreaker.record_failure(error) must be an exception, got {error!r}"
            )
        if not isinstance(error, Exception):
            cut = _cut_at_deadline(dispatching(), error)
            if cut is None:
                if self._state is _HALF_OPEN:
                    self._probe_cancelled()
                return
            error = cut
        if not self._is_failure(error):
            if _never_left(error):
                # Nothing reached the endpoint (an inner breaker's or a limiter's refusal, a
                # connection that was never tried): no outcome, as a cancellation. Counted a
                # success, a probe that never left closed the breaker (rfc/0007).
                if self._state is _HALF_OPEN:
                    self._probe_cancelled()
                return
            self._record(False)
        elif self._state is _OPEN:
            self._record(True)  # ignored while OPEN: not described
        else:
            self._record(True, describe_error(error))

    def _record(self, failed: bool, error: str | None = None) -> None:
        """Count an outcome; ``error``: the failure described (the events' ``last_error``)."""
        with self._lock:
            now = self._now()
            if self._state is _CLOSED:
                if failed:
                    self._last_error = error
                self._flush()
                if now >= self._window_end:  # tumbling: this event starts a new window
                    self._window_end = now + self._rolling_window
                    self._total = self._failures = 0
                self._total += 1
                if failed:
                    self._failures += 1
                event = (
                    self._maybe_trip(now)
                    if self._failures and self._total >= self._volume
                    else None
                )
            else:
                event = self._outcome_not_closed(now, failed, error)
        if event is not None:
            _emit(*event)

    def _now(self) -> float:
        """The clock, under the lock; a window it reads as not begun yet restarts now.

        A clock that stepped back (a fake one, a wall clock) must not stretch a sleep
        window, a probe's ``canary_timeout`` or a counting window by the step: each
        lasts its own length from the clock's new reading (the counts stay).
        """
        now = self._clock()
        if now < self._opened_at:
            self._opened_at = now
        if now < self._probe_at:
            self._probe_at = now
        if now < self._window_end - self._rolling_window:
            self._window_end = now + self._rolling_window
        return now

    def _flush(self) -> None:
        """Add the lock-free successes to ``_total`` (under the lock)."""
        tick = next(self._ticks)
        self._total += tick - self._last - 1
        self._last = tick

    def reset(self) -> None:
        """Back to CLOSED with counters zero (an endpoint calls it when it reconnects)."""
        with self._lock:
            was = self._state
            self._flush()
            event = (
                None
                if was is _CLOSED
                else self._event(
                    _log.EVENT_BREAKER_CLOSED, _log.INFO, self._tripped({"cause": "reset"})
                )
            )
            self._state = _CLOSED
            self._total = self._failures = 0
            self._last_error = None
            self._window_end = -float("inf")
            self._token = None  # a probe still out reports into CLOSED: counted
        if event is not None:
            _emit(*event)

    # -- transitions (called under the lock) ---------------------------------------
    def _maybe_trip(self, now: float) -> tuple[Any, ...] | None:
        numerator, denominator = self._error_ratio
        if self._failures * denominator < numerator * self._total:
            return None
        self._state = _OPEN
        self._opened_at = now
        return self._event(
            _log.EVENT_BREAKER_OPENED,
            _log.WARNING,
            {
                "outcomes": self._total,
                "failures": self._failures,
                "cause": "threshold",
                "sleep_window_s": self._sleep_window,
            },
        )

    def _outcome_not_closed(
        self, now: float, failed: bool, error: str | None
    ) -> tuple[Any, ...] | None:
        event = self._expire_probe(now)
        if self._state is not _HALF_OPEN:
            return event  # OPEN: a late outcome changes nothing
        token = self._token
        if token not in _PROBES.get():
            return None  # not the probe: a dispatch let through before the trip, or an old probe
        self._token = None
        _release(token)
        if failed:
            self._state = _OPEN
            self._opened_at = now
            self._last_error = error
            # The outage goes on: its start was the trip's warning (a failed probe every
            # sleep window would repeat it all through an outage).
            return self._event(
                _log.EVENT_BREAKER_OPENED,
                _log.INFO,
                self._tripped({"cause": "probe_failed", "sleep_window_s": self._sleep_window}),
            )
        self._flush()
        fields = self._tripped({"cause": "probe_succeeded"})
        event = self._event(_log.EVENT_BREAKER_CLOSED, _log.INFO, fields)
        self._state = _CLOSED
        self._total = self._failures = 0
        self._last_error = None
        self._window_end = -float("inf")
        return event

    def _probe_cancelled(self) -> None:
        """The probe's dispatch was cancelled from elsewhere (a hedge copy that lost, the
        caller's own cancellation): no outcome. The probe is free again for the next
        dispatch; held, it cut the endpoint off until ``canary_timeout``, then reopened
        the breaker for a timeout that never happened."""
        with self._lock:
            token = self._token
            if self._state is _HALF_OPEN and token is not None and token in _PROBES.get():
                self._token = None
                _release(token)

    def _expire_probe(self, now: float) -> tuple[Any, ...] | None:
        if self._state is not _HALF_OPEN or self._token is None:
            return None
        ran_out = self._probe_at + self._canary_timeout
        if now < ran_out:
            return None
        self._state = _OPEN
        self._opened_at = ran_out
        self._token = None  # its late outcome no longer decides
        return self._event(
            _log.EVENT_BREAKER_OPENED,
            _log.INFO,  # the outage goes on, as after a failed probe
            self._tripped(
                {
                    "cause": "canary_timeout",
                    "canary_timeout_s": self._canary_timeout,
                    "sleep_window_s": self._sleep_window,
                }
            ),
        )

    def _tripped(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` after the counts of the window that opened the breaker.

        Every transition after the trip (the probe out, its failure or success, a
        canary timeout, a reset) comes when the window has stopped counting: its counts
        are the trip's, named ``trip_outcomes`` and ``trip_failures`` so that they are
        not read as the endpoint's current failure rate (the trip itself, cause
        ``threshold``, names them ``outcomes`` and ``failures``).
        """
        return {"trip_outcomes": self._total, "trip_failures": self._failures, **fields}

    def _event(self, name: str, level: int, fields: dict[str, Any]) -> tuple[Any, ...]:
        """A transition's log event (every caller changes the state: it is reported too).

        ``fields`` carry the counts (see :meth:`_tripped`); ``last_error`` is added: the
        last failure counted (the one that tripped the breaker, or the failed probe's),
        ``"Type: message"``, None if none was.
        """
        telemetry = self._telemetry
        if telemetry is not None:
            telemetry.breaker_transition(self, _NEW_STATE[name])
        return (
            name,
            level,
            {
                "endpoint": self._name,
                **fields,
                "last_error": self._last_error,
                **_log.metric_endpoint(self),
            },
        )


#: The state a transition event announces (telemetry's ``sdkcore.circuit_breaker.state``).
_NEW_STATE = {
    _log.EVENT_BREAKER_OPENED: "open",
    _log.EVENT_BREAKER_HALF_OPEN: "half_open",
    _log.EVENT_BREAKER_CLOSED: "closed",
}


class BreakerGuard:
    """What :meth:`CircuitBreaker.guard` returns: admit on enter, report on exit.

    A plain class rather than ``contextlib.contextmanager``: it runs on every
    dispatch: bench/bench_protect.py measures 0.48 us for the guard and the budget's
    deposit, against 1.31 us with a ``contextlib.contextmanager`` guard.

    It keeps no state of a dispatch (``guard()`` hands every dispatch the same one;
    the probe is known by its context, see :class:`CircuitBreaker`), only the
    ``request`` given to ``guard(request)``, whose deadline tells a cut from a
    cancellation.
    """

    __slots__ = ("_breaker", "_request")

    def __init__(self, breaker: CircuitBreaker, request: Request | None = None) -> None:
        self._breaker = breaker
        self._request = request

    def __enter__(self) -> CircuitState:
        breaker = self._breaker
        admitted = breaker.admit()
        if admitted is None:  # (counted by admit for the telemetry)
            # OPEN: the next chance is the end of the sleep window. HALF_OPEN: another
            # dispatch is the probe and will usually answer soon: no hint, the
            # strategy's own backoff polls for the breaker closing.
            wait = breaker.probe_after() if breaker.state is _OPEN else None
            label = "" if breaker.name is None else f" {breaker.name}"
            # the failure that opened it (or failed its probe): what an operator reading
            # the refusal, in a timeout's cause, needs (read without the lock: a message)
            last = breaker._last_error
            why = "" if last is None else f" (last failure: {last})"
            raise RetryableError(
                RetryReason.CIRCUIT_BREAKER_OPEN,
                f"circuit breaker{label} is {breaker.state.name}{why}: nothing was sent",
                retry_after=wait,
            )
        return admitted

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self._breaker.record_success()
        elif self._request is None or isinstance(exc, Exception):
            self._breaker.record_failure(exc)  # a door's request is found there
        else:
            cut = _cut_at_deadline(self._request, exc)
            self._breaker.record_failure(exc if cut is None else cut)


def _emit(name: str, level: int, fields: dict[str, Any]) -> None:
    log = _log.enabled(level)
    if log is not None:
        getattr(log, "warning" if level >= _log.WARNING else "info")(name, **fields)
