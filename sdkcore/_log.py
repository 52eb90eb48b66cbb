"""Structured log events (names and fields are a stable interface; see rfc/0001).

sdkcore never configures structlog: the application does. Where the events go:

* structlog configured by the application (``structlog.is_configured()``): through
  ``structlog.get_logger("sdkcore")``, i.e. the application's own pipeline;
* structlog left unconfigured: to the stdlib logger ``logging.getLogger("sdkcore")``
  (plain ``logging`` calls; structlog is not imported), so an
  application that only uses ``logging`` sees them in its handlers and nothing is
  printed (structlog's unconfigured default would print every debug line to stdout);
  the logger carries a ``logging.NullHandler``, so an application that configured no
  logging at all sees nothing either (no ``logging.lastResort`` on stderr);
* inside ``sdkcore.testing.capture_retry_events()``: into the capture list only.

To keep the per-attempt path cheap, callers ask :func:`enabled` before building an
event, and the retry doors ask :func:`gate` once per request, then one comparison
per retry.

sdkcore never imports structlog itself: an application that never imported it cannot
have configured it, and ``import structlog`` costs tens of milliseconds (it loads
rich when installed); sdkcore uses the structlog module the application loaded.

Nor does it import ``logging`` (about 3 ms with ``traceback``, ``string`` and
``textwrap``): while ``logging`` is not imported, no handler exists that an event
could reach, so the stdlib path drops it. The ``sdkcore`` logger and its
``NullHandler`` are attached as soon as ``logging`` is there: at ``import sdkcore``
if it already was (asyncio and trio import it), else at the first event asked for
after the application imported it (:func:`_attach`: a lookup in ``sys.modules`` and
``logging.getLogger``, never an import).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, MutableMapping
from contextvars import ContextVar
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging

__all__ = [
    "CAPTURE",
    "EPISODE_QUIET",
    "EVENT_BREAKER_CLOSED",
    "EVENT_BREAKER_HALF_OPEN",
    "EVENT_BREAKER_OPENED",
    "EVENT_BUDGET_EXHAUSTED",
    "EVENT_BUDGET_RECOVERED",
    "EVENT_CANCELLED",
    "EVENT_GRPC_CONFIG_IGNORED",
    "EVENT_HEDGE_CANCELLED",
    "EVENT_HEDGE_FAILED",
    "EVENT_HEDGE_SENT",
    "EVENT_HEDGE_WON",
    "EVENT_LIMITER_LIMIT_CHANGED",
    "EVENT_LIMITER_RECOVERED",
    "EVENT_LIMITER_REFUSING",
    "EVENT_NOT_RETRIED",
    "EVENT_ORPHAN_REPORT",
    "EVENT_SCHEDULED",
    "EVENT_STRATEGY_FAILED",
    "EVENT_TELEMETRY_FAILED",
    "EVENT_THRESHOLD_REPORT",
    "EVENT_THROTTLE_ENGAGED",
    "EVENT_THROTTLE_RECOVERED",
    "EVENT_THROTTLE_REFUSING",
    "EVENT_THROTTLE_RELEASED",
    "EVENT_TIMED_OUT",
    "GRPC_CONFIG_IGNORED_SHOWN",
    "LOGGER_NAME",
    "Capturing",
    "duration_ms",
    "enabled",
    "gate",
    "metric_endpoint",
]

LOGGER_NAME = "sdkcore"

#: debug: a retry was scheduled (after backoff the request is re-dispatched).
EVENT_SCHEDULED = "retry.scheduled"
#: info: the request was not retried (strategy refused, idempotency, backpressure, the
#: retry budget, or a hedge chain with no copy left).
EVENT_NOT_RETRIED = "retry.not_retried"
#: info: the request timed out while in retry or in flight.
EVENT_TIMED_OUT = "retry.timed_out"
#: warning: the retry strategy raised or returned something that is not a RetryAction.
EVENT_STRATEGY_FAILED = "retry.strategy_failed"
#: info when the request is not idempotent and may have been applied, else debug:
#: ``Request.cancel()`` (CANCELLED_VIA_CONTEXT) or the caller's own cancellation
#: (TASK_CANCELLED) ended a request (reported by the door that ends it).
EVENT_CANCELLED = "retry.cancelled"

# Endpoint protection (rfc/0007). Fields: endpoint, cause, last_error; outcomes and
# failures on the trip, trip_outcomes and trip_failures after it.
#: warning: a circuit breaker opened (cause: threshold, probe_failed or canary_timeout).
EVENT_BREAKER_OPENED = "breaker.opened"
#: info: a circuit breaker's sleep window is over and its probe went out.
EVENT_BREAKER_HALF_OPEN = "breaker.half_open"
#: info: a circuit breaker closed (cause: probe_succeeded or reset).
EVENT_BREAKER_CLOSED = "breaker.closed"
#: warning: a retry budget refused a withdrawal, the first of an episode (fields: budget,
#: balance, min_retries_per_sec, retry_ratio, ttl_s).
EVENT_BUDGET_EXHAUSTED = "budget.exhausted"
#: info: a retry budget's episode of refusals ended: a withdrawal granted at least
#: EPISODE_QUIET seconds after the last refusal (fields: budget, refused: the
#: withdrawals refused since budget.exhausted, duration_ms, balance).
EVENT_BUDGET_RECOVERED = "budget.recovered"

#: A refusal episode (a retry budget's, a concurrency limiter's) ends at the first grant
#: that comes this long after its last refusal. Under sustained overload grants and
#: refusals alternate every few milliseconds: ended at the first grant, episodes logged a
#: pair of events 300-400 times a second (a simulated limiter at twice its capacity).
EPISODE_QUIET = 1.0

# Two throttles, two pairs of events: ``throttle.engaged``/``released`` are gRPC's A6
# RetryThrottler's (it stops retries), ``throttle.refusing``/``recovered`` the SRE
# AdaptiveThrottle's (it refuses requests).
# gRPC retryThrottling (rfc/0003). Fields: target, tokens, max_tokens, threshold.
#: warning: a gRPC RetryThrottler's tokens fell to its threshold: retries and hedges stop.
EVENT_THROTTLE_ENGAGED = "throttle.engaged"
#: info: its tokens rose above the threshold again (field refused: retries and hedges it
#: refused while engaged).
EVENT_THROTTLE_RELEASED = "throttle.released"

# gRPC service config (rfc/0003, "Config events").
#: warning: a gRPC channel was made with a service config some of whose keys nothing
#: applies (A6 ignores unknown keys: a typo such as ``retryPolicyy`` turns retries off);
#: once per channel (fields: target, ignored: the first GRPC_CONFIG_IGNORED_SHOWN keys,
#: each {path, suggestion, why}; count: how many there are).
EVENT_GRPC_CONFIG_IGNORED = "grpc.config_ignored"
#: The most keys ``grpc.config_ignored`` lists (``count`` says how many there are).
GRPC_CONFIG_IGNORED_SHOWN = 20

# Concurrency limiters (rfc/0009). Field limiter: the limiter's name ("" when unnamed).
#: warning: a limiter refused a dispatch, the first of an episode (fields: limit,
#: in_flight, queued).
EVENT_LIMITER_REFUSING = "limiter.refusing"
#: info: a limiter's episode of refusals ended: a permit granted at least EPISODE_QUIET
#: seconds after the last refusal (fields: refused: the dispatches refused since
#: limiter.refusing, duration_ms, limit).
EVENT_LIMITER_RECOVERED = "limiter.recovered"
#: info: an adaptive limiter's limit moved by a factor of 2 or more from the last one
#: reported (fields: limit, previous, baseline_rtt_ms, rtt_ms, cause: gradient, drop,
#: probe or probe_end).
EVENT_LIMITER_LIMIT_CHANGED = "limiter.limit_changed"

# AdaptiveThrottle, Google SRE client-side throttling (rfc/0009).
#: warning: the throttle refused a request after a time without refusals (fields: throttle,
#: rejection_probability, requests, accepts, k).
EVENT_THROTTLE_REFUSING = "throttle.refusing"
#: info: the first admission after an episode of refusals that finds nothing to refuse
#: (rejection probability 0) (fields: throttle, refused: the requests refused since
#: throttle.refusing, duration_ms).
EVENT_THROTTLE_RECOVERED = "throttle.recovered"

# Hedging (rfc/0004). Fields: the request's, hedge (the copy's index).
#: debug: hedge ``hedge`` was sent (``trigger``: first, delay, non_fatal, pushback).
EVENT_HEDGE_SENT = "hedge.sent"
#: debug: hedge ``hedge`` returned the answer; the others are cancelled.
EVENT_HEDGE_WON = "hedge.won"
#: debug: hedge ``hedge`` was cancelled (another won, a fatal failure, the deadline, the app).
EVENT_HEDGE_CANCELLED = "hedge.cancelled"
#: debug: hedge ``hedge`` failed (``fatal``: whether its failure ends the chain, which
#: ``retry.not_retried`` then reports at info).
EVENT_HEDGE_FAILED = "hedge.failed"

# Couchbase RFC 67 reports and telemetry (rfc/0008).
#: warning: the orphaned responses of the last interval (fields: report, emit_interval_s).
EVENT_ORPHAN_REPORT = "orphan.report"
#: warning: the requests over their threshold in an interval (fields: report, emit_interval_s).
EVENT_THRESHOLD_REPORT = "threshold.report"
#: warning, once per kind: an OpenTelemetry instrument, exporter or span raised.
EVENT_TELEMETRY_FAILED = "telemetry.failed"


def duration_ms(since: float, now: float) -> float | None:
    """An episode's ``duration_ms`` field: ``now - since`` in milliseconds (3 decimals);
    0 for a clock that stepped back, None when either reading failed (NaN)."""
    ms = (now - since) * 1000.0
    if ms >= 0.0:
        return round(ms, 3)
    return None if ms != ms else 0.0  # NaN


def metric_endpoint(target: object) -> dict[str, str]:
    """The ``metric_endpoint`` field of an event of ``target`` (a breaker, budget, limiter
    or throttle) that a :class:`sdkcore.Telemetry` watches: the ``sdkcore.endpoint`` its
    metric series carry, which its own name is not when it has none (``unnamed-3``, or
    ``watch(name=...)``'s) or shares it (``node8:11210#2``), so that an alert on a series
    finds its log lines (an operator's review). ``{}`` when nothing watches it. Read in
    ``sys.modules``: a telemetry not imported watches nothing."""
    telemetry = sys.modules.get("sdkcore._telemetry")
    if telemetry is None:
        return {}
    watching = telemetry.watched_by(target)
    label = "" if watching is None else watching.label(target)
    return {"metric_endpoint": label} if label else {}


# The stdlib's levels (logging.DEBUG, INFO, WARNING), without importing logging.
DEBUG = 10
INFO = 20
WARNING = 30
_LEVELS = {"debug": DEBUG, "info": INFO, "warning": WARNING}


class Capturing:
    """One ``capture_retry_events()`` block: its list, whether it is still open, and the
    block it is nested in (which gets the events too)."""

    __slots__ = ("events", "open", "outer")

    def __init__(self, events: list[MutableMapping[str, Any]], outer: Capturing | None) -> None:
        self.events = events
        self.open = True
        self.outer = outer


#: While set to an open :class:`Capturing`, every sdkcore event (any level) is appended
#: to its list as a dict (``event``, ``log_level`` and the fields) instead of being
#: logged. Set only by ``sdkcore.testing``; a contextvar, so concurrent tests keep their
#: events apart. A task started in the block keeps it after the block ended: closed,
#: it captures nothing more.
CAPTURE: ContextVar[Capturing | None] = ContextVar("sdkcore_capture", default=None)

#: The stdlib logger ``sdkcore``, set by :func:`_attach` once ``logging`` is imported.
_stdlib_logger: logging.Logger
_attach_lock = threading.Lock()


def _attach() -> bool:
    """The ``sdkcore`` stdlib logger, with its NullHandler, once ``logging`` is imported.

    False while ``logging`` is not imported: then no handler exists anywhere, and an
    event has nowhere to go. Never imports ``logging`` (it may run inside a request).
    """
    global _stdlib_logger, _stdlib_gate
    if _stdlib_gate is _stdlib_at:
        return True
    logging = sys.modules.get("logging")
    if logging is None:
        return False
    with _attach_lock:
        if _stdlib_gate is not _stdlib_at:
            _stdlib_logger = logging.getLogger(LOGGER_NAME)
            # A library prints nothing by itself: without this, an application that
            # configured no logging at all would see warning-level events on stderr
            # through logging.lastResort.
            _stdlib_logger.addHandler(logging.NullHandler())
            _stdlib_gate = _stdlib_at
    return True


def _stdlib_event(event: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Render an event for a stdlib logger: ``retry.scheduled key=value ...``.

    The event and its fields are also on the LogRecord, as ``record.sdkcore`` (a dict
    whose ``event`` key is the event's name), for handlers that want them structured.
    """
    text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items())
    return (f"{event} {text}" if text else event), {"sdkcore": {"event": event, **fields}}


#: The events whose logging raised once already (see :func:`_dropped`).
_DROPPED: set[str] = set()


def _dropped(event: str, error: Exception) -> None:
    """Logging ``event`` raised ``error`` (an application's filter, handler or structlog
    processor that raises): the event is dropped and sdkcore goes on. sdkcore's state is
    changed around its events (a probe granted, a retry counted and paid for, a copy
    booked): an event that raised halfway left requests pending, a hedge's deadline armed
    and permits held (rfc/0001, "Logging that raises").

    Said as a ``RuntimeWarning`` (the logging that would say it is what failed), once per
    event name for the process. Where warnings are errors (``-W error``, a test suite's
    ``filterwarnings = error``), raising that warning here would leave the state half
    changed again: it goes to ``sys.unraisablehook`` instead, every time, which prints it
    (Python's "Exception ignored in") and fails the test under pytest, as the error
    itself did."""
    if event in _DROPPED:
        return
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:  # an error whose str() raises
        text = type(error).__name__
    message = (
        f"sdkcore dropped its log event {event!r}: logging it raised {text} (a filter, "
        "handler or structlog processor of the application's); requests went on"
    )
    try:  # (stacklevel: the sdkcore module that logged, past the logger's two frames)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
    except Exception as raised:  # warnings are errors
        sys.unraisablehook(
            SimpleNamespace(
                exc_type=type(raised),
                exc_value=raised,
                exc_traceback=raised.__traceback__,
                err_msg="Exception ignored while sdkcore logged an event",
                object=None,
            )
        )
        return  # not marked said: reported again next time
    _DROPPED.add(event)


class _Stdlib:
    """sdkcore's events on the stdlib logger ``sdkcore`` (structlog left unconfigured).

    Plain ``logging`` calls: an application that never configured structlog never
    imports it through sdkcore (the first warning of a process would otherwise load
    structlog, tens of milliseconds, inside that request's deadline). An error raised
    by logging is not sdkcore's to raise (:func:`_dropped`).
    """

    __slots__ = ()

    def _log(self, level: int, event: str, fields: dict[str, Any]) -> None:
        try:
            msg, extra = _stdlib_event(event, fields)
            # stacklevel: the record names sdkcore's module that logged (not this one)
            _stdlib_logger.log(level, msg, extra=extra, stacklevel=3)
        except Exception as exc:
            _dropped(event, exc)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(WARNING, event, fields)


class _Guarded:
    """The application's structlog logger, whose pipeline may raise (:func:`_dropped`).

    A frame between sdkcore's call and structlog's: structlog's ``CallsiteParameterAdder``
    names this module for sdkcore's events unless given
    ``additional_ignores=["sdkcore._log"]`` (README, "Logging"). ``structlog.DropEvent``
    (a ``BaseException``) that a wrapper class lets out is the drop it means, not an
    interrupt."""

    __slots__ = ("drop", "log")

    def __init__(self, log: Any, drop: type[BaseException]) -> None:
        self.log = log
        self.drop = drop

    def _call(self, method: str, event: str, fields: dict[str, Any]) -> None:
        try:
            getattr(self.log, method)(event, **fields)
        except Exception as exc:
            _dropped(event, exc)
        except BaseException as exc:
            if not isinstance(exc, self.drop):
                raise

    def debug(self, event: str, **fields: Any) -> None:
        self._call("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._call("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._call("warning", event, fields)


_STDLIB = _Stdlib()


def _open_capture() -> Capturing | None:
    """The innermost capture still open in this context: a task started in a block that
    has ended logs to the block around it (a test's fixture), if any."""
    capturing = CAPTURE.get()
    while capturing is not None and not capturing.open:
        capturing = capturing.outer
    return capturing


class _Capture:
    """A logger that appends events to the captures open in the context of the call (the
    innermost and the ones around it, each its own copy of the event)."""

    __slots__ = ()

    def _add(self, level: str, event: str, fields: dict[str, Any]) -> None:
        capturing = _open_capture()
        if capturing is None:
            # No capture is open here any more (a request that found one keeps its gate):
            # the event goes to the logger in force now, never to a list a with handed back.
            log = gate()(_LEVELS[level])
            if log is not None:
                getattr(log, level)(event, **fields)
            return
        record = {"event": event, "log_level": level, **fields}
        while capturing is not None:  # the blocks around it (a test's fixture) too
            if capturing.open:
                capturing.events.append(dict(record))
            capturing = capturing.outer

    def debug(self, event: str, **fields: Any) -> None:
        self._add("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._add("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._add("warning", event, fields)


# The gate for the application's structlog configuration, and the configuration it
# was built for, compared by identity (structlog.get_config() returns the live
# objects): the gate binds a logger (get_logger().bind()) once per configuration, not
# once per request.
_cached: Callable[[int], Any] | None = None
_cached_key: tuple[Any, ...] = (None, None, None, None)


def _structlog_gate(structlog: Any) -> Callable[[int], Any]:
    global _cached, _cached_key
    config = structlog.get_config()
    k = _cached_key
    if (
        config["wrapper_class"] is k[1]
        and config["processors"] is k[0]
        and config["logger_factory"] is k[2]
        and config["context_class"] is k[3]
        and _cached is not None
    ):
        return _cached
    _attach()  # structlog may route to the stdlib logger ``sdkcore``: its NullHandler first
    try:  # the application's factory, wrapper class and level: they may raise too
        log = structlog.get_logger(LOGGER_NAME).bind()
        level_of = getattr(log, "get_effective_level", None)
        check = getattr(log, "isEnabledFor", None) or getattr(log, "is_enabled_for", None)
        floor = None if level_of is None or hasattr(log, "isEnabledFor") else int(level_of())
    except Exception as exc:  # no logger to log to: every event dropped (not cached)
        _dropped("<structlog logger>", exc)
        return _off
    at: Callable[[int], Any]
    guarded = _Guarded(log, structlog.DropEvent)
    if floor is not None:
        at = _Floor(guarded, floor).at  # filtering bound loggers: fixed by the class
    elif check is not None:
        at = _Checked(guarded, check).at  # e.g. structlog.stdlib: the stdlib level, live
    else:
        at = _Floor(guarded, 0).at  # no level: every event goes to the pipeline
    _cached = at
    _cached_key = (
        config["processors"],
        config["wrapper_class"],
        config["logger_factory"],
        config["context_class"],
    )
    return at


def enabled(level: int) -> Any:
    """The logger if ``level`` is enabled, else None (cheap: called per attempt)."""
    return gate()(level)


def gate() -> Callable[[int], Any]:
    """The sdkcore logger in force now, as ``at(level)``: the logger, or None if filtered.

    Finding the logger (a capture, the application's structlog configuration, or the
    stdlib logger) costs about 5,700 instructions with structlog configured, 3% of a
    retried ``execute`` (bench/README, "bench_doors.py", third pass); the returned ``at``
    then costs one comparison
    or one ``isEnabledFor``, and sees runtime level changes. A door asks for the
    gate once per request; ``maybe_retry`` calls ``at`` once per retry, ``execute``
    once per call, at its first failure (rfc/0001, "How a failed attempt flows").
    """
    if _open_capture() is not None:
        return _CAPTURING
    structlog = sys.modules.get("structlog")
    if structlog is None or not structlog.is_configured():
        return _stdlib_gate
    return _structlog_gate(structlog)


def _off(level: int) -> Any:
    """The gate of a logger that could not be made: every level filtered."""
    return None


def _stdlib_at(level: int) -> Any:
    return _STDLIB if _stdlib_logger.isEnabledFor(level) else None


def _unattached_at(level: int) -> Any:
    """The stdlib gate before the ``sdkcore`` logger exists (``logging`` not imported yet)."""
    return _stdlib_at(level) if _attach() else None


#: :func:`_stdlib_at` once the ``sdkcore`` logger is attached, :func:`_unattached_at` before.
_stdlib_gate: Callable[[int], Any] = _unattached_at
_attach()  # at import, if logging is imported already (asyncio and trio import it)


class _Floor:
    """A logger whose level is fixed (a structlog filtering logger, a capture: 0)."""

    __slots__ = ("floor", "log")

    def __init__(self, log: Any, floor: int) -> None:
        self.log = log
        self.floor = floor

    def at(self, level: int) -> Any:
        return self.log if level >= self.floor else None


class _Checked:
    """A logger that answers ``isEnabledFor(level)`` itself (its level may change)."""

    __slots__ = ("check", "log")

    def __init__(self, log: Any, check: Callable[[int], bool]) -> None:
        self.log = log
        self.check = check

    def at(self, level: int) -> Any:
        return self.log if self.check(level) else None


#: The gate inside a capture: every level, to the captures open where the event is logged.
_CAPTURING: Callable[[int], Any] = _Floor(_Capture(), 0).at
