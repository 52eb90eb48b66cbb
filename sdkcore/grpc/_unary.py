"""Unary-unary calls: the interceptor path and the direct path of the channel helpers.

The channel helpers drive grpc.aio's unary-unary multi-callable directly
(:class:`_UnaryCall`): the first attempt is grpc.aio's own call, with no task and no
interceptor of sdkcore around it, and the retry loop starts only when an attempt
fails, in the task that awaits the call (in a task of its own when nobody awaits
it). A channel built by hand with :meth:`RetryController.interceptors` uses
:func:`unary_unary_call`, the same loop inside grpc.aio's interceptor chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

import grpc
from grpc import aio
from grpc.aio import _base_call

from .._request import dispatching
from ._call import _Call, _TracedCall, call_timeout, outer_details, within_outer
from ._controller import _Controller, channel_closed_error
from ._finished import _ended_ok, _FinishedUnaryCall, _Readers
from ._hedging import intercepted_hedged_unary_unary
from ._metadata import _client_trailing, _strip_attempts
from ._plans import _Plan

__all__: list[str] = []

_OK = grpc.StatusCode.OK
_CANCELLED = grpc.StatusCode.CANCELLED


async def unary_unary_call(
    core: _Controller, continuation: Callable[..., Any], details: Any, request: Any
) -> Any:
    """The interceptor path: one unary-unary call with A6 retries or hedging."""
    if core.service_config is not None:  # A6 hedgingPolicy (rfc/0004)
        hedging = core.hedge_plan(details.method)
        if hedging is not None:
            return await intercepted_hedged_unary_unary(
                core, hedging, continuation, details, request
            )
    plan = core.plan(details.method)
    if plan is None:
        outer = dispatching()
        if outer is not None:  # made inside a request's send: never outlive it
            details = outer_details(outer, details)
        return await continuation(details, request)
    policy = plan.strategy.policy
    size = 0 if policy is None else core.message_size(request)  # may raise: nothing made yet
    c = (_Call if core._tel is None else _TracedCall).from_details(core, plan, details)
    if policy is not None:
        c.buffer_unary(size)
    try:
        while True:
            first = c.state.attempts == 0
            attempt_details = c.next_details()
            trace = c.trace
            token = None if trace is None else trace.enter(trace.current)
            try:
                call = await continuation(attempt_details, request)
            except aio.UsageError:
                if first:
                    raise
                # The channel was closed during the wait: the call ends cancelled,
                # as grpc.aio ends the calls in flight then.
                c.request.cancel()
                raise asyncio.CancelledError() from None
            finally:
                if trace is not None:  # the attempt's span was current while it was made
                    trace.leave(token)
            c.sent()
            try:
                await call
            except aio.AioRpcError as err:
                await c.failed(err)
                continue
            c.succeeded()
            previous = c.state.attempts - 1
            if previous == 0:
                md = await call.trailing_metadata()
                if _client_trailing(md, 0) is md:
                    return call  # nothing to correct: the call as grpc.aio made it
            return _FinishedUnaryCall(call, previous)
    except BaseException as exc:
        c.ended(exc)  # cancelled in flight (the failures ended it in c.failed)
        raise
    finally:
        c.release()


def _read_error(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _UnaryCall(_Readers, _base_call.UnaryUnaryCall):  # type: ignore[misc]
    """A unary-unary call of the direct path: grpc.aio's call until an attempt fails.

    ``await call`` (the usual use) awaits grpc.aio's call itself, and when it fails,
    runs the retry loop (:meth:`_drive`) in the awaiting task. A call nobody awaits
    runs the loop in a task started by the first attempt's done callback. Every
    other reader waits for whichever runs it.
    """

    def __init__(
        self,
        core: _Controller,
        plan: _Plan,
        inner: Any,
        method: Any,
        message: Any,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
        state: type[_Call] = _Call,
    ) -> None:
        # ``state``: the call's state, a _TracedCall on a channel with telemetry.
        policy = plan.strategy.policy
        size = 0 if policy is None else core.message_size(message)  # may raise: nothing made yet
        c = self._c = state(core, plan, method, timeout, metadata, credentials, wait_for_ready)
        if policy is not None:
            c.buffer_unary(size)
        self._inner = inner
        self._message = message
        self._compression = compression
        self._driver: asyncio.Task[Any] | None = None
        #: Set while an awaiting task runs the retry loop; done (with None) when it ends.
        self._inline: asyncio.Future[None] | None = None
        #: The outcome of an inline retry loop: (call, None) or (None, error or None).
        self._result: tuple[Any, Any] | None = None
        self._awaited = False
        self._watcher: asyncio.Task[Any] | None = None
        self._ended = False
        self._cancelled = False
        self._abandoned = False  # its awaiting task was cancelled: no retry (see _abandon)
        try:
            self._call = self._attempt()
        except BaseException:  # refused at once: nothing to drive, nothing to wait for
            c.release()
            raise
        # The retry loop must run even if nobody awaits the call: the first attempt's
        # end starts it (a failure) or does the success's bookkeeping.
        self._call.add_done_callback(self._first_done)

    def _attempt(self) -> Any:
        c = self._c
        md = c.next_attempt()
        call = self._inner(
            self._message,
            timeout=c.time_left(),
            metadata=md,
            credentials=c.credentials,
            wait_for_ready=c.wait_for_ready,
            compression=self._compression,
        )
        c.sent()
        return call

    def _ok(self) -> None:
        """The first attempt ended OK (once per call)."""
        if not self._ended:
            self._ended = True
            c = self._c
            c.succeeded()
            c.release()

    def _driving(self) -> bool:
        """True once the retry loop started (in a task or in an awaiting task)."""
        return self._driver is not None or self._inline is not None

    def _first_done(self, call: Any) -> None:
        if self._driving() or self._ended:
            return
        if call.cancelled():
            # Cancelled before anyone drove it (call.cancel(), the channel closing): it is
            # over, and its replay buffer goes back to the channel.
            self._end_without_status(asyncio.CancelledError())
            return
        ok = _ended_ok(call)
        if ok:
            self._ok()
        elif ok is None:  # an application interceptor's call: settle it in a task
            self._watch()
        elif not self._awaited:  # nobody awaits the call: the loop runs in a task
            self._first_failed(None)

    def _abandon(self) -> None:
        """The awaiting task was cancelled as the first attempt ended or before: the call is
        cancelled with it, as grpc.aio's is, unless its answer is in (an OK stands, as
        grpc.aio's cancel() of a finished call changes nothing). A first attempt that
        failed is not retried: the call ends CANCELLED, also when the failure came in the
        turn of the cancellation (known at once, or when a reader or the watcher of an
        application interceptor's call reads it: :meth:`_first_failed`)."""
        if self._driving():  # a reader's task already began the retry loop
            self._cancel(by_application=False)
            return
        call = self._call
        ok = _ended_ok(call) if call.done() else False
        if ok:
            self._ok()
            return
        self._abandoned = True
        if ok is False:  # failed, or cancelled in flight with the task
            self._settle_cancelled()

    def _settle_cancelled(self) -> None:
        """The call's outcome is its cancellation (its readers say CANCELLED)."""
        self._cancelled = True
        self._result = (None, None)

    def _first_failed(self, err: Any) -> None:
        """Start the retry loop in a task (once): ``err`` is the first attempt's, or None.
        For a call abandoned by its awaiting task (:meth:`_abandon`), none: it is cancelled."""
        if self._abandoned:
            self._settle_cancelled()
            self._end_without_status(asyncio.CancelledError())
            return
        if not self._driving():
            driver = self._driver = asyncio.get_running_loop().create_task(self._drive(err))
            driver.add_done_callback(self._driver_done)

    def _driver_done(self, driver: asyncio.Task[Any]) -> None:
        if driver.cancelled():
            # call.cancel() before the task's first step: _drive never ran to end the call.
            self._end_without_status(asyncio.CancelledError())
        else:
            # Read here: the readers get it from the task, and a call nobody reads (fire
            # and forget) logs no "Task exception was never retrieved", as grpc.aio's.
            driver.exception()

    async def _drive(self, err: Any) -> Any:
        """The retry loop after the first failure: the successful call, or raise the error."""
        c = self._c
        try:
            if err is None:
                try:
                    await self._call  # over: raises its error at once
                except aio.AioRpcError as failure:
                    err = failure
                else:  # pragma: no cover - the first attempt failed
                    c.succeeded()
                    return self._call
            while True:
                self._check_cancelled()
                await c.failed(err, self)
                self._check_cancelled()
                try:
                    call = self._call = self._attempt()
                except aio.UsageError:
                    raise self._refused() from None
                try:
                    await call
                except aio.AioRpcError as failure:
                    err = failure
                    continue
                except aio.UsageError:  # refused inside the application's interceptors
                    raise self._refused() from None
                c.succeeded()
                return call
        except BaseException as exc:
            c.ended(exc)  # cancelled in flight (the failures ended it in c.failed)
            raise
        finally:
            self._ended = True
            c.release()

    def _check_cancelled(self) -> None:
        """``call.cancel()`` came between two attempts (the last one had failed, the loop
        had not yet waited or sent again): no attempt more, the call ends cancelled."""
        if self._cancelled:
            self._c.request.cancel()
            raise asyncio.CancelledError()

    def _refused(self) -> BaseException:
        """The channel refused the next attempt (it was closed): the call ends cancelled,
        as grpc.aio ends the calls in flight when its channel closes."""
        self._cancelled = True
        self._c.request.cancel()
        return asyncio.CancelledError()

    def __await__(self) -> Generator[Any, None, Any]:
        if not self._driving() and self._result is None:
            self._awaited = True
            failure: Any = None
            try:
                response = yield from self._call.__await__()
            except aio.AioRpcError as err:
                failure = err
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError) and not self._ended:
                    self._abandon()
                    if self._abandoned and self._result is None:
                        raise  # its outcome is known once read (an interceptor's call)
                self._end_without_status(exc)
                raise
            if failure is None:
                if not self._driving():
                    self._ok()
                    return response
            elif not self._driving():
                call = yield from self._drive_here(failure).__await__()
                response = yield from call.__await__()
                return response
        try:
            final_call, final_error = yield from self._outcome().__await__()
        except asyncio.CancelledError:
            if not self.cancelled():  # the awaiting task: the call too, as grpc.aio does
                self._cancel(by_application=False)
            raise
        if final_error is not None:
            raise final_error
        response = yield from final_call.__await__()
        return response

    async def _drive_here(self, err: Any) -> Any:
        """The retry loop in the awaiting task; readers wait on ``_inline``."""
        inline = self._inline = asyncio.get_running_loop().create_future()
        outcome: tuple[Any, Any] = (None, None)
        try:
            call = await self._drive(err)
            outcome = (call, None)
            return call
        except asyncio.CancelledError:
            # The awaiting task was cancelled (in the backoff, say): the call is cancelled
            # with it, as grpc.aio's own call is, so that its readers say CANCELLED.
            self._cancelled = True
            raise
        except aio.AioRpcError as final:
            if self._cancelled:  # call.cancel() during the backoff: as grpc.aio does
                raise asyncio.CancelledError() from None
            outcome = (None, final)
            raise
        finally:
            self._result = outcome
            inline.set_result(None)

    # -- readers -------------------------------------------------------------------
    async def _outcome(self) -> tuple[Any, Any]:
        """(the final call, None) or (None, the final AioRpcError); raises if cancelled."""
        while True:
            result = self._result
            if result is not None:
                if result == (None, None):
                    raise asyncio.CancelledError()
                return result
            if self._inline is not None:
                await asyncio.shield(self._inline)
                continue
            if self._driver is not None:
                try:
                    return await asyncio.shield(self._driver), None
                except aio.AioRpcError as err:
                    return None, err
            call = self._call
            try:
                code = await call.code()
            except Exception as exc:
                # Refused inside the application's interceptors (the channel closed before
                # they handed the first attempt on), or one of them raised: over, without a
                # status (grpc.aio re-raises such an error from code()).
                self._end_without_status(exc)
                raise
            if self._driving() or self._result is not None:
                continue
            if code is _OK:
                self._ok()
                return call, None
            try:
                await call  # over: raises its error (or CancelledError) at once
            except aio.AioRpcError as err:
                if self._result is None:  # (not cancelled with its awaiting task meanwhile)
                    self._first_failed(err)
            else:  # pragma: no cover - a status other than OK always raises
                return call, None

    async def _settled(self) -> tuple[Any, Any] | None:
        """Like :meth:`_outcome`; None when the call itself was cancelled."""
        try:
            return await self._outcome()
        except asyncio.CancelledError:
            if not self.cancelled():
                raise  # the awaiting task itself was cancelled
            return None

    def _watch(self) -> asyncio.Task[Any]:
        """A task that settles the call, for the readers that cannot await."""
        watcher = self._watcher
        if watcher is None:
            watcher = self._watcher = asyncio.get_running_loop().create_task(self._settled())
            # Its error (a UsageError) is the readers' to raise: read here too, so that a
            # call nobody reads does not log "Task exception was never retrieved".
            watcher.add_done_callback(_read_error)
        return watcher

    def _end_without_status(self, error: BaseException) -> None:
        """The call ended with no status (cancelled before or in flight, or its first
        attempt refused inside the application's interceptors): its replay buffer goes
        back to the channel and its telemetry, if any, ends with ``error``. Once."""
        if not self._ended:
            self._ended = True
            self._c.release()
            self._c.ended(error)

    def _trailing(self, call: Any, md: Any) -> Any:
        return _client_trailing(md, self._c.state.attempts - 1)

    async def wait_for_connection(self) -> None:
        try:
            await self._call.wait_for_connection()
        except aio.AioRpcError:
            return None  # the attempt failed: its status is read from the call

    def time_remaining(self) -> float | None:
        return self._c.time_left()

    # -- state -----------------------------------------------------------------------
    def cancel(self) -> bool:
        return self._cancel(by_application=True)

    def _cancel(self, *, by_application: bool) -> bool:
        """``cancel()``, or the call cancelled with the task awaiting it
        (``by_application`` False: a cut attempt is then the task's cancellation)."""
        if self.done():
            return False
        if self._inline is not None and self._call.done() and _ended_ok(self._call):
            # The awaiting task's retry got its answer and is about to return it: too late,
            # as grpc.aio's cancel() of a call whose status is in (False, the answer stands).
            return False
        self._cancelled = True
        if by_application:
            self._c.cancel_in_flight()
        driver = self._driver
        if driver is not None:
            driver.cancel()
        elif self._inline is not None and self._c.in_backoff:
            self._c.request.cancel()  # ends the wait; the awaiting task gets CancelledError
        self._call.cancel()
        return True

    def cancelled(self) -> bool:
        if self._cancelled:
            return True
        driver = self._driver
        if driver is not None and driver.cancelled():
            return True
        return bool(self._call.cancelled())

    def done(self) -> bool:
        if self._result is not None:
            return True
        if self._inline is not None:
            return False
        driver = self._driver
        if driver is None:
            call = self._call
            if not call.done():
                return False
            if call.cancelled() or self._ended or _ended_ok(call):
                return True  # (ended: answered OK, or over without a status)
            if not self._awaited:
                self._watch()  # a failed attempt: retried, or final once the policy says so
            return False
        if not driver.done():
            return False
        if driver.cancelled() or driver.exception() is not None:
            return True
        return bool(driver.result().done())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self.done():
            callback(self)
            return

        def settled(_: Any) -> None:
            callback(self)

        if self._inline is not None:
            self._inline.add_done_callback(settled)
        elif self._driver is None:
            self._watch().add_done_callback(settled)
        else:
            self._driver.add_done_callback(settled)


class _TracedUnaryCall(_UnaryCall):
    """A :class:`_UnaryCall` on a channel with telemetry (rfc/0008): a :class:`_TracedCall`,
    and each attempt's span current while its grpc.aio call is made (the call's task and
    the application's interceptors run under it)."""

    def __init__(
        self,
        core: _Controller,
        plan: _Plan,
        inner: Any,
        method: Any,
        message: Any,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        super().__init__(
            core,
            plan,
            inner,
            method,
            message,
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            compression,
            _TracedCall,
        )

    def _attempt(self) -> Any:
        c = self._c
        md = c.next_attempt()  # starts the attempt's span
        trace = c.trace
        assert trace is not None
        token = trace.enter(trace.current)
        try:
            call = self._inner(
                self._message,
                timeout=c.time_left(),
                metadata=md,
                credentials=c.credentials,
                wait_for_ready=c.wait_for_ready,
                compression=self._compression,
            )
        finally:
            trace.leave(token)
        c.sent()
        return call


class BoundedMultiCallable(aio.UnaryUnaryMultiCallable):  # type: ignore[misc]
    """A unary-unary method sdkcore does not retry, on an sdkcore channel (and the same
    for a streaming method's calls, ``_streaming``).

    grpc.aio's own multi-callable ``inner``, except that a call made inside an sdkcore
    request's send gets the earlier of its timeout and that request's time left.
    """

    __slots__ = ("_core", "_inner")

    def __init__(self, core: _Controller, inner: Any) -> None:
        self._core = core
        self._inner = inner

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
        core = self._core
        if core._draining:
            raise channel_closed_error()  # close(grace) waits for sdkcore's calls: no new one
        outer = dispatching()
        if outer is not None:  # made inside a request's send: never outlive it
            timeout = within_outer(outer, timeout)
        return self._inner(
            request,
            timeout=timeout,
            metadata=metadata,
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


class DirectMultiCallable(aio.UnaryUnaryMultiCallable):  # type: ignore[misc]
    """A retried or hedged method's multi-callable on an sdkcore channel.

    Each call is a ``call_type`` (:class:`_UnaryCall` for a retry plan,
    ``_hedged_call._HedgedCall`` for a hedging plan) around grpc.aio's own
    multi-callable ``inner``.
    """

    def __init__(
        self, core: _Controller, plan: Any, inner: Any, method: Any, call_type: Any = None
    ) -> None:
        self._core = core
        self._plan = plan
        self._inner = inner
        self._method = method
        self._call_type = _UnaryCall if call_type is None else call_type

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
        core = self._core
        if core._draining:
            raise channel_closed_error()  # close(grace) waits for sdkcore's calls: no new one
        if core._closing:
            # The channel is closing or closed: it takes no new call. grpc.aio's own call
            # refuses it (UsageError), as without sdkcore; no sdkcore attempt starts.
            return self._inner(
                request,
                timeout=timeout,
                metadata=metadata,
                credentials=credentials,
                wait_for_ready=wait_for_ready,
                compression=compression,
            )
        return self._call_type(
            self._core,
            self._plan,
            self._inner,
            self._method,
            request,
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            compression,
        )


class FirstAttemptMultiCallable(DirectMultiCallable):
    """A method without a retryPolicy, on a channel without a gate, throttling or telemetry.

    Such a call is never sent again: without a retryPolicy only a transparent retry
    could, and the channel makes those only for attempts its gate refused (a call that
    finds no connection fails fast with UNAVAILABLE, as grpcio's; rfc/0003, "Fail
    fast"). So it is grpc.aio's own call, with what sdkcore owes it (the method
    config's timeout and waitForReady, an outer request's deadline, its first attempt
    paid into the retry budget, no application-set ``grpc-previous-rpc-attempts``) and
    nothing wrapped around it
    (bench/README, "bench_grpc_cpu.py", issue 24). Any other call is a
    :class:`_UnaryCall`, as on a retried method.
    """

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
        core = self._core
        if core._draining:
            raise channel_closed_error()  # close(grace) waits for sdkcore's calls: no new one
        plan = self._plan
        budget = core.orchestrator.retry_budget
        if budget is not None:  # every call's first attempt pays into the retry budget
            budget.deposit()
        return self._inner(
            request,
            timeout=call_timeout(plan, timeout)[0],
            metadata=_strip_attempts(metadata),
            credentials=credentials,
            wait_for_ready=plan.wait_for_ready if wait_for_ready is None else wait_for_ready,
            compression=compression,
        )
