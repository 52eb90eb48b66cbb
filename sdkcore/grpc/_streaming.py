"""The three streaming call shapes (A6 retries until the call commits).

A response-streaming call commits on its first response headers or message; a
request-streaming call replays its buffered messages (``_replay``) on each attempt.

On the channel helpers' channels the application gets sdkcore's call object itself
(the multi-callables at the end of this module: no grpc.aio interceptor task between
the application and the call; each attempt is a call of grpc.aio's own multi-callable,
the application's interceptors inside); on a channel built by hand with
``RetryController.interceptors()``, grpc.aio's interceptor wrapper holds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any, NamedTuple

import grpc
from grpc import aio
from grpc.aio import _base_call

from .._context import AttemptEffect
from .._request import RequestState, dispatching
from ._call import Continuation, _Call, _TracedCall, outer_details
from ._controller import _Controller, channel_closed_error
from ._gate import (
    GatedMultiCallable,
    RefusedCall,
    RefusedStreamStreamCall,
    RefusedStreamUnaryCall,
    RefusedUnaryStreamCall,
)
from ._intercepted import interceptors_task, own_call, response_iterator
from ._metadata import _client_trailing
from ._peer_status import PeerStatus, error_of, is_ok, stand_in_error, watch
from ._policy import (
    NO_CODES,
    PUSHBACK_KEY,
    costs_token,
    parse_pushback,
    time_out_at_deadline,
)
from ._replay import _ReplayBuffer
from ._unary import BoundedMultiCallable

__all__: list[str] = []

_EOF = aio.EOF
_OK = grpc.StatusCode.OK
_CANCELLED = grpc.StatusCode.CANCELLED


class _Outcome:
    """How the driver ended: committed to ``call`` (maybe with a first message), or finished."""

    __slots__ = ("call", "error", "first", "has_first")

    def __init__(self, call: Any = None, error: Any = None) -> None:
        self.call = call
        self.error = error
        self.first: Any = None
        self.has_first = False


class _End(NamedTuple):
    """How a committed call ended, as its accessors and its accounting read it."""

    code: Any  # grpc.StatusCode
    details: str
    trailing: Any  # aio.Metadata
    debug: str | None
    error: aio.AioRpcError | None  # None: OK

    @classmethod
    def of(cls, error: aio.AioRpcError) -> _End:
        return cls(
            error.code(),
            error.details(),
            error.trailing_metadata(),
            error.debug_error_string(),
            error,
        )


class _RetryingCall:
    """The call object handed to grpc.aio for the three streaming call types."""

    def __init__(
        self,
        c: _Call,
        continuation: Callable[..., Any],
        request: Any,
        *,
        request_streaming: bool,
        response_streaming: bool,
        size: int = 0,
        writes: _WriteStream | None = None,
    ) -> None:
        """``size``: a unary request's bytes (``core.message_size``), read before ``c``
        was made. ``writes``: the ``write()`` API's stream, ``request`` its messages (the
        direct path's request-streaming calls made without a request iterator)."""
        self._c = c
        #: grpc.aio's continuation, until the attempts are over (see _driver_done).
        self._continuation: Callable[..., Any] | None = continuation
        self._request = request
        self._response_streaming = response_streaming
        self._replay: _ReplayBuffer | None = None
        self._writes = writes
        if request_streaming:
            self._replay = _ReplayBuffer(c, request, writes=writes is not None)
            self._replay.start()
        elif c.strategy.policy is not None:
            c.buffer_unary(size)
        self._current: Any = None
        #: The current attempt's status as the server sent it (request-streaming shapes:
        #: grpc.aio may put a stand-in INTERNAL in its place, _peer_status).
        self._peer: PeerStatus | None = None
        #: The error a read or await of the committed call raised (the server's status,
        #: or grpc.aio's stand-in where the server's OK answer was lost).
        self._ended_with: aio.AioRpcError | None = None
        #: The stand-in a read of the current attempt raised; the reads go on past it.
        self._past_stand_in: aio.AioRpcError | None = None
        #: The current attempt's messages when they are read by iterating what the
        #: application's interceptors returned (not grpc.aio's own call: ``_read``).
        self._messages: AsyncIterator[Any] | None = None
        #: A read of ``_messages`` is under way (a second reader at once is refused).
        self._in_messages = False
        self._started = asyncio.Event()
        self._reader: AsyncIterator[Any] | None = None
        self._accounting: asyncio.Task[None] | None = None
        self._accounted = False
        self._cancelled = False
        self._callbacks: list[Callable[[Any], None]] = []
        self._driver: asyncio.Task[_Outcome] = asyncio.get_running_loop().create_task(self._drive())
        self._driver.add_done_callback(self._driver_done)
        # Made before close(grace) began (sdkcore's interceptor let it in): the close waits
        # for it, its first attempt included, until release() (_driver_done, a commit).
        c.core._live.add(c)

    # -- the attempt loop ------------------------------------------------------------
    async def _drive(self) -> _Outcome:
        c = self._c
        replay = self._replay
        continuation = self._continuation
        assert continuation is not None  # let go only once this task is over
        try:
            while True:
                if replay is not None and replay.error is not None:
                    raise self._source_failed()
                source = self._request if replay is None else replay.attempt_messages()
                if c.core._closing and c.state.attempts == 0:
                    # Made just before the channel stopped taking attempts: cancelled before
                    # an attempt is counted, as grpc.aio's close cancels a call it has made.
                    # (While close(grace) waits for sdkcore's calls, grpc.aio's channel is
                    # open: it goes out.)
                    self._cancelled = True
                    raise asyncio.CancelledError()
                details = c.next_details()
                trace = c.trace
                token = None if trace is None else trace.enter(trace.current)
                try:
                    call = await continuation(details, source)
                except aio.UsageError:
                    if not c._retried():
                        raise  # the first attempt: as grpc.aio, on a closed channel
                    # Closed during the wait: cancelled, as grpc.aio ends calls in flight.
                    c.request.cancel()
                    self._cancelled = True
                    raise asyncio.CancelledError() from None
                finally:
                    if trace is not None:  # the attempt's span was current while it was made
                        trace.leave(token)
                c.sent()
                self._current = call
                if replay is not None:
                    self._peer = None
                    self._past_stand_in = None
                self._started.set()
                try:
                    # The call the application's interceptors made, read in place of
                    # grpc.aio's intercepted call (_intercepted); what they raised fails
                    # the attempt, as an attempt's own error does.
                    interceptors = interceptors_task(call)
                    if interceptors is not None:
                        call = self._current = await interceptors
                    if self._cancelled:  # cancel() while an interceptor held its cancellation back
                        raise asyncio.CancelledError()
                    if replay is not None:
                        self._peer = watch(own_call(call))
                    if self._response_streaming and response_iterator(call):
                        # The interceptors took the responses into an iterator of their
                        # own: the server's headers and messages are seen only by running
                        # it, in the task that reads the call (as grpc.aio runs it), so the
                        # call commits here (rfc/0003, "The direct path").
                        self._messages = call.__aiter__()
                        return self._commit(call)
                    if self._response_streaming:
                        md = await call.initial_metadata()
                        if md:
                            return self._commit(call)
                        message = await self._read(call)
                        if message is not _EOF:
                            out = self._commit(call)
                            out.first = message
                            out.has_first = True
                            return out
                        await call.code()
                    else:
                        # A6: response headers commit a client-streaming call too.
                        md = await call.initial_metadata()
                        if md:
                            return self._commit(call)
                        await call
                except aio.AioRpcError as read:
                    err = await self._server_error(read)
                    if replay is not None:
                        replay.detach()
                        if replay.error is not None:
                            raise self._source_failed() from None
                        if replay.committed:
                            c.state.committed = True
                    await c.failed(err, self)
                    continue
                if replay is not None and replay.error is not None:
                    raise self._source_failed()
                # Over and OK, uncommitted (a stream with no headers and no message): its
                # end is accounted here, once, not again when the application reads EOF.
                self._accounted = True
                c.succeeded()
                return _Outcome(call)
        except aio.AioRpcError as err:
            if replay is not None and replay.error is not None:
                raise self._source_failed() from None
            return _Outcome(error=err)
        except BaseException as exc:
            if self._current is not None:
                self._current.cancel()
            if replay is not None and replay.error is not None:
                self._source_failed()  # grpc.aio cancelled the attempt for it: not a caller's cut
            c.ended(exc)  # cancelled before it committed (failures ended it in c.failed)
            raise
        finally:
            if replay is not None and (self._current is None or self._current.done()):
                replay.close()

    def _source_failed(self) -> asyncio.CancelledError:
        """The application's request iterator raised: the call ends cancelled, as in grpc.aio.
        Its request (a retried call's) ends failed, not as a caller's cancellation (which
        :meth:`_Call.ended` would log as ``retry.cancelled``): nobody cancelled it."""
        self._cancelled = True
        request = self._c._request
        if request is not None:
            if request.in_flight:  # the attempt grpc.aio cancelled for it: it may have gone out
                request._attempt_failed(None, AttemptEffect.MAYBE_APPLIED, None, request.clock())
            request._finish(RequestState.FAILED)
        return asyncio.CancelledError()

    def _commit(self, call: Any) -> _Outcome:
        c = self._c
        c.state.committed = True
        if self._replay is not None:
            self._replay.commit()
        c.release()
        # Throttling and stats still see how a committed call ends.
        call.add_done_callback(self._committed_done)
        return _Outcome(call)

    def _committed_done(self, call: Any) -> None:
        if self._replay is not None:
            self._replay.close()
        self._accounting = asyncio.get_running_loop().create_task(self._account_committed(call))

    async def _account_committed(self, call: Any, *, reader: bool = False) -> None:
        """Account the committed attempt ``call`` by the server's status (waits for it).

        Not from the call's done callback (``reader`` False) while the application reads
        on past grpc.aio's stand-in with the server's status still unknown: core gives it
        after those messages, and the reader's end accounts the call."""
        if self._accounted:
            return
        end = await self._server_end(call)
        if (
            not reader
            and self._past_stand_in is not None
            and end.error is not None
            and stand_in_error(end.error)
        ):
            return
        self._account_end(end.code, end.trailing, end.error)

    async def _server_error(self, err: aio.AioRpcError) -> aio.AioRpcError:
        """``err``, raised by a read or await of the current attempt; the server's status
        in its place when it is grpc.aio's stand-in for a failed write (_peer_status)."""
        peer = self._peer
        return err if peer is None else await peer.error(err, own_call(self._current))

    async def _committed_end(self, call: Any) -> _End:
        """How the committed attempt ``call`` ended for the application's accessors: what
        a failed read or await raised, else the server's status (waits for it)."""
        if self._ended_with is not None:
            return _End.of(self._ended_with)
        return await self._server_end(call)

    async def _server_end(self, call: Any) -> _End:
        """How the committed attempt ``call`` ended by the server's status, in place of
        grpc.aio's stand-in, an OK included (waits for it). sdkcore accounts the call by
        it, as grpc's own telemetry counts the status core got: a read of the call that
        failed on the stand-in has lost the server's answer (rfc/0009)."""
        call = own_call(call)
        code = await call.code()
        details = await call.details()
        trailing = await call.trailing_metadata()
        debug = await call.debug_error_string()
        if code is _OK:
            return _End(_OK, details, trailing, debug, None)
        error = aio.AioRpcError(code, await call.initial_metadata(), trailing, details, debug)
        peer = self._peer
        status = None if peer is None else await peer.server_status(error, call)
        if status is None:
            return _End.of(error)
        if is_ok(status):
            md = aio.Metadata.from_tuple(status.trailing_metadata())
            return _End(_OK, status.details(), md, status.debug_error_string(), None)
        return _End.of(error_of(status, error))

    def _account_end(self, code: Any, trailing: Any, error: BaseException | None) -> None:
        """How a committed call ended, for the request, throttler and stats (once per call)."""
        if not self._accounted:
            self._accounted = True
            c = self._c
            # A close() of the channel cancels the committed attempt, not this object
            # (grpc.aio tracks the attempt): the application's cancellation all the same.
            cancelled = self._cancelled or (code is _CANCELLED and c.core._closing)
            _account_end(c, code, trailing, error, cancelled)

    def _driver_done(self, task: asyncio.Task[_Outcome]) -> None:
        # No attempt follows: let go of grpc.aio's continuation. It is bound to grpc's
        # intercepted call, whose task holds this object as its result: kept, the two
        # would be a reference cycle, freed only by the garbage collector.
        self._continuation = None
        self._c.release()
        if task.cancelled():
            # call.cancel() before the task's first step (_drive never ran to end the call),
            # or after (ended there: ending it again does nothing).
            self._c.ended(asyncio.CancelledError())
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            self._add_done(cb)

    def _add_done(self, callback: Callable[[Any], None]) -> None:
        task = self._driver
        if task.cancelled() or task.exception() is not None or task.result().error is not None:
            callback(self)
            return
        call = task.result().call
        call.add_done_callback(lambda _: callback(self))

    async def _outcome(self) -> _Outcome:
        return await asyncio.shield(self._driver)

    async def _read(self, call: Any) -> Any:
        """``call.read()``, going on past grpc.aio's stand-in for a failed write.

        grpc.aio's ``read()`` raises the stand-in as soon as the call has a status, while
        core may still hold messages the server sent (its own ``async for`` reads them
        first): sdkcore reads them, then takes the end of the stream from the server's
        status (an OK: the end; an error: raised, ``_server_error`` putting it in the
        stand-in's place; unknown: the stand-in). rfc/0009, "On gRPC channels".
        """
        messages = self._messages
        if messages is not None:  # an interceptor's response iterator: read as grpc.aio does
            try:
                return await messages.__anext__()
            except StopAsyncIteration:
                return _EOF
        if self._past_stand_in is None:
            try:
                return await call.read()
            except aio.AioRpcError as err:
                if self._peer is None or not stand_in_error(err) or not hasattr(call, "_read"):
                    raise
                self._past_stand_in = err
        message = await call._read()
        if message is not _EOF:
            return message
        first = self._past_stand_in
        assert self._peer is not None
        status = await self._peer.server_status(first, call)
        if status is not None and is_ok(status):
            return _EOF
        raise first

    # -- grpc.aio Call interface -------------------------------------------------------
    def cancel(self) -> bool:
        return self._cancel(by_application=True)

    def _cancel(self, *, by_application: bool) -> bool:
        """``cancel()``, or the call cancelled with the task reading it
        (``by_application`` False: a cut attempt is then the task's cancellation)."""
        if self.done():
            return False
        self._cancelled = True
        if not self._driver.done():
            if by_application:
                self._c.cancel_in_flight()
            self._driver.cancel()
        else:
            out = self._driver.result()
            if out.call is not None:
                out.call.cancel()
        if self._replay is not None:
            self._replay.close()
        return True

    def cancelled(self) -> bool:
        if self._cancelled or self._driver.cancelled():
            return True
        if not self._driver.done():
            return False
        out = self._driver.result()
        return bool(out.call is not None and out.call.cancelled())

    def done(self) -> bool:
        if self._cancelled:
            # cancel() returned True (or the call ended cancelled): done at once, as
            # grpc.aio's call is, though the attempts' task ends a loop turn later
            return True
        task = self._driver
        if not task.done():
            return False
        if task.cancelled() or task.exception() is not None:
            return True
        out = task.result()
        return out.error is not None or bool(out.call.done())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if not self._driver.done():
            self._callbacks.append(callback)
        else:
            self._add_done(callback)

    def time_remaining(self) -> float | None:
        return self._c.time_left()

    async def _settled(self) -> _Outcome | None:
        """How the call ended, or None when the call itself was cancelled.

        A cancellation of the awaiting task (a timeout around ``code()``, say)
        propagates: only the call's own cancellation is reported as CANCELLED.
        """
        try:
            return await self._outcome()
        except asyncio.CancelledError:
            if not self._driver.cancelled():
                raise  # the awaiting task itself was cancelled
            return None

    async def initial_metadata(self) -> Any:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return None
        if out.error is not None:
            return out.error.initial_metadata()
        return await out.call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return None
        if out.error is not None:
            return out.error.trailing_metadata()
        end = await self._committed_end(out.call)
        return _client_trailing(end.trailing, self._c.state.attempts - 1)

    async def code(self) -> Any:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return grpc.StatusCode.CANCELLED
        if out.error is not None:
            return out.error.code()
        return (await self._committed_end(out.call)).code

    async def details(self) -> str:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return "Locally cancelled by application!"
        if out.error is not None:
            return str(out.error.details())
        return str((await self._committed_end(out.call)).details)

    async def debug_error_string(self) -> str | None:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return ""
        if out.error is not None:
            return out.error.debug_error_string()  # type: ignore[no-any-return]
        return (await self._committed_end(out.call)).debug

    async def wait_for_connection(self) -> None:
        if self._current is None and not self._driver.done():
            started = asyncio.ensure_future(self._started.wait())
            try:
                await asyncio.wait((started, self._driver), return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
        if self._current is not None:
            await self._current.wait_for_connection()

    # -- responses -----------------------------------------------------------------
    async def _responses(self) -> AsyncIterator[Any]:
        try:
            out = await self._outcome()
        except asyncio.CancelledError:
            self._reader_cancelled()
            raise
        if out.error is not None:
            raise out.error
        if out.has_first:
            message, out.first, out.has_first = out.first, None, False
            yield message
        call = out.call
        iterating = self._messages is not None  # an interceptor's response iterator
        while True:
            if iterating and self._in_messages:
                # A second reader at once: its misuse (as Python refuses it), nothing ends.
                raise RuntimeError("anext(): asynchronous generator is already running")
            self._in_messages = iterating
            try:
                message = await self._read(call)
            except aio.AioRpcError as read:
                if iterating and not own_call(call).done():
                    # The iterator's own error, the RPC still open: core gives the status
                    # only behind messages nobody will read now. Ended here, not awaited.
                    self._ended_with = read
                    self._end_committed(call)
                    raise self._c._final(read) from None
                err = self._ended_with = await self._server_error(read)
                await self._account_committed(call, reader=True)
                if self._cancelled and err.code() is grpc.StatusCode.CANCELLED:
                    # cancel() returned True while this read, past the stream's end, waited
                    # for the status: grpc.aio then raises its local CANCELLED as an error
                    # (its _raise_for_status read is_locally_cancelled() before the wait);
                    # the cancellation, as after any cancel() that returned True.
                    raise asyncio.CancelledError() from None
                raise self._c._final(err) from None
            except asyncio.CancelledError:
                # The reading task was cancelled: grpc.aio cancels the RPC with it, and the
                # call ends as the application's cancellation, not as a CANCELLED answer.
                self._cancelled = True
                call.cancel()
                raise
            except Exception:
                # An application interceptor's response iterator failed: the RPC is
                # cancelled (its permit and accounting end with it), and the error goes on.
                self._end_committed(call)
                raise
            finally:
                self._in_messages = False
            if message is _EOF:
                if iterating and not own_call(call).done():
                    # The iterator ended with the RPC still open (it stopped early): the
                    # rest is read by nobody, and core holds the status behind it: ended.
                    self._end_committed(call)
                    return
                await self._account_committed(call, reader=True)
                return
            yield message

    def _end_committed(self, call: Any) -> None:
        """The application stopped reading the committed ``call`` (its interceptor's
        iterator ended or failed): cancelled, if still running, so that its permit and
        accounting end with it; a call already over keeps the status the server gave it."""
        if call.cancel():
            self._cancelled = True

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def read(self) -> Any:
        it = self._reader
        if it is None:
            it = self._reader = self._responses()
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return _EOF

    def _reader_cancelled(self) -> None:
        """The task reading (or writing) the call was cancelled: so is the call, as grpc.aio
        cancels a call whose read, await or write is cancelled (the server sees it)."""
        if not self.cancelled():
            self._cancel(by_application=False)

    def _final_response(self) -> Generator[Any, None, Any]:
        try:
            out = yield from asyncio.shield(self._driver).__await__()
        except asyncio.CancelledError:
            self._reader_cancelled()
            raise
        if out.error is not None:
            raise out.error
        try:
            response = yield from out.call.__await__()
        except aio.AioRpcError as read:
            err = self._ended_with = yield from self._server_error(read).__await__()
            yield from self._account_committed(out.call, reader=True).__await__()
            raise self._c._final(err) from None
        return response

    # -- requests (writes go through grpc.aio's own request iterator) --------------------
    async def write(self, request: Any) -> None:
        raise RuntimeError(
            "write() on the intercepted call object; use the call the channel returned"
        )

    async def done_writing(self) -> None:
        raise RuntimeError(
            "done_writing() on the intercepted call object; use the call the channel returned"
        )

    @property
    def _done_writing_flag(self) -> bool:
        # Read by grpc.aio's interceptor wrapper (write() and done_writing() on the call
        # the channel returned check it on the intercepted call).
        return self._replay is not None and self._replay.source_done


class _RetryingUnaryStreamCall(_RetryingCall, _base_call.UnaryStreamCall):  # type: ignore[misc]
    pass


class _RetryingStreamUnaryCall(_RetryingCall, _base_call.StreamUnaryCall):  # type: ignore[misc]
    def __await__(self) -> Generator[Any, None, Any]:
        return self._final_response()


class _RetryingStreamStreamCall(_RetryingCall, _base_call.StreamStreamCall):  # type: ignore[misc]
    pass


def _account_end(
    c: _Call, code: Any, trailing: Any, error: BaseException | None, cancelled: bool
) -> None:
    """How a committed call ended, for the request, throttler and stats."""
    if code is _OK:
        c.succeeded()  # completes the request and feeds the throttler
        return
    if cancelled:  # the application cancelled the call
        c.request.cancel()
    elif error is not None:
        time_out_at_deadline(c.request, error)  # DEADLINE_EXCEEDED: the request's timeout
        c.core.orchestrator.fail(c.request, error)
    c.ended(error if error is not None else asyncio.CancelledError())
    if c.state.attempts > 1:
        c.core.stats.record_failed_retry(c.name)
    policy = c.strategy.policy
    throttler = c.core.throttler
    if throttler is not None:
        # The same rule as for an attempt that can still be retried (_policy._status); a
        # method without a retryPolicy pays for a "don't retry" pushback too (A6: every RPC)
        pushback = parse_pushback(trailing.get_all(PUSHBACK_KEY)) if trailing else None
        retried = NO_CODES if policy is None else policy.retryable_status_codes
        if costs_token(code.value[0], retried, pushback):
            throttler.record_failure()


async def streaming_call(
    core: _Controller,
    call_class: type[_RetryingCall],
    continuation: Callable[..., Any],
    details: Any,
    request: Any,
    *,
    request_streaming: bool,
    response_streaming: bool,
) -> Any:
    """A retrying call for a streaming method with a plan, else the plain call."""
    if core._draining:
        raise channel_closed_error()  # close(grace) waits for sdkcore's calls: no new one
    plan = core.plan(details.method)
    if plan is None or core._closing:  # closing: grpc.aio's own call refuses it
        outer = dispatching()
        if outer is not None:  # made inside a request's send: never outlive it
            details = outer_details(outer, details)
        return await continuation(details, request)
    size = 0
    if not request_streaming and plan.strategy.policy is not None:
        size = core.message_size(request)  # may raise: before the call's state is made
    return call_class(
        (_Call if core._tel is None else _TracedCall).from_details(core, plan, details),
        continuation,
        request,
        request_streaming=request_streaming,
        response_streaming=response_streaming,
        size=size,
    )


# -- the direct path (the channel helpers' channels) -------------------------------------
#: grpc.aio's messages for a misused write() API (``grpc.aio._call``), word for word.
_API_STYLE_ERROR = "The iterator and read/write APIs may not be mixed on a single RPC."
_FINISHED = "RPC already finished."
_HALF_CLOSED = 'RPC is half closed after calling "done_writing".'
_END_OF_WRITES = object()


class _WriteStream:
    """The ``write()`` API of a request-streaming call on the direct path, as grpc.aio's
    interceptor wrapper runs it: each ``write()`` puts one message into a one-place queue
    that the call's request stream (:meth:`messages`) reads, and waits until it is taken
    or the call ends; ``done_writing()`` ends the stream. The replay buffer reads this
    stream at once until the call commits (``_ReplayBuffer(writes=True)``)."""

    __slots__ = ("end", "ended", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
        #: The put of the stream's end: made once, by the first done_writing(), and kept
        #: when its caller is cancelled (the half-close was asked for, and a write() would
        #: be refused: a later done_writing() waits for the same put); cancelled when the
        #: call ends first.
        self.end: asyncio.Future[None] | None = None
        #: The call's ``code()``, awaited by the first write: a write waits for it or room.
        self.ended: asyncio.Task[Any] | None = None

    @property
    def closed(self) -> bool:
        """done_writing() was called: a write() after it is refused, never dropped."""
        return self.end is not None

    async def messages(self) -> AsyncIterator[Any]:
        queue = self.queue
        while True:
            message = await queue.get()
            if message is _END_OF_WRITES:
                return
            yield message

    def _ended(self, call: _RetryingCall) -> asyncio.Task[Any]:
        ended = self.ended
        if ended is None:
            ended = self.ended = asyncio.get_running_loop().create_task(call.code())
            ended.add_done_callback(_retrieved)
        return ended

    async def put(self, message: Any, call: _RetryingCall) -> None:
        """Put ``message`` in the queue, or give up when ``call`` ends first."""
        ended = self._ended(call)
        put = asyncio.ensure_future(self.queue.put(message))
        try:
            await asyncio.wait((put, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not put.done():  # the call ended first: the message is not taken
                put.cancel()

    async def close(self, call: _RetryingCall) -> None:
        """Put the stream's end in the queue (once), or give up when ``call`` ends first."""
        ended = self._ended(call)
        end = self.end
        if end is None:
            end = self.end = asyncio.ensure_future(self.queue.put(_END_OF_WRITES))
            ended.add_done_callback(lambda _: end.cancel())  # a done put: does nothing
        await asyncio.wait((end, ended), return_when=asyncio.FIRST_COMPLETED)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """The call's ``code()`` task is awaited by whichever write waits then, or by none: its
    error (a call that raised) is read here, never logged as never retrieved."""
    if not task.cancelled():
        task.exception()


class _DirectWrites(_RetryingCall):
    """A request-streaming call the application holds itself (the direct path): its
    ``write()``/``done_writing()``, with grpc.aio's errors for a misuse. A ``write()`` or
    ``done_writing()`` whose task is cancelled cancels the call, as on plain grpc.aio
    (grpc.aio's interceptor wrapper, which sdkcore's calls went through until 2026-11-28,
    let the RPC run on)."""

    async def write(self, request: Any) -> None:
        writes = self._writes
        if writes is None:  # made with a request iterator
            raise aio.UsageError(_API_STYLE_ERROR)
        if self.done():
            raise asyncio.InvalidStateError(_FINISHED)
        if writes.closed:
            raise asyncio.InvalidStateError(_HALF_CLOSED)
        try:
            await writes.put(request, self)
        except asyncio.CancelledError:
            self._reader_cancelled()  # as plain grpc.aio cancels a call whose write is
            raise
        if self.done():
            raise asyncio.InvalidStateError(_FINISHED)

    async def done_writing(self) -> None:
        """Half-close the call's request stream (once: a repeat waits for the same end)."""
        writes = self._writes
        if writes is None:
            raise aio.UsageError(_API_STYLE_ERROR)
        try:
            await writes.close(self)
        except asyncio.CancelledError:
            self._reader_cancelled()  # and whose done_writing() is
            raise


class _DirectStreamUnaryCall(_DirectWrites, _base_call.StreamUnaryCall):  # type: ignore[misc]
    def __await__(self) -> Generator[Any, None, Any]:
        return self._final_response()


class _DirectStreamStreamCall(_DirectWrites, _base_call.StreamStreamCall):  # type: ignore[misc]
    pass


class _StreamingMultiCallable:
    """A streaming method's multi-callable on an sdkcore channel.

    A call on a method with a plan is sdkcore's own call object, returned to the
    application as is; each attempt is a call of grpc.aio's multi-callable ``inner``
    (with the channel's gate around it). A method with no plan, or a closing channel,
    gets grpc.aio's own call, bounded by an outer request's time left.
    """

    _call_class: type[_RetryingCall]
    _refused: type[RefusedCall]
    _request_streaming = False
    _response_streaming = True

    def __init__(self, core: _Controller, inner: Any, method: Any) -> None:
        self._core = core
        self._inner = (
            inner if core.gate is None else GatedMultiCallable(core.gate, inner, self._refused)
        )
        #: A call sdkcore does not retry: grpc.aio's own, bounded by an outer request.
        self._plain = BoundedMultiCallable(core, self._inner)
        self._method = method

    def _call(
        self,
        request: Any,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> Any:
        core = self._core
        plan = core.plan(self._method)
        if plan is None or core._closing:  # closing: grpc.aio's own call refuses it
            return self._plain(
                request,
                timeout=timeout,
                metadata=metadata,
                credentials=credentials,
                wait_for_ready=wait_for_ready,
                compression=compression,
            )
        if core._draining:
            raise channel_closed_error()  # close(grace) waits for sdkcore's calls: no new one
        size = 0
        writes = None
        if self._request_streaming:
            if request is None:  # the write() API
                writes = _WriteStream()
                request = writes.messages()
        elif plan.strategy.policy is not None:
            size = core.message_size(request)  # may raise: before the call's state is made
        state = _Call if core._tel is None else _TracedCall
        return self._call_class(
            state(core, plan, self._method, timeout, metadata, credentials, wait_for_ready),
            Continuation(self._inner, compression),
            request,
            request_streaming=self._request_streaming,
            response_streaming=self._response_streaming,
            size=size,
            writes=writes,
        )


class UnaryStreamMultiCallable(_StreamingMultiCallable, aio.UnaryStreamMultiCallable):  # type: ignore[misc]
    """A server-streaming method on an sdkcore channel."""

    _call_class = _RetryingUnaryStreamCall
    _refused = RefusedUnaryStreamCall

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self._call(request, timeout, metadata, credentials, wait_for_ready, compression)


class StreamUnaryMultiCallable(_StreamingMultiCallable, aio.StreamUnaryMultiCallable):  # type: ignore[misc]
    """A client-streaming method on an sdkcore channel."""

    _call_class = _DirectStreamUnaryCall
    _refused = RefusedStreamUnaryCall
    _request_streaming = True
    _response_streaming = False

    def __call__(
        self,
        request_iterator: Any = None,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self._call(
            request_iterator, timeout, metadata, credentials, wait_for_ready, compression
        )


class StreamStreamMultiCallable(_StreamingMultiCallable, aio.StreamStreamMultiCallable):  # type: ignore[misc]
    """A bidirectional-streaming method on an sdkcore channel."""

    _call_class = _DirectStreamStreamCall
    _refused = RefusedStreamStreamCall
    _request_streaming = True

    def __call__(
        self,
        request_iterator: Any = None,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self._call(
            request_iterator, timeout, metadata, credentials, wait_for_ready, compression
        )
