"""Helpers for testing code that uses sdkcore (public, stable).

* :func:`capture_retry_events`: the sdkcore log events emitted inside a ``with``.
* :class:`ScriptedSend`: a ``send`` for ``RetryOrchestrator.execute`` that plays a script.
* :class:`VirtualClock`: a clock and sleep that jump instead of waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, MutableMapping
from typing import Any, Generic, TypeVar

import anyio.lowlevel
import structlog
import structlog.testing

from . import _log
from ._errors import RetryableError
from ._reason import RetryReason
from ._request import Request

__all__ = ["ScriptedSend", "VirtualClock", "capture_retry_events"]

T = TypeVar("T")


@contextlib.contextmanager
def capture_retry_events() -> Generator[list[MutableMapping[str, Any]], None, None]:
    """Capture sdkcore's structlog events (all levels) as dicts.

    Like ``structlog.testing.capture_logs`` but keeps only sdkcore's events (named
    ``retry.*``) and enables every level for the duration.
    """
    events: list[MutableMapping[str, Any]] = []

    def keep(_: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        if str(event_dict.get("event", "")).startswith("retry."):
            event_dict.setdefault("log_level", method)
            events.append(dict(event_dict))
        raise structlog.DropEvent

    was_configured = structlog.is_configured()
    old = structlog.get_config()
    structlog.configure(
        processors=[keep],
        wrapper_class=structlog.make_filtering_bound_logger(0),
        cache_logger_on_first_use=False,
    )
    try:
        yield events
    finally:
        if was_configured:
            structlog.configure(**old)
        else:  # leave structlog as unconfigured as we found it
            structlog.reset_defaults()
        _log.logger()  # re-resolve against the restored configuration


class ScriptedSend(Generic[T]):
    """A ``send(request)`` that plays ``script`` one step per attempt.

    Each step is a :class:`RetryReason` (raise ``RetryableError(reason)``), an
    exception instance (raised as is), or any other value (returned). After the
    script ends, the last step repeats. ``calls`` counts attempts; ``seen`` holds
    ``request.retry_attempts`` at each call.
    """

    def __init__(self, script: Iterable[RetryReason | BaseException | T]) -> None:
        self.script = list(script)
        if not self.script:
            raise ValueError("ScriptedSend(script) needs at least one step")
        self.calls = 0
        self.seen: list[int] = []

    async def __call__(self, request: Request) -> T:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        self.seen.append(request.retry_attempts)
        await anyio.lowlevel.checkpoint()
        if isinstance(step, RetryReason):
            raise RetryableError(step)
        if isinstance(step, BaseException):
            raise step
        return step


class VirtualClock:
    """A monotonic clock that only moves when slept on.

    Pass ``clock`` to ``Request(clock=...)`` and ``sleep`` to
    ``RetryOrchestrator(sleep=...)``: backoffs then take no real time and
    ``sleeps`` records each requested delay.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await anyio.lowlevel.checkpoint()
