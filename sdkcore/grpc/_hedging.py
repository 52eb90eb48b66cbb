"""A6 ``hedgingPolicy`` for unary-unary calls, on the generic runner (rfc/0004).

Each hedge is its own grpc.aio call carrying ``grpc-previous-rpc-attempts`` = its
index. A hedge commits the call when its response headers arrive (or when it ends
with a response): the runner then cancels every other hedge, and the committed
hedge's outcome is final, even a non-fatal status.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Generator
from typing import Any

import grpc
from grpc import aio

try:  # grpc.aio's own call class (see _streamed_opener)
    from grpc.aio._call import UnaryStreamCall as _UnaryStreamCall
except ImportError:  # pragma: no cover - depends on grpcio internals
    _UnaryStreamCall = None

from .._context import AttemptEffect, CancellationReason
from .._errors import (
    CouchbaseException,
    RequestCanceledException,
    RetryableError,
    TimeoutException,
)
from .._hedge import answered_before_hedge, run_hedged
from .._hooks import INSTANT_DELAYS
from .._request import _DISPATCHING, Request
from ._call import Origin, _Since, answered, call_timeout
from ._controller import _Controller
from ._finished import _FinishedUnaryCall
from ._gate import GatedMultiCallable, LocalRefusal, RefusedUnaryStreamCall
from ._metadata import _client_trailing, _strip_attempts, _with_attempts
from ._plans import HedgePlan, _method_name, _pushback_ms
from ._policy import costs_token, status_reason, time_out_at_deadline
from ._status import status_name
from ._telemetry import CallTrace

__all__ = ["HedgePlan", "hedged_unary_unary"]

_OK = grpc.StatusCode.OK
_PENDING: Any = object()  # committed on headers, the response is still to come
_VIA_CONTEXT = CancellationReason.CANCELLED_VIA_CONTEXT  # the call's cancel(): see on_request
#: The details a losing hedge's attempt span ends with (CANCELLED), as grpc-java's
#: "Stream thrown away because RetriableStream committed": not an application's cancel.
_LOST = "hedge lost: another attempt committed"
_LOST_TO_FATAL = "hedge lost: another attempt's fatal status ended the call"


class _ChannelClosed(Exception):
    """The channel refused a later hedge (it was closed): ends the hedging (fatal)."""


def _note(sent: int) -> str:
    """``"sdkcore: N hedges; "`` when the call sent more than one copy, else ``""``: the
    start of its error's debug string, as a retried call's ``"sdkcore: N attempts; "``."""
    return f"sdkcore: {sent} hedges; " if sent > 1 else ""


def _error(err: Any, previous: int, sent: int = 1) -> Any:
    """``err`` reporting which hedge's status it is (``grpc-previous-rpc-attempts``) and,
    in its debug string, how many copies the call sent (``sent``)."""
    trailing = err.trailing_metadata()
    corrected = _client_trailing(trailing, previous)
    note = _note(sent)
    if corrected is trailing and not note:
        return err
    return aio.AioRpcError(
        err.code(),
        err.initial_metadata(),
        corrected,
        err.details(),
        note + (err.debug_error_string() or ""),
    )


def _copy(err: Any) -> Any:
    """A new AioRpcError like ``err``: raised from a context whose cause is ``err``, the
    chain then holds no cycle."""
    return aio.AioRpcError(
        err.code(),
        err.initial_metadata(),
        err.trailing_metadata(),
        err.details(),
        err.debug_error_string(),
    )


def _fatal_context(request: Request, err: Any) -> BaseException:
    """A fatal status after hedges went out: sdkcore's context of every hedge (what
    ``call_context`` reads), as a retried call's final answer carries."""
    sent = request.retry_attempts + 1  # hedges count as retries (RFC 0049)
    context = request.error_context(
        status_reason(err.code().value[0]),
        extra={"grpc_status": err.code().name, "grpc_attempts": sent, "hedges_sent": sent},
    )
    exc = CouchbaseException(
        f"gRPC call ended with {err.code().name} (fatal for the hedging policy) after {sent} "
        "hedge(s)",
        context=context,
    )
    exc.__cause__ = err
    return exc


def hedge_request(
    name: str, timeout: float | None, started: float, deadline_from: Origin | None
) -> Request:
    """A hedged call's sdkcore Request, dated back to the call's start: one deadline for
    every hedge. Built with no outer request in view: ``timeout`` holds its bound already
    (see _Call.request), and ``deadline_from`` names it."""
    token = _DISPATCHING.set(None)
    try:
        request = Request(name=name, idempotent=True, timeout=timeout, clock=_Since(started))
    finally:
        _DISPATCHING.reset(token)
    if deadline_from is not None:  # its error context names the outer request
        request._deadline_from = deadline_from
    request._first_dispatch()  # the call's first attempt already paid the retry budget
    return request


def hedge_trace(
    core: _Controller,
    method: Any,
    timeout: float | None,
    started: float,
    deadline_from: Origin | None,
) -> CallTrace:
    """The telemetry of a hedged call starting now; its Request is made at once."""
    assert core._tel is not None
    request = hedge_request(_method_name(method), timeout, started, deadline_from)
    return core._tel.call(method, request, started)


async def intercepted_hedged_unary_unary(
    core: _Controller,
    plan: HedgePlan,
    continuation: Callable[..., Any],
    details: Any,
    message: Any,
) -> Any:
    """The interceptor path of a hedged call: its timeout bounded (:func:`call_timeout`),
    then :func:`hedged_unary_unary`. On a channel with telemetry the call's trace starts
    before hedge 0 and ends with the call."""
    timeout, deadline_from = call_timeout(plan, details.timeout)
    started = time.monotonic()
    details = aio.ClientCallDetails(
        details.method, timeout, details.metadata, details.credentials, details.wait_for_ready
    )
    # A6's retry buffer, as on the direct path (_HedgedCall): a request that does not fit
    # is sent once, unhedged; one that fits is held until the call is over. Its size is
    # read first: a size that raises leaves no trace open.
    size = core.message_size(message)
    budget = core.orchestrator.retry_budget
    if budget is not None:  # the call's first attempt pays into the retry budget
        budget.deposit()
    trace = None
    if core._tel is not None:
        trace = hedge_trace(core, details.method, timeout, started, deadline_from)
    if core._hold(size):
        buffered = size
    else:
        buffered = 0
        plan = plan.single()
    try:
        call = await hedged_unary_unary(
            core,
            plan,
            continuation,
            details,
            message,
            started=started,
            deadline_from=deadline_from,
            trace=trace,
        )
    except BaseException as exc:
        if trace is not None:
            trace.end(exc)
        raise
    finally:
        core._release(buffered)
    if trace is not None:
        trace.end(None)
    return call


async def hedged_unary_unary(
    core: _Controller,
    plan: HedgePlan,
    continuation: Callable[..., Any],
    details: Any,
    message: Any,
    *,
    started: float,
    first: Any = None,
    sent_at: float | None = None,
    open_streamed: Callable[[Any], Any] | None = None,
    deadline_from: Origin | None = None,
    trace: CallTrace | None = None,
    on_request: Callable[[Request], None] | None = None,
) -> Any:
    """Run one unary-unary call as A6 hedges; return the committed call or raise its error.

    The first attempt is grpc.aio's own unary call (its cheapest path); the call
    waits for it up to the hedging delay without starting any task. Only when the
    delay passes (or it fails with a non-fatal status) does the generic runner take
    over, with that attempt as hedge 0 and header-aware hedges after it.

    Its callers bound ``details.timeout`` first (:func:`call_timeout`: the method
    config's timeout, an outer request's time left, the 1 us floor) and pass
    ``started`` (time.monotonic() when the call was made) and ``deadline_from`` (the
    outer request whose time left bounded the timeout, or None). The direct path
    (``_hedged_call``) sends hedge 0 and waits for it itself: it also passes ``first``
    (that call), ``sent_at`` (the loop time it was sent) and ``open_streamed`` (how to
    open hedges as unary-stream RPCs, or None).

    ``trace``: the call's telemetry (its Request is the runner's; rfc/0008); the caller
    ends it with the call (``_HedgedCall._driver_done``,
    :func:`intercepted_hedged_unary_unary`). Here each hedge is an attempt of it.

    ``on_request``: given the runner's Request as soon as it is made (the direct path's
    call object), whose ``cancel()`` then cancels it with ``Request.cancel()`` as well as
    this task. A request cancelled that way (CANCELLED_VIA_CONTEXT: nothing else holds
    it) ends the call cancelled, whatever the runner saw afterwards: on Python 3.10,
    which cannot count a task's cancellations, the task's own cancellation could be
    taken for a cut of the runner's scopes (hedge 0 cut as another hedge won or
    committed, the deadline) and lost (rfc/0004, "Cancellation").
    """
    method = details.method
    name: str = method.decode() if isinstance(method, bytes) else str(method)
    timeout = details.timeout  # bounded by the caller (call_timeout)
    wait_for_ready = (
        details.wait_for_ready if details.wait_for_ready is not None else plan.wait_for_ready
    )
    base_md = _strip_attempts(details.metadata)
    stats = core.stats
    throttler = core.throttler
    non_fatal = plan.non_fatal
    # index of the last hedge whose failure arrived; of the first fatal one (-1: none yet),
    # which ends the chain (booked in its copy's task as soon as failed() returns it)
    last = [0, -1]
    flight = [0, 0]  # hedges sent, hedges that ended (not cancelled)
    last_status = [""]  # the status of the last hedge that failed

    def attempt_details(index: int) -> Any:
        left = None if timeout is None else max(0.0, started + timeout - time.monotonic())
        return aio.ClientCallDetails(
            method,
            left,
            base_md if index == 0 else _with_attempts(base_md, index),
            details.credentials,
            wait_for_ready,
        )

    def failed(err: Any, index: int) -> BaseException:
        """A hedge failed without headers: RetryableError if non-fatal, else ``err``."""
        last[0] = index
        code = err.code().value[0]
        last_status[0] = status_name(code)
        if isinstance(err, LocalRefusal):
            # The channel's limiter or throttle refused this copy: nothing was sent
            # (its cause is their RetryableError, effect NOT_SENT; rfc/0009). As on the
            # retry path, no failed retry, nor a throttling failure (_Chain._failed).
            refusal = err.__cause__
            if isinstance(refusal, RetryableError):
                # Caused by the refusal's UNAVAILABLE: the call's status if it is the last.
                return RetryableError(
                    refusal.reason,
                    str(err.details()),
                    cause=err,
                    effect=AttemptEffect.NOT_SENT,
                    retry_after=refusal.retry_after,
                )
        if index > 0:
            stats.record_failed_retry(name)
        if code in non_fatal:
            # The server answered: whatever the status, it may have applied the call.
            failure = RetryableError(
                status_reason(code),
                f"{status_name(code)}: {err.details()}",
                cause=err,
                effect=AttemptEffect.MAYBE_APPLIED,
            )
            return failure
        if throttler is not None and costs_token(code, non_fatal, _pushback_ms(err)):
            throttler.record_failure()  # fatal: a "don't retry" pushback, whatever the status
        return err  # type: ignore[no-any-return]

    def committed_failure(err: Any, index: int) -> Any:
        """The committed hedge ended with ``err``: account it, return the final error."""
        if index > 0:
            stats.record_failed_retry(name)
        if throttler is not None and costs_token(err.code().value[0], non_fatal, _pushback_ms(err)):
            throttler.record_failure()
        return _error(err, index, flight[0])  # 0 before the runner: hedge 0 alone

    # -- hedge 0: a plain unary call, awaited up to the hedging delay -------------------
    loop = asyncio.get_running_loop()
    direct = first is not None
    if first is None:
        sent_at = loop.time()
        if trace is None:
            first = await continuation(attempt_details(0), message)
        else:  # hedge 0's span is current while its call is made
            token = trace.enter(trace.attempt(0))
            try:
                first = await continuation(attempt_details(0), message)
            finally:
                trace.leave(token)
    assert sent_at is not None
    adopted: Any = first
    #: Each hedge's attempt in the call's telemetry, by index (hedge 0's started first).
    attempts: dict[int, Any] = {} if trace is None else {0: trace.current}
    delay = plan.policy.delay.total_seconds()  # inf: a LatencyQuantile before min_samples
    if plan.policy.effective_max_attempts == 1:
        # Sent once (its request did not fit the retry buffer, or a cap of 1): no timer to race,
        # its answer's latency is recorded whole (answered_before_hedge would cap it).
        delay = math.inf
    try:
        if not first.done() and not direct:
            woken = loop.create_future()

            def wake(_: Any = None) -> None:
                if not woken.done():
                    woken.set_result(None)

            first.add_done_callback(wake)
            timer = None
            if plan.policy.effective_max_attempts > 1 and delay != math.inf:
                timer = loop.call_later(0.0 if INSTANT_DELAYS.get() else delay, wake)
            try:
                await woken
            finally:
                if timer is not None:
                    timer.cancel()
        if first.done():
            try:
                response = await first
            except aio.AioRpcError as err:
                if trace is not None:
                    trace.attempt_end(attempts[0], err)
                if err.initial_metadata() or answered(err):  # headers, then a status: final
                    raise committed_failure(err, 0) from None
                adopted = failed(err, 0)
                if adopted is err:  # a fatal status
                    raise _error(err, 0) from None
            else:
                if trace is not None:
                    trace.attempt_end(attempts[0], None)
                latency = plan.policy.latency
                if latency is not None:  # hedge 0 answered before hedge 1 went out (rfc/0009)
                    latency.record(answered_before_hedge(max(loop.time() - sent_at, 0.0), delay))
                if throttler is not None:
                    throttler.record_success()
                md = await first.trailing_metadata()
                if _client_trailing(md, 0) is md:
                    return first  # nothing to correct: the call as grpc.aio made it
                return _FinishedUnaryCall(first, 0)
    except BaseException:
        first.cancel()
        raise

    # -- the delay passed (or hedge 0 failed with a non-fatal status): hedge -------------
    if core._closing:
        # The channel is closing and takes no other copy: the call ends cancelled, as
        # grpc.aio ends the calls in flight.
        raise asyncio.CancelledError()
    if not direct:
        open_streamed = _streamed_opener(continuation, message)

    # (index, call) of every hedge that returned: a winner may still be on the wire, and
    # a second copy that committed in the winner's turn returned too.
    won: list[tuple[int, Any]] = []

    async def send(request: Request, index: int) -> tuple[int, Any, Any]:
        flight[0] += 1
        try:
            out = await send_hedge(index)
        except (aio.AioRpcError, RetryableError):
            flight[1] += 1
            raise
        flight[1] += 1
        won.append((out[0], out[1]))
        return out

    async def send_hedge(index: int) -> tuple[int, Any, Any]:
        attempt = None
        if index == 0:  # the attempt sent above
            if isinstance(adopted, RetryableError):
                raise adopted
            call = adopted
            streamed = False
            if trace is not None:
                attempt = attempts[0]
        else:
            if core._closing:  # the closing channel takes no other copy: none is counted
                raise _ChannelClosed()
            stats.record_retry(name, index)  # A6: hedges after the first are retries
            streamed = open_streamed is not None
            token = None
            if trace is not None:  # a sibling attempt span, current while its call is made
                attempt = attempts[index] = trace.attempt(index, hedge=True)
                token = trace.enter(attempt)
            try:
                if open_streamed is not None:
                    call = open_streamed(attempt_details(index))
                else:
                    call = await continuation(attempt_details(index), message)
            except aio.UsageError:
                raise _ChannelClosed() from None
            except BaseException as exc:
                # Cut while grpc.aio's continuation ran (an application interceptor after
                # sdkcore's may await the answer there): left open, CallTrace.end would
                # give it the call's status, a winner's OK.
                cut_attempt(attempt, exc)
                raise
            finally:
                if trace is not None:
                    trace.leave(token)
        try:
            if streamed:
                if await call.initial_metadata():
                    return index, call, _PENDING  # headers: commit to this hedge now (A6)
                response = await call.read()  # the response message commits too
            else:
                response = await call
                if trace is not None:
                    trace.attempt_end(attempt, None)
            return index, call, response
        except aio.AioRpcError as err:
            if trace is not None:
                trace.attempt_end(attempt, err)
            if err.initial_metadata() or answered(err):
                return index, call, _PENDING  # headers, then a status: this hedge is final
            failure = failed(err, index)
            if failure is err:  # a fatal status
                if last[1] < 0:
                    last[1] = index  # the call's status: it ends the chain
                # DEADLINE_EXCEEDED once the call's time is up is its timeout (the chain
                # then books the attempt and finds the request ended): as without hedging.
                time_out_at_deadline(request, err, book=False)
                raise
            raise failure  # noqa: B904 - its cause is the status (set by failed)
        except BaseException as exc:
            call.cancel()
            cut_attempt(attempt, exc)
            raise

    def cut_attempt(attempt: Any, exc: BaseException) -> None:
        """End the telemetry ``attempt`` of a copy that ``exc`` ended in flight.

        Cut past the call's deadline, and not because another copy won (a win may come
        just past it, before the deadline's timer ran: the loser is CANCELLED), the
        attempt stays open and ends with the call's status (CallTrace.end): the deadline's
        DEADLINE_EXCEEDED, or CANCELLED when the application's cancel() got there first.
        """
        if trace is not None and (
            isinstance(exc, Exception) or won or request.clock() < request.deadline
        ):
            if won and not isinstance(exc, Exception):
                trace.attempt_lost(attempt, _LOST)  # the hedge lost: another copy answered
            else:
                trace.attempt_end(attempt, exc)

    # The runner's Request (the call's own, with telemetry: made when the call started).
    request = (
        hedge_request(name, timeout, started, deadline_from) if trace is None else trace.request
    )
    if on_request is not None:
        on_request(request)
    winner: Any = None
    try:
        try:
            index, winner, response = await run_hedged(
                core.orchestrator,
                request,
                send,
                plan.policy,
                plan.throttler,
                first_elapsed=loop.time() - sent_at,
                finish=False,  # a hedge committed on its headers has no answer yet: see below
                ask_strategy=False,  # A6: the nonFatalStatusCodes alone decide
            )
        except Exception:
            if request.cancellation_reason is _VIA_CONTEXT:  # the call's cancel()
                raise asyncio.CancelledError() from None
            raise
    except aio.AioRpcError as err:  # a fatal status: its own hedge's index, not that of
        if trace is not None:
            # The copies it cut end CANCELLED, also those whose cut ran past the deadline
            # (left open by cut_attempt for the call's status: here not a timeout).
            for copy, attempt in attempts.items():
                if copy != last[1]:
                    trace.attempt_lost(attempt, _LOST_TO_FATAL)
        final = _error(err, last[1] if last[1] >= 0 else last[0], flight[0])  # a failure after
        if request.retry_attempts == 0:
            raise final from None  # the first hedge's answer: grpc's error, as without hedging
        raise _copy(final) from _fatal_context(request, err)
    except _ChannelClosed:
        # Closed while hedging: cancelled, as grpc.aio ends the calls in flight.
        raise asyncio.CancelledError() from None
    except TimeoutException as exc:
        previous = request.retry_attempts
        in_flight = flight[0] - flight[1]
        if in_flight > 0:
            why = f"deadline reached with {in_flight} hedge(s) in flight"
        else:  # every hedge sent had failed: the call was waiting to send the next one
            why = (
                f"deadline reached with no hedge in flight: {flight[1]} hedge(s) failed "
                f"(last: {last_status[0] or 'unknown'}) and the next one was not sent yet"
            )
        raise aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            aio.Metadata(),
            _with_attempts(aio.Metadata(), previous) if previous else aio.Metadata(),
            "Deadline Exceeded",
            _note(flight[0]) + why,
        ) from exc
    except RequestCanceledException as exc:
        cause = exc.__cause__
        if isinstance(cause, aio.AioRpcError):  # every hedge failed: the last one's status
            if exc.context is not None:  # the keys a retried call's context has too
                exc.context = exc.context.evolve(
                    extra={
                        **exc.context.extra,
                        "grpc_status": cause.code().name,
                        "grpc_attempts": flight[0],
                    }
                )
            raise _error(cause, last[0], flight[0]) from exc
        raise
    finally:
        if winner is not first and not isinstance(adopted, BaseException):
            first.cancel()
        # Every copy that returned but is not the winner is cut: the call ended otherwise
        # (call.cancel(), the caller's cancellation) as a hedge won, perhaps one committed
        # on its headers and still on the wire; or a second copy committed on its headers
        # in the winner's turn (the chain took the first). Its attempt ends CANCELLED.
        for copy, call in won:
            if call is not winner:
                call.cancel()
                if trace is not None:
                    trace.attempt_lost(attempts.get(copy), _LOST)

    # Committed to hedge ``index``: its outcome is the call's, and the request's. The runner
    # left the request pending (finish=False): a hedge committed on its headers may still
    # fail or be cancelled.
    call = winner
    streamed = index > 0 and open_streamed is not None
    try:
        if streamed:
            if response is _PENDING:
                response = await call.read()
            code = await call.code()
            if code is not _OK or response is aio.EOF:
                raise aio.AioRpcError(
                    code if code is not _OK else grpc.StatusCode.INTERNAL,
                    await call.initial_metadata(),
                    await call.trailing_metadata(),
                    await call.details() if code is not _OK else "no response message",
                    await call.debug_error_string(),
                )
        elif response is _PENDING:
            response = await call
    except aio.AioRpcError as err:
        if trace is not None:
            trace.attempt_end(attempts.get(index), err)
        final = committed_failure(err, index)
        time_out_at_deadline(request, final)  # DEADLINE_EXCEEDED: the request's timeout
        core.orchestrator.fail(request, final)
        raise final from None
    except BaseException as exc:
        call.cancel()
        request._finish_by(exc)  # the caller's cancellation (call.cancel() cancelled it already)
        raise
    if not request._succeeded():
        # Request.cancel() (call.cancel()) as the answer came in: a cancelled call.
        call.cancel()
        raise asyncio.CancelledError()
    if trace is not None:  # the committed hedge's attempt ends with the call, OK
        trace.attempt_end(attempts.get(index), None)
        if index > 0:
            trace.trace.hedge_won()
    if throttler is not None:
        throttler.record_success()
    if streamed:
        return _HedgedUnaryCall(call, response, index)
    return _FinishedUnaryCall(call, index)


class _HedgedUnaryCall(_FinishedUnaryCall):
    """The finished unary-unary call a hedge sent as a unary-stream RPC ended in."""

    def __init__(self, call: Any, response: Any, previous: int) -> None:
        super().__init__(call, previous)
        self._response = response

    def __await__(self) -> Generator[Any, None, Any]:
        return self._result().__await__()

    async def _result(self) -> Any:
        return self._response


def _streamed_opener(continuation: Any, message: Any) -> Callable[[Any], Any] | None:
    """Open hedges as unary-stream RPCs on the channel, when grpc.aio lets us.

    grpc.aio runs a unary-unary RPC as one batch: its response headers are seen
    only when the call ends. The same method called as a unary-stream RPC (the
    same bytes on the wire) reports its headers when they arrive, which A6 hedging
    commits on. This needs our interceptor to be the last one (the continuation
    then makes the call itself) and grpc.aio's call class; otherwise hedges go
    through the continuation and commit when their response arrives.
    """
    if _UnaryStreamCall is None or not isinstance(continuation, functools.partial):
        return None
    args = continuation.args
    owner = getattr(continuation.func, "__self__", None)
    if len(args) != 4 or args[0] or continuation.keywords or owner is None:
        return None
    channel = getattr(owner, "_channel", None)
    loop = getattr(owner, "_loop", None)
    if channel is None or loop is None:
        return None
    _, _, serializer, deserializer = args

    def open_call(d: Any) -> Any:
        return _UnaryStreamCall(
            message,
            None if d.timeout is None else time.time() + d.timeout,
            d.metadata if d.metadata is not None else aio.Metadata(),
            d.credentials,
            d.wait_for_ready,
            channel,
            d.method,
            serializer,
            deserializer,
            loop,
        )

    return open_call


def direct_opener(inner: Any, message: Any, compression: Any) -> Callable[[Any], Any] | None:
    """:func:`_streamed_opener` for the direct path: from grpc.aio's multi-callable ``inner``.

    Only when the channel has no unary-unary interceptor of the application's (a
    hedge opened as a unary-stream RPC would skip it); otherwise None. A channel's
    limiter or throttle (``GatedMultiCallable``) is kept: each hedge opened this way
    passes its gate, as a unary call would.
    """
    gate = None
    if isinstance(inner, GatedMultiCallable):
        gate, inner = inner._gate, inner._inner
    if _UnaryStreamCall is None or getattr(inner, "_interceptors", True):
        return None
    try:
        channel = inner._channel
        method = inner._method
        serializer = inner._request_serializer
        deserializer = inner._response_deserializer
        loop = inner._loop
        init_metadata = inner._init_metadata
    except AttributeError:  # pragma: no cover - depends on grpcio internals
        return None

    def open_call(d: Any) -> Any:
        return _UnaryStreamCall(
            message,
            None if d.timeout is None else time.time() + d.timeout,
            init_metadata(d.metadata, compression),
            d.credentials,
            d.wait_for_ready,
            channel,
            method,
            serializer,
            deserializer,
            loop,
        )

    if gate is not None:  # through the channel's gate, as its unary calls go
        return GatedMultiCallable(gate, open_call, RefusedUnaryStreamCall)
    return open_call
