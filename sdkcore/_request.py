"""Request: what the orchestrator retries (RFC 0049 "Request Annotation")."""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import attrs

from . import _runtime
from ._action import RetryAction
from ._context import CancellationReason, ErrorContext, client_context_text, describe_error
from ._duration import MAX_SECONDS, to_seconds
from ._reason import RetryReason
from ._retry_state import RequestState, RetryState
from ._untrusted import show

__all__ = ["DEFAULT_TIMEOUT", "DispatchInfo", "Request", "RequestState", "RetryStrategy"]

#: The default request timeout: the Couchbase SDKs' KV timeout, 2.5 s.
DEFAULT_TIMEOUT = timedelta(milliseconds=2500)

_DEFAULT_SECONDS = DEFAULT_TIMEOUT.total_seconds()
_ids = itertools.count(1)
_EMPTY: Mapping[str, Any] = MappingProxyType({})


#: The request whose attempt is being sent in this task or thread (set by the doors
#: around ``send``): a Request built meanwhile takes the earlier of the two deadlines.
#: It holds a mark, ``[request, reset token, unsent]`` (``unsent``: set by
#: :func:`dispatch_unsent`), that the door empties (``mark[0] = None``) when the dispatch
#: ends: a task spawned by ``send`` keeps a copy of the context, hence the mark, for as
#: long as it lives, and must neither inherit a finished request's deadline nor keep it
#: alive. A list, not an object of a class of its own (no Python ``__init__`` frame); the
#: mark's ``ContextVar.set`` and ``reset`` cost about 2,500 instructions of a call with a
#: deadline (bench/README, "piece-mark").
_DISPATCHING: ContextVar[list[Any] | None] = ContextVar("sdkcore_dispatching", default=None)


def dispatch_unsent(reason: RetryReason | None = None) -> None:
    """Say, from inside ``send``, that the attempt being sent is cut before anything of it
    was written: call it in the handler of the cancellation that cuts a wait before the
    write (a connection lock, a pool, a queue), then re-raise that cancellation.

    When that same cancellation reaches the door (the request's deadline,
    ``Request.cancel()``, the caller's own), the attempt is booked ``NOT_SENT`` (for
    ``reason`` if given) instead of cut in flight: a write's timeout stays unambiguous.
    Any other cancellation (``send`` caught the first and wrote after all) is a cut in
    flight, and an error raised afterwards is booked as it is. A hedge's copy cut so is
    booked not sent too. It marks the dispatch of ``execute`` (when the request has a
    deadline), ``attempt()`` and ``hedge``; elsewhere (``execute`` without a deadline, the
    sync door, no door) it does nothing.
    sdkcore's limiters call it for a wait in their queue (rfc/0009).
    Called while no exception is being handled, it raises RuntimeError: it would mark
    no cut, and a write sent later could not be told apart."""
    cut = sys.exc_info()[1]
    if cut is None:
        raise RuntimeError(
            "dispatch_unsent() must be called in the handler of the cancellation that cut "
            "the wait before the write (except BaseException: dispatch_unsent(); raise); "
            "no exception is being handled here"
        )
    mark = _DISPATCHING.get()
    if mark is not None:
        # The cancellation being handled: only that one, reaching the door, says "not
        # sent" (a send that caught it and wrote after all is cut later by another one).
        mark[2] = (reason, cut)


def dispatching() -> Request | None:
    """The request whose attempt is being sent in this task or thread, if any.

    None outside a door's ``send`` (``execute`` when its request has a deadline,
    ``execute_sync``, ``attempt()``, a hedge copy), and in a task spawned there once that
    dispatch has ended. The one
    reader of ``_DISPATCHING``'s mark for the rest of sdkcore (the breaker, the gRPC
    channels): its shape stays this module's business.
    """
    mark = _DISPATCHING.get()
    return None if mark is None else mark[0]


@attrs.frozen(slots=True)
class DispatchInfo:
    """What a dispatcher puts on the wire for one attempt (:meth:`Request.dispatch_info`).

    ``attempt``: the 1-based number of the attempt being sent (gRPC's
    ``grpc-previous-rpc-attempts`` is ``attempt - 1``). ``time_left``: seconds until
    the request's deadline (0 once passed), inherited or bounded by an enclosing
    trio/anyio cancel scope as :attr:`Request.time_left` is; None when nothing bounds
    it: a server-side timeout (Couchbase query's ``timeout``, gRPC's
    ``grpc-timeout``) should be this, not the request's full timeout.
    """

    attempt: int
    time_left: float | None


@runtime_checkable
class RetryStrategy(Protocol):
    """Decides whether and when a failed request is retried (RFC 0049 "Retry Strategies").

    ``retry_after`` may be a plain method returning a :class:`RetryAction` or a
    coroutine (it may await I/O): the orchestrator awaits what it returns when that
    is not a RetryAction. ``execute_sync`` takes only strategies that decide
    synchronously. The built-ins are in :mod:`sdkcore._strategy`; the protocol lives
    here, beside the :class:`Request` that carries one, so neither module imports
    the other's.
    """

    def retry_after(
        self, request: Request, reason: RetryReason
    ) -> RetryAction | Awaitable[RetryAction]: ...


class Request(RetryState):
    """One logical operation, retried attempt by attempt.

    The application sets ``idempotent``, ``timeout``, ``retry_strategy`` and
    ``client_context``; the retry state (``retry_attempts``, ``retry_reasons``,
    completion) is read-only and changed only by the :class:`RetryOrchestrator`.

    ``timeout`` is a ``timedelta`` or seconds (> 0), or ``None`` for no deadline of
    its own; the deadline starts when the request is created. A request created while
    another request is being sent (inside ``send`` of ``execute``, ``execute_sync``,
    ``hedge``, or an ``attempt()`` block: same task or thread, or a task or thread
    that copied its context) never outlives that one: its :attr:`deadline` is the
    earlier of the two (deadline in), ``timeout`` stays what it was built with, and
    :attr:`time_left` and :meth:`dispatch_info` give the inherited time. Once that
    dispatch has ended, a request created in a task it spawned inherits nothing.
    ``clock`` (seconds, monotonic) is injectable for tests; it must be the clock
    the orchestrator waits on.
    """

    __slots__ = (
        "__weakref__",
        "_cancel_scope",
        "_clock",
        "_context",
        "_deadline",
        "_deadline_from",
        "_id",
        "_idempotent",
        "_memo",
        "_name",
        "_start",
        "_strategy",
        "_timeout_s",
        "_trace",
    )

    def __init__(
        self,
        *,
        name: str = "request",
        idempotent: bool = False,
        timeout: timedelta | float | None = DEFAULT_TIMEOUT,
        retry_strategy: RetryStrategy | None = None,
        client_context: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idempotent is not True and idempotent is not False:
            raise TypeError(f"Request.idempotent must be a bool, got {idempotent!r}")
        if not isinstance(name, str):
            raise TypeError(f"Request.name must be a str, got {name!r}")
        if client_context is None:
            context = _EMPTY
        elif isinstance(client_context, Mapping):
            context = MappingProxyType(dict(client_context))
        else:
            raise TypeError(
                "Request.client_context must be a Mapping or None, "
                f"got {type(client_context).__name__}"
            )
        if retry_strategy is not None and (
            isinstance(retry_strategy, type)
            or not callable(getattr(retry_strategy, "retry_after", None))
        ):
            raise TypeError(
                "Request.retry_strategy must be a RetryStrategy instance (an object with a "
                f"retry_after(request, reason) method) or None, got {retry_strategy!r}"
            )
        start = clock() if clock is time.monotonic else _first_reading(clock)
        if timeout is None:
            seconds = math.inf
        elif timeout is DEFAULT_TIMEOUT:
            seconds = _DEFAULT_SECONDS
        elif type(timeout) is float and 0.0 < timeout <= MAX_SECONDS:
            seconds = timeout
        else:
            seconds = to_seconds(
                timeout,
                "Request.timeout",
                allow_zero=False,
                none_hint="a timeout can be None for no deadline",
            )
        self._id = next(_ids)
        self._name = name
        self._idempotent = idempotent
        self._strategy = retry_strategy
        self._context = context
        self._timeout_s = seconds
        self._clock = clock
        self._start = start
        self._deadline = start + seconds
        self._deadline_from: tuple[int, str, float] | None = None  # (id, name, timeout)
        mark = _DISPATCHING.get()
        if mark is not None:
            outer: Request | None = mark[0]  # None once that dispatch has ended
            if outer is not None and outer._deadline != math.inf:
                # Made inside another request's send: never outlive it (deadline in).
                left = outer._deadline - outer._clock()
                inherited = start + (left if left > 0.0 else 0.0)
                if inherited < self._deadline:
                    self._deadline = inherited
                    # the request whose timeout set it (a snapshot: the outer is not kept)
                    self._deadline_from = outer._deadline_from or (
                        outer._id,
                        outer._name,
                        outer._timeout_s,
                    )
        self._cancel_scope: Any = None
        self._memo: tuple[Any, ...] | None = None  # see _resolved_by
        self._trace: Any = None  # its telemetry (sdkcore._telemetry.RequestTrace), if any
        RetryState.__init__(self)

    # -- what the application set (read-only once built) ----------------------
    @property
    def id(self) -> int:
        """Unique in this process; shown in logs and error contexts."""
        return self._id

    @property
    def name(self) -> str:
        return self._name

    @property
    def idempotent(self) -> bool:
        return self._idempotent

    @property
    def _ambiguous(self) -> bool:
        """The rule of rfc/0001 "Ambiguity": an ending without an answer leaves it unknown
        whether the request was applied (not idempotent, and some attempt may have been)."""
        return self._maybe_applied and not self._idempotent

    @property
    def retry_strategy(self) -> RetryStrategy | None:
        """The per-request strategy, or None for the orchestrator's default. Fixed when
        the request is built (``Request(retry_strategy=...)``)."""
        return self._strategy

    @retry_strategy.setter
    def retry_strategy(self, value: object) -> None:
        raise AttributeError(
            f"Request.retry_strategy is fixed when the request is built (request {self._id}, "
            f"{self._name!r}): pass Request(..., retry_strategy=...) for a new request, or "
            "RetryOrchestrator(default_strategy=...) for the default of every request"
        )

    @property
    def client_context(self) -> Mapping[str, Any]:
        """Read-only view of the caller's context (e.g. ``{"robot": True}``); empty if None."""
        return self._context

    # -- the deadline ------------------------------------------------------------
    @property
    def timeout(self) -> timedelta | None:
        """The timeout the request was built with (None: none of its own).

        Not the time it has: a request built inside another request's ``send``
        inherits that one's deadline (see :attr:`deadline`, :attr:`time_left`).
        """
        return None if self._timeout_s == math.inf else timedelta(seconds=self._timeout_s)

    @property
    def deadline(self) -> float:
        """The deadline the doors enforce, on the request's ``clock`` (``math.inf``: none).

        The earlier of the request's timeout and the deadline it inherited from an
        outer request. An enclosing trio/anyio cancel scope is not part of it: the
        scope cuts by itself, as a cancellation the scope catches (it bounds
        :attr:`time_left` and :meth:`dispatch_info` instead).

        ``clock`` defaults to ``time.monotonic``, which is not the event loop's clock on
        every backend (trio's differs): to arm a cancel scope use :meth:`loop_deadline`.
        """
        return self._deadline

    def loop_deadline(self) -> float:
        """The deadline on the running event loop's clock (``anyio.current_time()``).

        ``math.inf`` without a timeout. Call it from async code (asyncio or trio); it
        is what ``anyio.CancelScope(deadline=...)`` and ``trio.CancelScope`` expect.
        """
        if self._deadline == math.inf:
            return math.inf
        now: float = _runtime.current().now()
        return now + (self._deadline - self._clock())

    @property
    def clock(self) -> Callable[[], float]:
        """The clock (seconds, monotonic) the request's deadline is kept on."""
        return self._clock

    @property
    def elapsed(self) -> timedelta:
        return timedelta(seconds=self._clock() - self._start)

    @property
    def time_left(self) -> timedelta | None:
        """Time until the deadline (zero once passed), or None when nothing bounds the request.

        Counts the request's own :attr:`deadline` (its timeout, or an outer request's
        inherited: see the class) and, read on trio or on anyio, the deadline of the
        cancel scopes enclosing the caller (``current_effective_deadline()``). So a
        request built with ``timeout=None`` still has a time left inside another
        request's ``send`` or inside ``trio.move_on_after(...)``.
        """
        left = self._left()
        if left == math.inf:
            return None
        return timedelta(seconds=left if left > 0.0 else 0.0)

    def dispatch_info(self) -> DispatchInfo:
        """The attempt number and the time left, to put on the wire (deadline out).

        Call it inside ``send``: ``info = request.dispatch_info()``, then e.g. send
        ``timeout=f"{int(info.time_left * 1000)}ms"`` with a query. ``time_left`` is
        :attr:`time_left` in seconds (None: nothing bounds the request).
        """
        # The attempts before this one: the retries booked (a hedge's copies sent count
        # before they fail) or the attempts booked failed (a hand-wired loop may try again
        # without maybe_retry), whichever is more; the two agree on every other loop.
        retries = self._retries
        failed = len(self._history)
        number = (retries if retries > failed else failed) + 1
        left = self._left()
        if left == math.inf:
            return DispatchInfo(number, None)
        return DispatchInfo(number, left if left > 0.0 else 0.0)

    def _left(self) -> float:
        """Seconds to the earlier of the deadline and the enclosing cancel scopes' (inf: none).

        The scopes are on the loop's clock, so only a request on the default clock
        (``time.monotonic``) compares with them; an injected clock (tests) is its own
        timeline.
        """
        deadline = self._deadline
        left = math.inf if deadline == math.inf else deadline - self._clock()
        if self._clock is time.monotonic:
            scope = _scope_left()
            if scope < left:
                return scope
        return left

    # -- application control ----------------------------------------------------
    def cancel(self) -> None:
        """Cancel the request from the application (on the event loop's thread).

        A request waiting in retry backoff wakes at once (with or without a timeout),
        and so does an attempt in flight inside ``attempt()``, and inside ``execute``
        when the request has a timeout; the caller of ``maybe_retry``/``execute``/
        ``hedge`` gets RequestCanceledException (CANCELLED_VIA_CONTEXT), even if an
        answer arrived meanwhile. Without a timeout, an attempt in flight in
        ``execute`` runs to its end and its result is discarded (no retry is booked
        for it). ``execute_sync``'s backoff wakes too (with its default ``sleep``); a
        blocking ``send`` cannot be cut. A ``send`` (or strategy) that calls
        ``cancel()`` itself is cut at its next await (on asyncio at the loop's next
        turn). Cancelling a completed request does nothing.
        """
        # Locked whatever door runs the request: it may end it on another thread.
        if not self._end_locked(RequestState.CANCELLED, CancellationReason.CANCELLED_VIA_CONTEXT):
            return  # completed already
        scope = self._cancel_scope
        if scope is not None:
            scope.cancel()

    # -- what the doors call besides the transitions of RetryState ---------------
    def _dispatching(self) -> Any:
        """Mark this request as the one being sent in this task or thread.

        Returns the mark, for :meth:`_dispatched_done` (same task or thread) when the
        dispatch ends: requests built in between inherit this request's deadline.
        """
        # the request, the token, unsent: (reason, the cut) once dispatch_unsent() said so
        mark: list[Any] = [self, None, None]
        mark[1] = _DISPATCHING.set(mark)
        return mark

    @staticmethod
    def _dispatch_was_unsent(mark: Any, cut: BaseException) -> bool:
        """Whether ``cut``, the cancellation reaching the door, is the one that cut the
        dispatch of ``mark`` before it sent anything (:func:`dispatch_unsent`, called while
        handling it)."""
        unsent = mark[2]
        return bool(unsent) and unsent[1] is cut

    @staticmethod
    def _dispatch_unsent_reason(mark: Any) -> RetryReason | None:
        """The reason :func:`dispatch_unsent` gave for the cut, if any."""
        unsent = mark[2]
        return unsent[0] if unsent else None

    @staticmethod
    def _dispatched_done(mark: Any) -> None:
        """End a :meth:`_dispatching`: a task spawned meanwhile, which still holds the
        mark in its context, no longer inherits the deadline nor keeps the request."""
        mark[0] = None
        _DISPATCHING.reset(mark[1])

    @staticmethod
    def _dispatch_lost(outer: Any) -> None:
        """A :meth:`_dispatching` whose mark never reached its door: an interrupt (a
        KeyboardInterrupt on the sync door's thread) raised after the mark was set but
        before the door held it. ``outer``: the mark before it (``_DISPATCHING.get()``
        when the door began). Without this, every request the thread built later would
        inherit the lost request's deadline."""
        mark = _DISPATCHING.get()
        if mark is None or mark is outer:
            return  # never set
        mark[0] = None
        if mark[1] is not None:
            _DISPATCHING.reset(mark[1])
        else:
            _DISPATCHING.set(outer)

    def _resolved_by(self, door: object, resolve: Callable[[Request], tuple[Any, ...]]) -> Any:
        """What ``door`` (an orchestrator) works out once per request: ``(door, *resolve(self))``.

        The strategy to ask and the debug logger: inputs that do not change while the
        request runs. A hand-wired loop calls ``maybe_retry`` once per failure, and
        asking again each time cost about 0.7 us per retry (bench/README,
        "bench_doors.py").
        """
        memo = self._memo
        if memo is None or memo[0] is not door:
            memo = self._memo = (door, *resolve(self))
        return memo

    def _set_cancel_hook(self, hook: Any) -> Any:
        """``Request.cancel()`` calls ``hook.cancel()`` from now on; returns the previous hook."""
        previous = self._cancel_scope
        self._cancel_scope = hook
        return previous

    def error_context(
        self,
        reason: RetryReason | None = None,
        *,
        strategy: str | None = None,
        extra: Mapping[str, Any] | None = None,
        in_flight: bool = False,
    ) -> ErrorContext:
        """A snapshot of this request for an exception's ``context``.

        A request whose deadline came from an outer request (built inside its
        ``send``) names it in ``extra["deadline_from"]``: ``{"request_id",
        "request_name", "timeout_ms"}`` of the request whose timeout set the deadline.
        """
        if reason is not None and type(reason) is not RetryReason:
            raise TypeError(
                f"Request.error_context(reason) must be an sdkcore.RetryReason member or None, "
                f"got {show(reason)}"
            )
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(
                f"Request.error_context(extra) must be a mapping or None, got {show(extra)}"
            )
        outer = self._deadline_from
        if outer is not None and (extra is None or "deadline_from" not in extra):
            extra = {**(extra or _EMPTY), "deadline_from": _deadline_from(outer)}
        return ErrorContext(
            request_id=self.id,
            request_name=self.name,
            idempotent=self.idempotent,
            retry_attempts=self.retry_attempts,
            retry_reasons=self.retry_reasons,
            timeout=self.timeout,
            elapsed=timedelta(seconds=self._clock() - self._start),
            reason=reason,
            cancellation_reason=self.cancellation_reason,
            strategy=strategy,
            extra=_EMPTY if extra is None else MappingProxyType(dict(extra)),
            last_error=describe_error(self.last_error),
            in_flight=in_flight,
            attempts=self.attempts,
            client_context=client_context_text(self._context),
        )

    def __repr__(self) -> str:
        return (
            f"<Request id={self.id} name={self.name!r} idempotent={self.idempotent} "
            f"retry_attempts={self.retry_attempts} state={self.state.value}>"
        )


def _first_reading(clock: Any) -> float:
    """An injected clock's first reading, the request's start: a clock that is not a
    plain callable returning seconds is refused here, naming it, before it is kept."""
    if not callable(clock):
        raise TypeError(
            f"Request.clock must be a callable () -> seconds (monotonic), got {show(clock)}"
        )
    start = clock()
    if isinstance(start, bool) or not isinstance(start, (int, float)):
        close = getattr(start, "close", None)
        if close is not None:
            close()  # an async clock's coroutine, never awaited: no warning
        raise TypeError(
            f"Request.clock must be a callable () -> seconds (monotonic), called "
            f"synchronously; {show(clock)} returned {show(start)}"
        )
    return start


def _deadline_from(outer: tuple[int, str, float]) -> dict[str, Any]:
    request_id, name, seconds = outer
    return {
        "request_id": request_id,
        "request_name": name,
        "timeout_ms": None if seconds == math.inf else round(seconds * 1000.0, 3),
    }


def _scope_left() -> float:
    """Seconds left before the deadline of the cancel scopes enclosing the caller.

    trio (and anyio on trio, whose scopes are trio's): ``trio.current_effective_deadline()``.
    anyio on asyncio: anyio's own scopes, read only once anyio's asyncio backend is
    loaded (an application that uses anyio loaded it; sdkcore never imports it).
    ``math.inf`` otherwise: asyncio's own ``asyncio.timeout()`` is not visible.
    ``-inf`` when the caller is already cancelled.

    The trio half is the runtime's (``_runtime._trio.scope_left``); the anyio-on-asyncio
    half stays here, read through ``sys.modules``, so that ``time_left`` read on a
    thread without a loop (``execute_sync``) never loads the asyncio backend.
    """
    sniffio = sys.modules.get("sniffio")
    if sniffio is not None and sniffio.thread_local.name == "trio":
        left: float = _runtime.current().scope_left()
        return left
    backend = sys.modules.get("anyio._backends._asyncio")
    if backend is None:
        return math.inf
    asyncio = sys.modules["asyncio"]  # imported by anyio's asyncio backend
    loop = asyncio._get_running_loop()
    if loop is None:  # a thread without a loop (execute_sync)
        return math.inf
    try:
        deadline: float = backend.AsyncIOBackend.current_effective_deadline()
    except Exception:  # outside a task, or an anyio without it: no scope seen
        return math.inf
    if deadline == math.inf or deadline == -math.inf:
        return deadline
    now: float = loop.time()
    return deadline - now
