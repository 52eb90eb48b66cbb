"""Helpers for testing code that uses sdkcore (public, stable, typed).

* :func:`instant_retries`: every retry delay is waited as zero inside a ``with``,
  while every decision, attempt count and logged delay stays the same.
* :func:`capture_retry_events`: the sdkcore log events emitted inside a ``with``.
* :class:`ScriptedSend`: a ``send`` for ``RetryOrchestrator.execute`` (or a hedging
  runner's ``send(request, index)``) that plays a script of retry reasons, KV
  statuses, gRPC status codes, exceptions, delays and values.
* :class:`Delay`: a script step that waits, then plays another step.
* :func:`grpc_server`: a scripted ``grpc.aio`` server on 127.0.0.1 (needs grpcio).
* :class:`VirtualClock`: a clock and sleep that jump instead of waiting.

With pytest, the fixtures ``sdkcore_instant_retries`` and ``sdkcore_retry_events``
are registered automatically (the ``sdkcore`` pytest plugin).

Every helper is scoped by contextvars, never by global state, so tests that run
concurrently (tasks or threads) do not see each other's settings or events.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Generator, Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import attrs

from .. import _hooks, _log
from .._errors import CouchbaseException, RetryableError
from .._install import install_hint
from .._reason import RetryReason
from .._request import Request
from .._untrusted import show as _show
from ..mapping import GrpcCode, KvOpcode, KvStatus, grpc_failure, kv_failure

if TYPE_CHECKING:
    from ._grpc import GrpcStatus, ScriptedGrpcServer, grpc_server

__all__ = [
    "Delay",
    "GrpcStatus",
    "ScriptedGrpcServer",
    "ScriptedSend",
    "VirtualClock",
    "capture_retry_events",
    "grpc_server",
    "instant_retries",
]

T = TypeVar("T")

#: grpc core's log level for tests: ERROR, its documented default. Since grpcio moved to
#: absl logging, an unset GRPC_VERBOSITY lets INFO lines (a GOAWAY from a stopped test
#: server, ...) reach stderr. grpc reads it once, so it is set before grpc is imported
#: (here, and in the sdkcore pytest plugin, which loads before any test module);
#: a value the user set is kept.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


# -- instant retries ---------------------------------------------------------------------


@contextlib.contextmanager
def instant_retries() -> Generator[None, None, None]:
    """Inside the ``with``, every retry backoff (and hedging delay) is waited as zero.

    Decisions, attempt counts, ``retry.scheduled`` delays and exception contexts are
    unchanged: only the wait is skipped (one checkpoint instead). The switch is a
    contextvar: tasks started inside the ``with`` inherit it, concurrent tests do
    not see it. Timeouts still run on the real clock, so a request whose retries
    never end fails with its usual timeout, just after more attempts. An orchestrator
    given a ``sleep`` (a :class:`VirtualClock`'s) keeps sleeping on it: that sleep is
    already instant, and it is what moves the virtual clock to the timeout.
    """
    token = _hooks.INSTANT_DELAYS.set(True)
    try:
        yield
    finally:
        _hooks.INSTANT_DELAYS.reset(token)


# -- log capture -------------------------------------------------------------------------


@contextlib.contextmanager
def capture_retry_events() -> Generator[list[MutableMapping[str, Any]], None, None]:
    """Capture sdkcore's log events (every level) as dicts, in the order emitted.

    Each dict holds ``event`` (e.g. ``"retry.scheduled"``), ``log_level`` and the
    event's fields (see the log-event table in the README). Only events that
    sdkcore emits inside the ``with`` (in this context, and tasks started from it)
    are captured, and they are not logged anywhere else meanwhile; after the ``with``,
    nothing is added to the list (a task started in it logs as it would have). Nested,
    the enclosing capture (a test's ``sdkcore_retry_events`` fixture) gets the inner
    block's events too. One limit: a request finds its logger for
    ``retry.scheduled`` at its first retry, so one first retried before the ``with``
    logs those events as it did then (every other event is captured). structlog's
    configuration is not touched, so the application's own logging and concurrent
    tests are unaffected.
    """
    events: list[MutableMapping[str, Any]] = []
    capturing = _log.Capturing(events, outer=_log.CAPTURE.get())
    token = _log.CAPTURE.set(capturing)
    try:
        yield events
    finally:
        capturing.open = False  # a task started in the block keeps it: it adds nothing more
        _log.CAPTURE.reset(token)


# -- scripted failures -------------------------------------------------------------------


def _seconds(value: object, what: str, *, minimum: float | None = 0.0) -> float:
    """``value`` as finite float seconds; TypeError / ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds (int or float), got {_show(value)}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past float's range
        seconds = math.inf
    if not math.isfinite(seconds) or (minimum is not None and seconds < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{what} must be a finite number of seconds{bound}, got {_show(value)}")
    return seconds


def _check_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _seconds(value, "Delay(seconds)")


def _safe_repr(value: object) -> str:
    return _show(value)


@attrs.frozen(slots=True)
class Delay:
    """A script step: wait ``seconds`` (real time, like a slow server), then play ``then``.

    ``then`` is any other step (a value, a RetryReason, a status, an exception, or
    another Delay); the default None makes the attempt return None.
    """

    seconds: float = attrs.field(validator=_check_seconds, repr=_safe_repr)
    then: Any = attrs.field(default=None, repr=_safe_repr)


def _check_step(step: object, where: str) -> None:
    if isinstance(step, Delay):
        _check_step(step.then, where)
    elif isinstance(step, KvStatus) and step is KvStatus.SUCCESS:
        raise ValueError(
            f"{where}: KvStatus.SUCCESS is not a failure; put the value the attempt returns "
            "in the script instead"
        )
    elif isinstance(step, GrpcCode) and step is GrpcCode.OK:
        raise ValueError(
            f"{where}: GrpcCode.OK is not a failure; put the value the attempt returns "
            "in the script instead"
        )
    elif isinstance(step, type) and issubclass(step, BaseException):
        try:  # raised as a class, it is called without arguments: found now, not mid-test
            step()
        except Exception as exc:
            hint = (
                "a RetryReason step (e.g. RetryReason.KV_LOCKED) raises RetryableError(reason)"
                if issubclass(step, RetryableError)
                else f"put an instance in the script, e.g. {step.__name__}(...)"
            )
            raise TypeError(
                f"{where}: the exception class {step.__name__} cannot be raised without "
                f"arguments ({type(exc).__name__}: {exc}); {hint}"
            ) from None


class ScriptedSend(Generic[T]):
    """A ``send`` that plays a script, one step per attempt.

    Steps:

    * a :class:`~sdkcore.RetryReason`: raise ``RetryableError(reason)``;
    * a :class:`~sdkcore.mapping.KvStatus`: what ``kv_failure(status, kv_opcode)``
      maps it to (a RetryableError, or the exception, e.g. DocumentNotFoundException);
    * a :class:`~sdkcore.mapping.GrpcCode`: what ``grpc_failure(code)`` maps it to;
    * an exception instance or class: raised;
    * a :class:`Delay`: wait, then play its ``then`` step;
    * anything else: returned as the attempt's result.

    After the script ends, its last step repeats. ``script`` may also be a mapping
    from attempt index to script, for a hedging runner that calls
    ``send(request, index)``: each index then plays its own script. With a plain
    script, every attempt (whatever its index) takes the next step.

    ``calls`` counts attempts, ``seen`` holds ``request.retry_attempts`` at each
    call and ``indexes`` the index each call was made with (None without one).
    """

    def __init__(
        self,
        script: Iterable[Any] | Mapping[int, Iterable[Any]],
        *,
        kv_opcode: int = KvOpcode.GET,
        read_only: bool = False,
    ) -> None:
        scripts: dict[int | None, list[Any]] = {}
        if isinstance(script, Mapping):
            for index, steps in script.items():
                if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                    raise TypeError(
                        "ScriptedSend({index: script}): indexes must be ints >= 0, "
                        f"got {_show(index)}"
                    )
                if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
                    raise TypeError(
                        f"ScriptedSend({{{index}: script}}): each index's script is a list of "
                        f"steps, got {_show(steps)} ({type(steps).__name__}); wrap it: "
                        f"{{{index}: [{_show(steps)}]}}"
                    )
                scripts[index] = list(steps)
            if not scripts:
                raise ValueError("ScriptedSend({index: script}) needs at least one index")
        elif isinstance(script, (str, bytes)):
            raise TypeError(
                "ScriptedSend(script) takes a list of steps, not a single "
                f"{type(script).__name__}; wrap it: ScriptedSend([{_show(script)}])"
            )
        elif isinstance(script, Iterable):
            scripts[None] = list(script)
        else:
            raise TypeError(
                "ScriptedSend(script) takes a list of steps or {index: steps}, got "
                f"{_show(script)} ({type(script).__name__})"
            )
        for index, steps in scripts.items():
            where = "ScriptedSend(script)" if index is None else f"ScriptedSend({{{index}: ...}})"
            if not steps:
                raise ValueError(f"{where} needs at least one step")
            for n, step in enumerate(steps):
                _check_step(step, f"{where}[{n}]")
        if isinstance(kv_opcode, bool) or not isinstance(kv_opcode, int):
            raise TypeError(
                f"ScriptedSend(kv_opcode) must be an int KV opcode, got {_show(kv_opcode)}"
            )
        if not 0 <= kv_opcode <= 0xFF:
            raise ValueError(f"ScriptedSend(kv_opcode) must be in 0..0xff, got {_show(kv_opcode)}")
        if not isinstance(read_only, bool):
            raise TypeError(f"ScriptedSend(read_only) must be a bool, got {_show(read_only)}")
        self.script: list[Any] = scripts.get(None, [])
        self._scripts = scripts
        self._positions: dict[int | None, int] = dict.fromkeys(scripts, 0)
        self.kv_opcode = int(kv_opcode)
        self.read_only = read_only
        self.calls = 0
        self.seen: list[int] = []
        self.indexes: list[int | None] = []

    def _next(self, request: Request, index: int | None) -> Any:
        """The step of this attempt, counted (``calls``, ``seen``, ``indexes``)."""
        key: int | None = None if None in self._scripts else index
        steps = self._scripts.get(key)
        if steps is None:
            known = ", ".join(str(k) for k in self._scripts)
            raise LookupError(
                f"ScriptedSend: no script for attempt index {_show(index)}; "
                f"scripts exist for {known}"
            )
        position = self._positions[key]
        self._positions[key] = position + 1
        self.calls += 1
        self.seen.append(request.retry_attempts)
        self.indexes.append(index)
        return steps[min(position, len(steps) - 1)]

    async def __call__(self, request: Request, index: int | None = None) -> T:
        step = self._next(request, index)
        await anyio.lowlevel.checkpoint()
        while isinstance(step, Delay):
            await anyio.sleep(step.seconds)
            step = step.then
        return self._play(step)

    def sync(self, request: Request, index: int | None = None) -> T:
        """The same script as a blocking ``send``: ``execute_sync(request, script.sync)``
        (a :class:`Delay` blocks in ``time.sleep``). It shares the script's position
        and counters with the async ``send``."""
        step = self._next(request, index)
        while isinstance(step, Delay):
            time.sleep(step.seconds)
            step = step.then
        return self._play(step)

    def _play(self, step: Any) -> T:
        if isinstance(step, RetryReason):
            raise RetryableError(step)
        if isinstance(step, KvStatus):
            failure: Any = kv_failure(step.value, self.kv_opcode)
        elif isinstance(step, GrpcCode):
            failure = grpc_failure(step, read_only=self.read_only)
        elif isinstance(step, BaseException):
            if isinstance(step, CouchbaseException):
                # a step that repeats raises the same object again: the context a door
                # gave it for an earlier request must not follow it into this one
                step.context = None
            # nor the traceback of its earlier raises, which each raise grows (a test
            # under instant_retries() raised one 180,000 times: a 540,000-frame report)
            raise step.with_traceback(None)
        elif isinstance(step, type) and issubclass(step, BaseException):
            raise step
        else:
            result: T = step
            return result
        if isinstance(failure, RetryReason):
            raise RetryableError(failure, f"scripted {step.name}")
        raise failure


class VirtualClock:
    """A monotonic clock that only moves when slept on.

    Pass ``clock`` to ``Request(clock=...)`` and ``sleep`` to
    ``RetryOrchestrator(sleep=...)`` (``sleep_sync`` to ``execute_sync(...,
    sleep=...)``): backoffs then take no real time and ``sleeps`` records each
    requested delay. Under ``instant_retries()`` the backoffs still sleep on it (it is
    what moves the clock to a timeout). Hedging is not driven by it: ``hedge`` times its
    copies on the event loop's clock (a ``HedgePolicy`` delay of 1 s takes 1 real second).
    """

    #: Marks a clock that only moves when slept on: ``execute_sync`` refuses to wait on one
    #: for a deadline on another (see ``sdkcore._execute_sync._check_clocks``).
    sdkcore_virtual = True

    def __init__(self, start: float = 1000.0) -> None:
        self.now = _seconds(start, "VirtualClock(start)", minimum=None)
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (finite, >= 0: the clock is monotonic)."""
        self.now += _seconds(seconds, "VirtualClock.advance(seconds)")

    async def sleep(self, seconds: float) -> None:
        """Move the clock by ``seconds`` (finite, >= 0) and record it in ``sleeps``."""
        self._slept(seconds, "VirtualClock.sleep(seconds)")
        await anyio.lowlevel.checkpoint()

    def sleep_sync(self, seconds: float) -> None:
        """:meth:`sleep` for ``execute_sync(..., sleep=clock.sleep_sync)``: moves the clock
        and records the delay, without blocking."""
        self._slept(seconds, "VirtualClock.sleep_sync(seconds)")

    def _slept(self, seconds: float, what: str) -> None:
        self.now += _seconds(seconds, what)
        self.sleeps.append(seconds)


_LAZY = {"GrpcStatus", "ScriptedGrpcServer", "grpc_server"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sdkcore.testing' has no attribute {_show(name)}")
    try:
        from . import _grpc
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "grpc":
            raise ImportError(
                f"sdkcore.testing.{name} needs grpcio: {install_hint('grpc')}"
            ) from exc
        raise
    value = getattr(_grpc, name)
    globals()[name] = value
    return value
