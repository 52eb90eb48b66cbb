"""Structured log events (names and fields are a stable interface; see rfc/0001).

sdkcore never configures structlog: the application does. To keep the per-attempt
path cheap, the bound logger is resolved once and reused until the application
changes structlog's configuration; callers ask :func:`enabled` before building
an event, so a filtered-out level costs one method call.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = [
    "EVENT_NOT_RETRIED",
    "EVENT_SCHEDULED",
    "EVENT_STRATEGY_FAILED",
    "EVENT_TIMED_OUT",
    "LOGGER_NAME",
    "enabled",
    "logger",
]

LOGGER_NAME = "sdkcore"

#: debug: a retry was scheduled (after backoff the request is re-dispatched).
EVENT_SCHEDULED = "retry.scheduled"
#: info: the request was not retried (strategy refused, or backpressure).
EVENT_NOT_RETRIED = "retry.not_retried"
#: info: the request timed out while in retry or in flight.
EVENT_TIMED_OUT = "retry.timed_out"
#: warning: the retry strategy raised or returned something that is not a RetryAction.
EVENT_STRATEGY_FAILED = "retry.strategy_failed"

DEBUG = logging.DEBUG
INFO = logging.INFO
WARNING = logging.WARNING

_STRUCTLOG_CONFIG: Any
try:  # structlog's global configuration object; fall back to re-binding if it moves.
    from structlog._config import _CONFIG as _STRUCTLOG_CONFIG
except ImportError:  # pragma: no cover - depends on structlog internals
    _STRUCTLOG_CONFIG = None

_cached: Any = None
_min_level: int | None = None  # fixed level of structlog's native filtering loggers
_key: tuple[Any, Any, Any, Any] = (None, None, None, None)


def _refresh() -> Any:
    global _cached, _min_level, _key
    c = _STRUCTLOG_CONFIG
    log = structlog.get_logger(LOGGER_NAME).bind()
    level = None
    # make_filtering_bound_logger() classes filter at a level fixed for the class.
    if type(log).__module__ == "structlog._native" and hasattr(log, "get_effective_level"):
        level = int(log.get_effective_level())
    _cached, _min_level = log, level
    if c is not None:
        _key = (
            c.default_processors,
            c.default_wrapper_class,
            c.logger_factory,
            c.default_context_class,
        )
    return log


def logger() -> Any:
    """The bound logger for sdkcore events, re-resolved when structlog is reconfigured."""
    c = _STRUCTLOG_CONFIG
    k = _key
    if (
        c is None
        or c.default_processors is not k[0]
        or c.default_wrapper_class is not k[1]
        or c.logger_factory is not k[2]
        or c.default_context_class is not k[3]
    ):
        return _refresh()
    return _cached


def enabled(level: int) -> Any:
    """The bound logger if ``level`` is enabled, else None (cheap: called per attempt).

    Fast path: while the configured wrapper class is the one the cached level was
    read from, a level below it is rejected with one identity check and one
    comparison. Anything else goes through :func:`logger` (full staleness check).
    """
    if _STRUCTLOG_CONFIG is not None and _STRUCTLOG_CONFIG.default_wrapper_class is _key[1]:
        floor = _min_level
        if floor is not None and level < floor:
            return None
    log = logger()
    floor = _min_level
    if floor is not None:
        return log if level >= floor else None
    check = getattr(log, "is_enabled_for", None)
    if check is None or check(level):
        return log
    return None
