"""A hedged unary-unary call on the direct path of the channel helpers.

Hedge 0 is grpc.aio's own call, made at once; a loop timer (the hedging delay) and
the call's done callback decide what happens next, with no task: the call ends OK
before the delay (the common case, nothing more is done), or the runner
(:func:`hedged_unary_unary`, a task) takes over with hedge 0 adopted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Generator
from typing import Any

import grpc
from grpc import aio
from grpc.aio import _base_call

from .._hedge import answered_before_hedge
from .._hooks import INSTANT_DELAYS
from .._request import Request
from ._call import Continuation, call_timeout
from ._controller import _Controller
from ._finished import _ended_ok, _Readers
from ._hedging import direct_opener, hedge_trace, hedged_unary_unary
from ._metadata import _client_trailing, _strip_attempts
from ._plans import HedgePlan
from ._telemetry import CallTrace

__all__: list[str] = []

_CANCELLED = grpc.StatusCode.CANCELLED


class _HedgedCall(_Readers, _base_call.UnaryUnaryCall):  # type: ignore[misc]
    """One hedged unary-unary call (see the module docstring)."""

    #: The call's telemetry: None here; set by :class:`_TracedHedgedCall`.
    _trace: CallTrace | None = None

    def __init__(
        self,
        core: _Controller,
        plan: HedgePlan,
        inner: Any,
        method: Any,
        message: Any,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
        traced: bool = False,
    ) -> None:
        timeout, origin = call_timeout(plan, timeout)
        self._deadline_from = origin
        if wait_for_ready is None:
            wait_for_ready = plan.wait_for_ready
        metadata = _strip_attempts(metadata)
        self._core = core
        size = core.message_size(message)  # (a size that raises: nothing sent, nothing held)
        budget = core.orchestrator.retry_budget
        if budget is not None:  # the call's first attempt pays into the shared retry budget
            budget.deposit()
        self._inner = inner
        self._message = message
        self._compression = compression
        self._details = aio.ClientCallDetails(
            method, timeout, metadata, credentials, wait_for_ready
        )
        self._started = time.monotonic()
        self._timeout = timeout
        loop = self._loop = asyncio.get_running_loop()
        self._sent_at = loop.time()
        self._driver: asyncio.Task[Any] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._cancelled = False
        self._request: Request | None = None  # the runner's, once it runs (_adopt_request)
        if traced:  # a _TracedHedgedCall: its Request and trace start with hedge 0
            self._trace = trace = hedge_trace(
                core, method, None if timeout is None else max(timeout, 1e-6), self._started, origin
            )
            token = trace.enter(trace.attempt(0))  # hedge 0's span is current while it is made
            try:
                first = inner(
                    message,
                    timeout=timeout,
                    metadata=metadata,
                    credentials=credentials,
                    wait_for_ready=wait_for_ready,
                    compression=compression,
                )
            finally:
                trace.leave(token)
        else:
            first = inner(
                message,
                timeout=timeout,
                metadata=metadata,
                credentials=credentials,
                wait_for_ready=wait_for_ready,
                compression=compression,
            )
        self._first = first
        self._timer: asyncio.TimerHandle | None = None
        delay = plan.policy.delay.total_seconds()  # a LatencyQuantile's: inf before min_samples
        self._delay = delay
        # A6's retry buffer: every copy resends the request, held until the call ends (_wake).
        # One that does not fit (the per-call limit, or the channel's) is sent once, unhedged.
        # Taken last: nothing below raises, so what is taken is always given back.
        if core._hold(size):
            self._buffered = size
        else:
            self._buffered = 0
            plan = plan.single()
        self._plan = plan
        if plan.policy.effective_max_attempts == 1:
            # Sent once (the buffer, or a cap of 1): no hedge timer to race, so its latency
            # is recorded whole (answered_before_hedge caps what the timer could have raced).
            self._delay = math.inf
        elif delay != math.inf:
            self._timer = loop.call_later(0.0 if INSTANT_DELAYS.get() else delay, self._hedge)
        core._live.add(self)  # until it ends (_wake): close(grace) waits for it
        first.add_done_callback(self._first_done)

    # -- hedge 0, the timer, the runner ------------------------------------------------
    def _first_done(self, call: Any) -> None:
        if self._driver is not None:
            return
        if call.cancelled():
            self._stop_timer()
            self._wake()
            return
        if _ended_ok(call):
            self._stop_timer()
            if not self._ended:
                self._ended = True
                latency = self._plan.policy.latency
                if latency is not None:  # hedge 0 answered before hedge 1 went out (rfc/0009)
                    elapsed = max(self._loop.time() - self._sent_at, 0.0)
                    latency.record(answered_before_hedge(elapsed, self._delay))
                throttler = self._core.throttler
                if throttler is not None:
                    throttler.record_success()
            self._wake()
        else:  # a status (or a call the runner has to await to tell): the runner decides
            self._hedge()

    def _hedge(self) -> None:
        """The hedging delay passed, or hedge 0 failed: the runner takes over."""
        self._stop_timer()
        if self._driver is not None or self._ended or self._cancelled:
            return
        core = self._core
        if core._closing and not self._first.done():
            return  # no other copy: hedge 0 ends as grpc.aio's close (and its grace) decides
        self._driver = driver = self._loop.create_task(
            hedged_unary_unary(
                self._core,
                self._plan,
                Continuation(self._inner, self._compression),
                self._details,
                self._message,
                first=self._first,
                started=self._started,
                sent_at=self._sent_at,
                open_streamed=direct_opener(self._inner, self._message, self._compression),
                deadline_from=self._deadline_from,
                trace=self._trace,
                on_request=self._adopt_request,
            )
        )
        driver.add_done_callback(self._driver_done)
        core._waiting.add(self)  # the channel's close cancels the copies it does not track

    def _adopt_request(self, request: Request) -> None:
        """The runner's Request: :meth:`cancel` cancels it too (``hedged_unary_unary``'s
        ``on_request``), also when the call was cancelled before the runner made it."""
        self._request = request
        if self._cancelled:
            request.cancel()

    def _driver_done(self, task: asyncio.Task[Any]) -> None:
        self._core._waiting.discard(self)
        self._ended = True
        if not task.cancelled():
            task.exception()  # read: a call nobody reads logs nothing, as grpc.aio's
        self._wake()

    def _stop_timer(self) -> None:
        timer = self._timer
        if timer is not None:
            self._timer = None
            timer.cancel()

    def _wake(self) -> None:
        """The call ended (every ending calls this): its readers wake, its request's
        share of the retry buffer goes back to the channel."""
        core = self._core
        if self._buffered:
            core._release(self._buffered)
            self._buffered = 0
        core._stopped_sending(self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _settling(self) -> bool:
        """True while neither hedge 0 ended OK nor the runner (if any) finished."""
        if self._driver is not None:
            return not self._driver.done()
        return not self._ended and not self._first.cancelled()

    def _wait(self) -> asyncio.Future[None]:
        waiter = self._waiter
        if waiter is None:
            waiter = self._waiter = self._loop.create_future()
            if not self._settling():
                waiter.set_result(None)
        return waiter

    def __await__(self) -> Generator[Any, None, Any]:
        if self._settling():
            try:
                yield from self._wait().__await__()
            except asyncio.CancelledError:
                self.cancel()
                raise
        driver = self._driver
        if driver is None:
            response = yield from self._first.__await__()
            return response
        call = yield from driver.__await__()
        response = yield from call.__await__()
        return response

    # -- readers -------------------------------------------------------------------
    async def _settled(self) -> tuple[Any, Any] | None:
        """(the final call, None), (None, its AioRpcError), or None when cancelled."""
        try:
            if self._settling():
                await asyncio.shield(self._wait())
            driver = self._driver
            if driver is None:
                if self._first.cancelled():
                    return None
                return self._first, None
            try:
                return await asyncio.shield(driver), None
            except aio.AioRpcError as err:
                return None, err
        except asyncio.CancelledError:
            if not self.cancelled():
                raise  # the awaiting task itself was cancelled
            return None

    def _trailing(self, call: Any, md: Any) -> Any:
        return md if call is not self._first else _client_trailing(md, 0)

    async def wait_for_connection(self) -> None:
        try:
            await self._first.wait_for_connection()
        except aio.AioRpcError:
            return None  # the attempt failed: its status is read from the call

    def time_remaining(self) -> float | None:
        if self._timeout is None:
            return None
        return max(0.0, self._started + self._timeout - time.monotonic())

    # -- state -----------------------------------------------------------------------
    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancelled = True
        self._stop_timer()
        request = self._request
        if request is not None:  # cuts the runner's copies whatever the task's cancel does
            request.cancel()
        driver = self._driver
        if driver is not None:
            driver.cancel()
            # Nothing left for the channel's close to cancel: out of its set now, not when
            # the driver's done callback runs a turn later (the call is done already).
            self._core._waiting.discard(self)
        self._first.cancel()
        self._wake()
        return True

    def cancelled(self) -> bool:
        if self._cancelled:
            return True
        driver = self._driver
        if driver is not None:
            return driver.cancelled()
        return bool(self._first.cancelled())

    def done(self) -> bool:
        driver = self._driver
        if driver is None:
            first = self._first
            return bool(first.done()) and (self._ended or bool(first.cancelled()))
        if not driver.done():
            return False
        if driver.cancelled() or driver.exception() is not None:
            return True
        return bool(driver.result().done())

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self.done():
            callback(self)
        else:
            self._wait().add_done_callback(lambda _: callback(self))


class _TracedHedgedCall(_HedgedCall):
    """A :class:`_HedgedCall` on a channel with telemetry (rfc/0008): the call's trace
    starts with hedge 0 and ends with the call, whichever way it ends."""

    _trace: CallTrace

    def __init__(
        self,
        core: _Controller,
        plan: HedgePlan,
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
            traced=True,
        )

    def _first_done(self, call: Any) -> None:
        ended = self._ended
        super()._first_done(call)
        if self._driver is not None:
            return  # the runner took over: _driver_done ends the trace
        if call.cancelled() or self._cancelled:
            self._trace.end(asyncio.CancelledError())
        elif self._ended and not ended:  # hedge 0 ended OK before the delay
            self._trace.end(None)

    def _driver_done(self, task: asyncio.Task[Any]) -> None:
        # The call is over: the runner's outcome is the call's.
        self._trace.end(asyncio.CancelledError() if task.cancelled() else task.exception())
        super()._driver_done(task)
