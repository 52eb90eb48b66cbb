"""Client-side throttling, as Google SRE's "Handling Overload" chapter describes it.

Over a sliding window the throttle counts ``requests`` (every request the application
made through it, those it refused itself included) and ``accepts`` (those the backend
accepted), and refuses a new request locally with probability
``max(0, (requests - k * accepts) / (requests + 1))``. See rfc/0009, "Client-side
throttling".
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

from . import _log
from ._callables import clock_reading, slice_of, sync_callable
from ._context import AttemptEffect
from ._duration import to_seconds
from ._errors import (
    QuotaLimitedException,
    RateLimitedException,
    RetryableError,
    TemporaryFailureException,
    sent_nothing,
)
from ._log import EVENT_THROTTLE_RECOVERED, EVENT_THROTTLE_REFUSING
from ._reason import RetryReason
from ._untrusted import count, show

__all__ = [
    "EVENT_THROTTLE_RECOVERED",
    "EVENT_THROTTLE_REFUSING",
    "REFUSAL_REASON",
    "AdaptiveThrottle",
    "ThrottleGuard",
    "default_is_rejection",
]

# Its events, throttle.refusing and throttle.recovered: in sdkcore._log with every other.

#: The reason of a local refusal (rfc/0009: allows non-idempotent retry, not always
#: retried, not after dispatch).
REFUSAL_REASON = RetryReason.CLIENT_THROTTLED

_SLICES = 10  # the window moves by a tenth of itself
_CAUSES = 4  # how far down ``raise ... from`` chains the default rule looks
_MIN_WINDOW = 1.0
_MAX_WINDOW = 86400.0
_NOT_SENT = AttemptEffect.NOT_SENT

# Answers by which a backend says it is overloaded or limits this client.
_OVERLOAD_REASONS = frozenset(
    {RetryReason.KV_TEMPORARY_FAILURE, RetryReason.SEARCH_TOO_MANY_REQUESTS}
)
_OVERLOAD_ERRORS = (RateLimitedException, QuotaLimitedException, TemporaryFailureException)
_OVERLOAD_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE", 8, 14})


def _grpc_code(error: BaseException) -> object:
    """The status of a gRPC error (``grpc.aio.AioRpcError`` and its kind), duck-typed.

    ``error.code()`` gives a ``grpc.StatusCode`` (its name) or a number; None for an
    error without a callable ``code`` (or one that raises).
    """
    code = getattr(error, "code", None)
    if not callable(code):
        return None
    try:
        status = code()
    except Exception:
        return None
    name = getattr(status, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(status, int) and not isinstance(status, bool):
        return status
    return None


def default_is_rejection(error: BaseException) -> bool:
    """The default rule: the backend answered that it is overloaded or limits this client.

    Not accepted (a rejection):

    * ``RetryableError`` with ``KV_TEMPORARY_FAILURE`` (KV TMPFAIL and BUSY) or
      ``SEARCH_TOO_MANY_REQUESTS`` (HTTP 429), or ``SERVICE_NOT_AVAILABLE`` from an
      attempt that was sent (gRPC UNAVAILABLE as ``sdkcore.mapping.grpc_failure`` maps it);
    * sdkcore's ``RateLimitedException``, ``QuotaLimitedException`` (Couchbase rate and
      quota limits, gRPC RESOURCE_EXHAUSTED as mapped) and ``TemporaryFailureException``;
    * a gRPC error (an object with ``code()``, such as ``grpc.aio.AioRpcError``) whose
      status is ``RESOURCE_EXHAUSTED`` or ``UNAVAILABLE``;
    * an error raised from one of these (the ``__cause__`` chain, a few links deep).

    A ``RetryableError`` whose effect is ``NOT_SENT`` is never a rejection: the backend
    was not asked. Anything else is an accept: the backend took the request and answered
    (a missing document, a timeout). Timeouts are not rejections: pass
    ``is_rejection=lambda e: default_is_rejection(e) or isinstance(e, TimeoutError)`` to
    count them.
    """
    if sent_nothing(error):
        return False
    for _ in range(_CAUSES):
        if isinstance(error, RetryableError):
            reason = error.reason
            if reason in _OVERLOAD_REASONS or reason is RetryReason.SERVICE_NOT_AVAILABLE:
                return True
        elif isinstance(error, _OVERLOAD_ERRORS):
            return True
        else:
            code = _grpc_code(error)
            if code is not None:
                return code in _OVERLOAD_CODES
        cause = error.__cause__
        if cause is None:
            return False
        error = cause
    return False


class AdaptiveThrottle:
    """Refuses requests locally while the backend rejects them (Google SRE, K = ``k``).

    * ``k``: how many requests per accept the client may send before it refuses some
      (the SRE book's K: 2 by default; >= 1, lower is more aggressive).
    * ``window``: how long requests and accepts are remembered (1 s to 1 day; the book
      keeps two minutes). They leave in tenths: after between 0.9 and 1 ``window``.
    * ``name``: names the throttle in refusals and events (e.g. the endpoint).
    * ``clock``: seconds, monotonic (default ``time.monotonic``).
    * ``random``: a callable returning a float in [0, 1) (default ``random.random``);
      a request is refused when it returns less than :attr:`rejection_probability`.
    * ``is_rejection``: ``(error) -> bool``, whether a failure means the backend did not
      accept the request (default :func:`default_is_rejection`: overload answers).

    ``with throttle.guard(): reply = await send()`` admits or refuses the request, then
    records its outcome. Refused: ``RetryableError(REFUSAL_REASON, effect=NOT_SENT)``
    before anything is sent, counted as a request. Admitted and ended
    without error: a request and an accept. Ended with an :class:`Exception`: a request,
    and an accept unless ``is_rejection`` says otherwise; a ``RetryableError`` that says
    nothing was sent (``NOT_SENT``: another guard refused it) records nothing. A
    cancellation (an error that is not an :class:`Exception`) records nothing.

    Events: ``throttle.refusing`` (warning) at the first refusal of an episode, and
    ``throttle.recovered`` (the requests refused in it, how long it lasted) from the
    first :meth:`admit` after it that finds the rejection probability back at zero.

    Thread-safe and loop-agnostic; fixed memory (ten slices of counts); an admission and
    a success take no lock while nothing has been rejected in the window.
    """

    __slots__ = (
        "__weakref__",  # telemetry may hold it weakly, as it does breakers and budgets
        "_acc_slices",
        "_accepts",
        "_clock",
        "_excess",
        "_guard",
        "_index",
        "_is_rejection",
        "_k",
        "_last",
        "_lock",
        "_name",
        "_per_slice",
        "_quiet",
        "_random",
        "_refused",
        "_refusing",
        "_req_slices",
        "_requests",
        "_shed_refused",
        "_shed_since",
        "_slice_end",
        "_ticks",
        "_window",
    )

    def __init__(
        self,
        k: float = 2.0,
        *,
        window: timedelta | float = timedelta(minutes=2),
        name: str = "",
        clock: Callable[[], float] | None = None,
        random: Callable[[], float] | None = None,
        is_rejection: Callable[[BaseException], bool] | None = None,
    ) -> None:
        what = "AdaptiveThrottle"
        if isinstance(k, bool) or not isinstance(k, (int, float)):
            raise TypeError(
                f"{what}(k) must be an int or float >= 1 (requests per accept; the SRE book "
                f"uses 2), got {show(k)} ({type(k).__name__})"
            )
        try:
            factor = float(k)
        except OverflowError:
            factor = math.inf
        if not (1.0 <= factor < math.inf):  # NaN fails too
            raise ValueError(
                f"{what}(k) must be a finite number >= 1 (requests per accept; the SRE book "
                f"uses 2; lower refuses more), got {show(k)}"
            )
        seconds = to_seconds(window, f"{what}(window)")
        if not _MIN_WINDOW <= seconds <= _MAX_WINDOW:
            raise ValueError(
                f"{what}(window) must be between 1 second and 1 day (the SRE book keeps 2 "
                f"minutes), got {show(window)}"
            )
        if not isinstance(name, str):
            raise TypeError(f"{what}(name) must be a str, got {show(name)} ({type(name).__name__})")
        sync_callable(clock, f"{what}(clock)", "() -> seconds", optional=True)
        if clock is None:
            clock = time.monotonic
        sync_callable(random, f"{what}(random)", "() -> a float in [0, 1)", optional=True)
        sync_callable(is_rejection, f"{what}(is_rejection)", "(error) -> bool", optional=True)
        if random is None:
            import random as stdlib_random  # on first use: `import sdkcore` does not load it

            random = stdlib_random.random
        self._k = factor
        self._window = seconds
        self._name = name
        self._clock = clock
        self._random = random
        self._is_rejection = default_is_rejection if is_rejection is None else is_rejection
        self._lock = threading.Lock()
        self._guard = ThrottleGuard(self)
        self._per_slice = _SLICES / seconds  # slice number = floor(now * per_slice)
        self._req_slices = [0] * _SLICES
        self._acc_slices = [0] * _SLICES
        self._requests = 0  # in the window, the lock-free successes of this slice aside
        self._accepts = 0
        # requests - k * accepts over the counted events: <= 0 means nothing is refused
        # (and lock-free successes only lower it), the admission's fast path.
        self._excess = 0.0
        # excess <= 0 and no episode of refusals to end: admit()'s fast path reads only this
        self._quiet = True
        self._index = math.floor(clock_reading(clock, f"{what}(clock)") * self._per_slice)
        self._slice_end = (self._index + 1) / self._per_slice
        # Successes in the current slice are counted by an itertools.count (atomic in
        # CPython: no lock); the lock holder adds them in (see _catch_up).
        self._ticks = itertools.count()
        self._last = next(self._ticks)
        self._refused = 0
        # An episode: from a refusal to the next admit() that finds the rejection
        # probability zero. Its first refusal logs throttle.refusing, its end
        # throttle.recovered (the refusals since ``_shed_refused``, the time since
        # ``_shed_since``); ``_quiet`` stays False until the end is logged.
        self._refusing = False
        self._shed_since = 0.0
        self._shed_refused = 0

    # -- configuration and gauges ------------------------------------------------------
    @property
    def k(self) -> float:
        return self._k

    @property
    def window(self) -> timedelta:
        return timedelta(seconds=self._window)

    @property
    def name(self) -> str:
        return self._name

    @property
    def requests(self) -> int:
        """Requests in the window (local refusals included)."""
        return self._counts()[0]

    @property
    def accepts(self) -> int:
        """Requests the backend accepted, in the window."""
        return self._counts()[1]

    @property
    def refused(self) -> int:
        """How many requests this throttle refused since it was made (a counter)."""
        return self._refused

    @property
    def rejection_probability(self) -> float:
        """``max(0, (requests - k * accepts) / (requests + 1))`` over the window now."""
        requests, accepts = self._counts()
        return max(0.0, (requests - self._k * accepts) / (requests + 1))

    def _counts(self) -> tuple[int, int]:
        index = slice_of(self._clock(), self._per_slice)
        with self._lock:
            if index is not None:  # a reading with no window (NaN, inf): the counts as they are
                self._catch_up(index)
            return self._requests, self._accepts

    def guard(self) -> ThrottleGuard:
        """``with throttle.guard(): reply = await send()``: admit or refuse, then record.

        Refused: raises ``RetryableError(REFUSAL_REASON, effect=NOT_SENT)`` before the
        block runs. The same guard object serves every request.
        """
        return self._guard

    def admit(self) -> bool:
        """True: send the request (then report it with :meth:`record_success` or
        :meth:`record_failure`). False: it is refused, and counted as a request."""
        now = self._clock()
        if self._quiet and now < self._slice_end:
            return True  # the hot path: nothing to refuse in this slice
        return self._admit(now)

    def _admit(self, now: float) -> bool:
        index = slice_of(now, self._per_slice)
        if index is None:
            return True  # a clock reading NaN or an infinity: no window to judge by
        with self._lock:
            self._catch_up(index)
            requests = self._requests
            excess = self._excess
            ended = excess <= 0.0 and self._refusing
            if ended:  # the first admission with nothing to refuse ends the episode
                self._refusing = False
                self._quiet = True
                refused = self._refused - self._shed_refused
                since = self._shed_since
        if excess <= 0.0:
            if ended:
                log = _log.enabled(_log.INFO)
                if log is not None:
                    log.info(
                        EVENT_THROTTLE_RECOVERED,
                        throttle=self._name,
                        refused=refused,
                        duration_ms=_log.duration_ms(since, now),
                        **_log.metric_endpoint(self),
                    )
            return True
        probability = excess / (requests + 1)
        if self._random() >= probability:  # user code: outside the lock
            return True
        with self._lock:
            self._catch_up(index)
            self._add(accepted=False)
            first = not self._refusing
            if first:  # an episode starts
                self._refusing = True
                self._quiet = False
                self._shed_since = now
                self._shed_refused = self._refused
            self._refused += 1
        if first:  # an episode starts: a warning, as a breaker opening (rfc/0001, "Levels")
            log = _log.enabled(_log.WARNING)
            if log is not None:
                log.warning(
                    EVENT_THROTTLE_REFUSING,
                    throttle=self._name,
                    rejection_probability=round(probability, 4),
                    requests=requests,
                    accepts=self._accepts,
                    k=self._k,
                    **_log.metric_endpoint(self),
                )
        return False

    def refusal(self) -> RetryableError:
        """The error a refused request raises (what :meth:`guard` raises).

        Its message gives the numbers behind the refusal, read now (the refused request
        counted): the rejection probability, the requests and accepts in the window, the
        window's length and ``k``. Read only here, when a request is refused: an
        admission never builds it.
        """
        label = f" {self._name}" if self._name else ""
        requests, accepts = self._counts()
        probability = max(0.0, (requests - self._k * accepts) / (requests + 1))
        return RetryableError(
            REFUSAL_REASON,
            f"adaptive throttle{label} refused the request locally (the backend rejected "
            f"too many recently: rejection probability {round(probability, 4):g} from "
            f"{count(requests, 'request')} and {count(accepts, 'accept')} in its "
            f"{self._window:g} s window, k {self._k:g}): nothing was sent",
            effect=_NOT_SENT,
        )

    # -- outcomes ----------------------------------------------------------------------
    def record_success(self) -> None:
        """An admitted request was accepted by the backend.

        A clock that raises or reads NaN or an infinity records nothing: an outcome is
        recorded after the request's own answer, which a broken clock must not replace.
        """
        try:
            now = self._clock()
        except Exception:
            return
        if now < self._slice_end:
            next(self._ticks)  # the hot path: one atomic count, no lock
            return
        index = slice_of(now, self._per_slice)
        if index is None:  # NaN or an infinity
            return
        with self._lock:
            self._catch_up(index)
            self._add(accepted=True)

    def record_failure(self, error: BaseException) -> None:
        """An admitted request ended with ``error``.

        Not an :class:`Exception` (a cancellation), or a ``RetryableError`` whose effect
        is ``NOT_SENT``: nothing is recorded. Otherwise a request, and an accept unless
        ``is_rejection(error)`` is true.
        """
        if not isinstance(error, BaseException):
            raise TypeError(
                f"AdaptiveThrottle.record_failure(error) must be an exception, got {show(error)}"
            )
        if not isinstance(error, Exception) or sent_nothing(error):
            return
        if not self._is_rejection(error):  # user code: outside the lock
            self.record_success()
            return
        try:
            now = self._clock()
        except Exception:  # a broken clock records nothing (see record_success)
            return
        index = slice_of(now, self._per_slice)
        if index is None:
            return
        with self._lock:
            self._catch_up(index)
            self._add(accepted=False)

    def _add(self, *, accepted: bool) -> None:
        """One request (and an accept) in the current slice (under the lock)."""
        slot = self._index % _SLICES
        self._req_slices[slot] += 1
        self._requests += 1
        if accepted:
            self._acc_slices[slot] += 1
            self._accepts += 1
        self._excess = excess = self._requests - self._k * self._accepts
        self._quiet = excess <= 0.0 and not self._refusing

    def _catch_up(self, index: int) -> None:
        """Add the lock-free successes in, then move the window to slice ``index`` (under the lock).

        A success that raced with a slice change may land in the newer slice: it then
        leaves the window up to a tenth of it later (the sloppiness RetryBudget accepts).
        """
        tick = next(self._ticks)
        pending = tick - self._last - 1
        self._last = tick
        slot = self._index % _SLICES
        if pending:
            self._req_slices[slot] += pending
            self._acc_slices[slot] += pending
            self._requests += pending
            self._accepts += pending
        old = self._index
        if index > old:  # a clock that went back stays in the newer slice
            req, acc = self._req_slices, self._acc_slices
            if index - old >= _SLICES:
                for i in range(_SLICES):
                    req[i] = acc[i] = 0
                self._requests = self._accepts = 0
            else:
                for i in range(old + 1, index + 1):
                    j = i % _SLICES
                    self._requests -= req[j]
                    self._accepts -= acc[j]
                    req[j] = acc[j] = 0
            self._index = index
            self._slice_end = (index + 1) / self._per_slice
        elif not pending:
            return
        self._excess = excess = self._requests - self._k * self._accepts
        self._quiet = excess <= 0.0 and not self._refusing

    def __repr__(self) -> str:
        label = f" {self._name!r}" if self._name else ""
        requests, accepts = self._counts()
        return (
            f"<AdaptiveThrottle{label} k={self._k:g} window={self._window:g}s "
            f"requests={requests} accepts={accepts}>"
        )


class ThrottleGuard:
    """What :meth:`AdaptiveThrottle.guard` returns: admit on enter, record on exit.

    A plain class holding only its throttle, one per throttle, shared by every request
    (as ``CircuitBreaker.guard()``'s): no allocation per call.
    """

    __slots__ = ("_throttle",)

    def __init__(self, throttle: AdaptiveThrottle) -> None:
        self._throttle = throttle

    def __enter__(self) -> None:
        throttle = self._throttle
        if not throttle.admit():
            raise throttle.refusal()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self._throttle.record_success()
        else:
            self._throttle.record_failure(exc)
