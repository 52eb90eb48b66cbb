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

try:  # structlog's global configuration object; fall back to re-binding if it moves.
    from structlog._config import _CONFIG as _STRUCTLOG_CONFIG
except ImportError:  # pragma: no cover - depends on structlog internals
    _STRUCTLOG_CONFIG = None

_cached: Any = None
_fingerprint: tuple[Any, ...] = ()


def _current_fingerprint() -> tuple[Any, ...]:
    c = _STRUCTLOG_CONFIG
    if c is None:  # pragma: no cover
        return (object(),)
    return (c.default_wrapper_class, c.logger_factory, c.default_context_class, id(c.default_processors))


def logger() -> Any:
    """The bound logger for sdkcore events, re-resolved when structlog is reconfigured."""
    global _cached, _fingerprint
    fp = _current_fingerprint()
    if _cached is None or fp != _fingerprint:
        _cached = structlog.get_logger(LOGGER_NAME).bind()
        _fingerprint = fp
    return _cached


def enabled(level: int) -> Any:
    """The bound logger if ``level`` is enabled, else None."""
    log = logger()
    check = getattr(log, "is_enabled_for", None)
    if check is None or check(level):
        return log
    return None
