"""Load shedding on an sdkcore channel: one limiter and/or throttle around every attempt.

:class:`Gate` holds the channel's :class:`sdkcore.AdaptiveThrottle` and its
:class:`sdkcore.ConcurrencyLimiter` (or :class:`sdkcore.AdaptiveConcurrencyLimiter`),
taken in the documented order, throttle then limiter (rfc/0009). Every attempt sdkcore
makes (first attempts, retries, transparent re-sends, hedged copies), of every call
shape, takes a permit first and gives it back when grpc.aio's call for the attempt is
done (answered, failed, cancelled, its deadline reached or its channel closed; for a
stream: its status known). Two wrappers apply it, one rule:

* :class:`GatedMultiCallable` wraps the channel helpers' grpc.aio multi-callables, of
  every shape (sdkcore drives their calls directly);
* :class:`GatedContinuation` wraps the continuation sdkcore's interceptors call for
  each attempt: every shape on a channel built by hand with
  ``RetryController.interceptors()``.

A refusal sends nothing: the attempt is a finished call of its shape that failed
UNAVAILABLE with :class:`LocalRefusal` as its error, which the retry loop treats as
A6's "never left the client" (transparent retry with backoff, effect NOT_SENT;
rfc/0009 "On gRPC channels").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

import grpc
from grpc import aio
from grpc._common import CYGRPC_STATUS_CODE_TO_STATUS_CODE
from grpc._cython import cygrpc
from grpc.aio import _base_call

from .._adaptive_limiter import AdaptiveConcurrencyLimiter
from .._limiter import ConcurrencyLimiter
from .._throttle import AdaptiveThrottle
from .._untrusted import show as _show
from ._intercepted import interceptors_task, own_call
from ._peer_status import stand_in, watch

__all__: list[str] = []

_REQUEST_STREAMING = (_base_call.StreamUnaryCall, _base_call.StreamStreamCall)
_OK = grpc.StatusCode.OK
_CANCELLED = grpc.StatusCode.CANCELLED
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED
_READY = cygrpc.ConnectivityState.ready
_EMPTY = aio.Metadata()


class LocalRefusal(aio.AioRpcError):  # type: ignore[misc]
    """An attempt the channel's limiter or throttle refused: nothing was sent.

    A ``grpc.aio.AioRpcError`` with status UNAVAILABLE; its ``details()`` name the
    limiter or throttle, and ``__cause__`` is sdkcore's ``RetryableError``.
    """


class _Outcome(Exception):
    """How an admitted attempt ended: its status (``code()``, for the throttle's
    ``is_rejection``) and, as ``__cause__``, what it says about the endpoint's latency
    in the words of the adaptive limiter's judge (``_adaptive_limiter._judge``): a
    ``TimeoutError`` (a drop; always for DEADLINE_EXCEEDED), a ``ConnectionError``
    (nothing); none: an answer (a round-trip sample)."""

    def __init__(self, code: grpc.StatusCode, cause: BaseException | None = None) -> None:
        super().__init__(code.name)
        self._code = code
        if cause is None and code is _DEADLINE_EXCEEDED:
            cause = TimeoutError("gRPC DEADLINE_EXCEEDED: the attempt timed out")
        self.__cause__ = cause

    def code(self) -> grpc.StatusCode:
        return self._code


def _ended(call: Any, status: Any = None) -> BaseException | None:
    """None (OK), CancelledError, or an :class:`_Outcome` with the status of a done call
    (``status``: the one :class:`PeerStatus` kept for it, else the call's own).

    Two statuses are not answers (rfc/0009, "On gRPC channels"): DEADLINE_EXCEEDED is
    a timeout (the attempt's deadline cutting it, or the server's own), a drop for the
    adaptive limiter; UNAVAILABLE with nothing received (no initial metadata, no
    trailing metadata) while the channel is not READY now says nothing about latency (a
    connection that could not be made or was lost). That is a looser test than the one
    ``_call.py`` books an attempt "never left" on (there the channel must also have been
    not READY when the attempt started, and be failing to connect now): a server's
    UNAVAILABLE followed at once by the channel going idle (a GOAWAY) is no sample
    either, which costs the limiter one sample. grpc.aio's stand-in for a failed write,
    kept when the server's status never came (``_peer_status``), is no sample either
    (an accept for the throttle). Every other status is the endpoint's answer: its round
    trip is a sample.
    """
    cython = getattr(call, "_cython_call", None)
    if cython is None:
        return None  # not grpc.aio's own call (an application interceptor's): an accept
    try:
        if status is None:
            status = cython._status
        code = CYGRPC_STATUS_CODE_TO_STATUS_CODE[status.code()]
    except Exception:  # no status readable: counted as an accept by the throttle
        return _Outcome(grpc.StatusCode.UNKNOWN)
    if code is _OK:
        return None
    if code is _CANCELLED:
        return asyncio.CancelledError()
    if stand_in(status):  # the server's status never came (_peer_status): no latency sample
        return _Outcome(code, ConnectionError("gRPC: the server's status is unknown"))
    if code is _UNAVAILABLE and _no_connection(cython, status):
        return _Outcome(code, ConnectionError("gRPC UNAVAILABLE: no connection to the target"))
    return _Outcome(code)


def _no_connection(cython: Any, status: Any) -> bool:
    """Nothing came back for the attempt and its channel is not connected now."""
    try:
        if cython._initial_metadata or status.trailing_metadata():
            return False  # the server sent something: it answered
        return bool(cython._channel.check_connectivity_state(False) != _READY)
    except Exception:  # grpc.aio's internals moved: an answer, as before
        return False


class Gate:
    """The channel's throttle and limiter, in that order (rfc/0009)."""

    __slots__ = ("limiter", "throttle")

    def __init__(self, limiter: Any, throttle: Any) -> None:
        if limiter is not None and not isinstance(
            limiter, (ConcurrencyLimiter, AdaptiveConcurrencyLimiter)
        ):
            raise TypeError(
                "RetryController(limiter=...) must be an sdkcore.ConcurrencyLimiter or "
                "AdaptiveConcurrencyLimiter (one per channel target), or None, "
                f"got {_show(limiter)}"
            )
        if throttle is not None and not isinstance(throttle, AdaptiveThrottle):
            raise TypeError(
                "RetryController(throttle=...) must be an sdkcore.AdaptiveThrottle, or None, "
                f"got {_show(throttle)}"
            )
        self.limiter = limiter
        self.throttle = throttle

    def enter(self) -> tuple[Any, Any]:
        """(throttle guard, permit) taken for one attempt; raises the refusal (RetryableError)."""
        throttle = self.throttle
        tguard = None
        if throttle is not None:
            tguard = throttle.guard()
            tguard.__enter__()
        limiter = self.limiter
        permit = None
        if limiter is not None:
            permit = limiter.guard()
            try:
                permit.__enter__()
            except BaseException as exc:
                if tguard is not None:  # refused locally: NOT_SENT, the throttle records nothing
                    tguard.__exit__(type(exc), exc, None)
                raise
        return tguard, permit

    @staticmethod
    def exit(held: tuple[Any, Any], exc: BaseException | None) -> None:
        """Give back what :meth:`enter` took: the permit first, then the throttle's record."""
        tguard, permit = held
        try:
            if permit is not None:
                permit.__exit__(None if exc is None else type(exc), exc, None)
        finally:
            if tguard is not None:
                tguard.__exit__(None if exc is None else type(exc), exc, None)


class RefusedCall:
    """An attempt refused locally: a finished grpc.aio-like call that failed UNAVAILABLE.

    The part every call shape shares; the classes below add each shape's own methods.
    """

    def __init__(self, error: LocalRefusal) -> None:
        self._error = error

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        # As grpc.aio's: never inside the caller's frame.
        asyncio.get_running_loop().call_soon(callback, self)

    def time_remaining(self) -> float | None:
        return None

    async def initial_metadata(self) -> Any:
        return _EMPTY

    async def trailing_metadata(self) -> Any:
        return _EMPTY

    async def code(self) -> Any:
        return _UNAVAILABLE

    async def details(self) -> str:
        return str(self._error.details())

    async def debug_error_string(self) -> str | None:
        return str(self._error.debug_error_string())

    async def wait_for_connection(self) -> None:
        return None

    def __await__(self) -> Generator[Any, None, Any]:
        raise self._error
        yield  # pragma: no cover - makes this a generator

    # -- the streaming shapes ------------------------------------------------------------
    async def read(self) -> Any:
        raise self._error

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        raise self._error
        yield  # pragma: no cover - makes this an async generator

    async def write(self, request: Any) -> None:
        raise asyncio.InvalidStateError("RPC already finished.")  # as grpc.aio's

    async def done_writing(self) -> None:
        return None  # as grpc.aio's on a finished call

    @property
    def _done_writing_flag(self) -> bool:
        return False


class RefusedUnaryUnaryCall(RefusedCall, _base_call.UnaryUnaryCall):  # type: ignore[misc]
    pass


class RefusedUnaryStreamCall(RefusedCall, _base_call.UnaryStreamCall):  # type: ignore[misc]
    pass


class RefusedStreamUnaryCall(RefusedCall, _base_call.StreamUnaryCall):  # type: ignore[misc]
    pass


class RefusedStreamStreamCall(RefusedCall, _base_call.StreamStreamCall):  # type: ignore[misc]
    pass


def _refusal(exc: BaseException) -> LocalRefusal:
    error = LocalRefusal(
        _UNAVAILABLE,
        _EMPTY,
        _EMPTY,
        f"sdkcore: refused locally, nothing was sent: {exc}",
        f"sdkcore: {type(exc).__name__}: {exc}",
    )
    error.__cause__ = exc
    return error


class GatedMultiCallable:
    """grpc.aio's multi-callable ``inner`` (any call shape) with the channel's
    :class:`Gate` around every call it makes (each one attempt of sdkcore's, or a call
    sdkcore does not retry).

    ``refused``: the call class of the shape a refusal is made into (a hedge opened as a
    unary-stream call passes :class:`RefusedUnaryStreamCall`, sdkcore._hedging).
    """

    __slots__ = ("_gate", "_inner", "_refused")

    def __init__(
        self, gate: Gate, inner: Any, refused: type[RefusedCall] = RefusedUnaryUnaryCall
    ) -> None:
        self._gate = gate
        self._inner = inner
        self._refused = refused

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        gate = self._gate
        try:
            held = gate.enter()
        except Exception as exc:  # the limiter's or throttle's RetryableError
            return self._refused(_refusal(exc))
        try:
            call = self._inner(request, **kwargs)
        except BaseException as exc:  # nothing sent (a closed channel's UsageError)
            Gate.exit(held, exc)
            raise
        _hold(held, call)
        return call


def _hold(held: tuple[Any, Any], call: Any) -> None:
    """Give ``held`` back when ``call`` is done, with the status the server sent it
    (a request-streaming call: ``_peer_status.watch``, not grpc.aio's stand-in for a
    write that failed).

    ``call`` is what the rest of grpc.aio's interceptor chain made: grpc.aio's call,
    or an application interceptor's object (a finished ``UnaryUnaryCallResponse``
    takes no callback; an object that fails to take one is given back now rather
    than never). grpc.aio's intercepted call (the channel helpers' multi-callables on a
    channel with application interceptors) is held by the call its interceptors make
    (``_intercepted``): its own status says nothing of the endpoint.
    """
    task = interceptors_task(call)
    if task is not None:

        def resolved(done: asyncio.Task[Any]) -> None:
            if done.cancelled():  # cancelled before the interceptors made a call
                Gate.exit(held, asyncio.CancelledError())
                return
            error = done.exception()
            if error is None:
                _hold(held, done.result())
            elif isinstance(error, aio.AioRpcError):  # an interceptor's error: its status
                code = error.code()
                Gate.exit(held, asyncio.CancelledError() if code is _CANCELLED else _Outcome(code))
            else:
                Gate.exit(held, error)

        task.add_done_callback(resolved)
        return
    call = own_call(call)  # an interceptor's response iterator: the call it came from
    if isinstance(call, _REQUEST_STREAMING) and getattr(call, "_cython_call", None) is not None:
        # Only a call that writes messages can get grpc.aio's stand-in status.
        watch(call).when_known(lambda status: Gate.exit(held, _ended(call, status)))
        return
    try:
        if not call.done():
            call.add_done_callback(lambda finished: Gate.exit(held, _ended(finished)))
            return
    except Exception:
        pass
    Gate.exit(held, _ended(call))


class GatedContinuation:
    """An interceptor's ``continuation`` with the channel's :class:`Gate` around every
    call made through it (each one attempt of sdkcore's, of any call shape).

    ``refused`` is the call class of the shape (e.g. :class:`RefusedUnaryStreamCall`),
    made from the :class:`LocalRefusal` when the gate refuses: then the continuation is
    not called and nothing of the attempt is written (a client-streaming call's messages
    wait in its replay buffer for the next attempt). Between attempts (sdkcore's
    backoff) the call holds no permit.
    """

    __slots__ = ("_gate", "_inner", "_refused")

    def __init__(
        self, gate: Gate, inner: Callable[..., Awaitable[Any]], refused: type[RefusedCall]
    ) -> None:
        self._gate = gate
        self._inner = inner
        self._refused = refused

    async def __call__(self, details: Any, request: Any) -> Any:
        gate = self._gate
        try:
            held = gate.enter()
        except Exception as exc:  # the limiter's or throttle's RetryableError
            return self._refused(_refusal(exc))
        try:
            call = await self._inner(details, request)
        except BaseException as exc:  # nothing sent (a closed channel), or cancelled
            Gate.exit(held, exc)
            raise
        _hold(held, call)
        return call
