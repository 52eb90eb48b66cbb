"""One application call on a retried method: its state, and the decision on a failed attempt.

Every call shape (unary, streaming, interceptor or direct) keeps one :class:`_Call`.
It is cheap until an attempt fails: the :class:`sdkcore.Request` the orchestrator
decides on is only built then (:attr:`_Call.request`), dated back to the call's start
so its deadline and elapsed time are those of the whole call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc import aio

from .. import _failing
from .._context import AttemptEffect, ErrorContext
from .._errors import (
    CouchbaseException,
    RequestCanceledException,
    RetryableError,
    TimeoutException,
)
from .._reason import RetryReason
from .._request import _DISPATCHING, Request, dispatching
from .._untrusted import count
from .._untrusted import show as _show
from ._controller import _Controller
from ._gate import LocalRefusal
from ._metadata import _client_trailing, _strip_attempts, _with_attempts
from ._plans import _Plan
from ._policy import (
    CALL_STATE_KEY,
    NO_CODES,
    PUSHBACK_KEY,
    REASON_TRANSPARENT,
    CallState,
    TransparentKind,
    costs_token,
    parse_pushback,
    status_reason,
    time_out_at_deadline,
)
from ._telemetry import CallTrace

_OK = grpc.StatusCode.OK
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_INTERNAL = grpc.StatusCode.INTERNAL
_READY = grpc.ChannelConnectivity.READY
_TRANSIENT_FAILURE = grpc.ChannelConnectivity.TRANSIENT_FAILURE

#: Why a call whose request did not fit in the replay buffer is not retried (A6: committed).
BUFFER_FULL = (
    "the request outgrew the replay buffer: per_call_buffer_limit "
    "(grpc.per_rpc_retry_buffer_size) or the channel's channel_buffer_limit "
    "(grpc.retry_buffer_size)"
)

#: Why a call whose last status the client made after the answer arrived is not retried.
ANSWERED = (
    "the server's answer arrived: the client failed the call after it "
    "(a status the client makes, such as a response over the receive limit)"
)


def call_context(error: BaseException) -> ErrorContext | None:
    """sdkcore's ErrorContext of the call an sdkcore channel failed with ``error``.

    A plain function. ``error`` is the ``grpc.aio.AioRpcError`` a call raised (or an
    exception chained from it, such as an outer request's failure). The context lists
    every attempt the channel made for the call: its A6 retries and transparent
    re-sends. None when the channel made no retry decision for it (a first answer is
    grpc's error unchanged). Anything but an exception instance raises TypeError.
    """
    if not isinstance(error, BaseException):
        raise TypeError(
            "call_context(error) must be the exception a call raised (a grpc.aio.AioRpcError, "
            f"or one chained from it), got {_show(error)}"
        )
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:  # to the first AioRpcError
        seen.add(id(current))
        if isinstance(current, aio.AioRpcError):
            cause = current.__cause__
            if isinstance(cause, CouchbaseException):
                return cause.context
            return None
        current = current.__cause__
    return None


def answered(err: Any) -> bool:
    """True when ``err`` may be a status the client made after the server's answer arrived.

    grpc C-core fails a call on the client when a response message is over the
    channel's receive limit (RESOURCE_EXHAUSTED "Received message larger than max")
    or cannot be decompressed (INTERNAL): the server has run the call by then, so
    A6 counts it as committed. grpc.aio does not say whether the headers arrived, so
    the status text decides, in the safe direction only: a server imitating the
    text makes its own status final (never retried), never the reverse.
    A request over the send limit ("Sent message larger than max") never left the
    client; resending it would fail the same way, so it is final too.
    """
    code = err.code()
    if code is _RESOURCE_EXHAUSTED:
        details = err.details() or ""
        return "larger than max" in details
    if code is _INTERNAL:
        details = err.details() or ""
        return "CLIENT:" in details or "ecompress" in details
    return False


#: Which request's timeout a call's deadline came from: (id, name, timeout seconds), as
#: ``Request`` keeps it for its error context (``extra["deadline_from"]``).
Origin = tuple[int, str, float]


def outer_bound(outer: Request, timeout: float | None) -> tuple[float | None, Origin | None]:
    """``timeout`` (seconds, None: none) bounded by the time left of ``outer``.

    ``outer``: the request whose attempt is being sent while this call is made
    (:func:`sdkcore._request.dispatching`). The call must not outlive that request,
    so its deadline is the earlier of its own and the request's time left
    (:meth:`Request.dispatch_info`, which an enclosing trio/anyio cancel scope also
    bounds), and every attempt's ``grpc-timeout`` says so. Returns the timeout and,
    when the outer request's is the earlier, where it came from (else None). The
    callers ask :func:`dispatching` themselves: without an outer request, that one
    call is all it costs.
    """
    left = outer.dispatch_info().time_left
    if left is None or (timeout is not None and timeout <= left):
        return timeout, None
    return float(left), outer._deadline_from or (outer.id, outer.name, outer._timeout_s)


def call_timeout(plan: Any, timeout: float | None) -> tuple[float | None, Origin | None]:
    """A call's timeout in seconds (None: none), and where it came from when an outer
    request's time left set it (see :func:`outer_bound`; else None).

    The earliest of the call's own ``timeout``, its method config's (grpc C-core applies
    the same min) and, for a call made inside a request's send, that request's time
    left; at least 1 us. One rule for every call an sdkcore channel makes (``plan``: a
    retry plan or a hedging plan, for its ``timeout``).
    """
    if plan.timeout is not None and (timeout is None or plan.timeout < timeout):
        timeout = plan.timeout
    origin = None
    outer = dispatching()
    if outer is not None:  # made inside a request's send: never outlive it
        timeout, origin = outer_bound(outer, timeout)
    return (None if timeout is None else max(timeout, 1e-6)), origin


def within_outer(outer: Request, timeout: float | None) -> float | None:
    """:func:`outer_bound`'s timeout alone."""
    return outer_bound(outer, timeout)[0]


def outer_details(outer: Request, details: Any) -> Any:
    """``details`` with its timeout bounded by the outer request (see :func:`within_outer`)."""
    timeout = within_outer(outer, details.timeout)
    if timeout == details.timeout:
        return details
    return aio.ClientCallDetails(
        details.method, timeout, details.metadata, details.credentials, details.wait_for_ready
    )


class _Since:
    """A monotonic clock whose first reading is the call's start (see :attr:`_Call.request`)."""

    __slots__ = ("start",)

    def __init__(self, start: float) -> None:
        self.start = start

    def __call__(self) -> float:
        start = self.start
        if start < 0.0:
            return time.monotonic()
        self.start = -1.0
        return start


class _Call:
    """One application call: its state, and the Request once an attempt failed."""

    __slots__ = (
        "_request",
        "base_md",
        "buffered",
        "core",
        "credentials",
        "deadline_from",
        "in_backoff",
        "method",
        "plan",
        "ready_at_start",
        "started",
        "state",
        "strategy",
        "timeout",
        "wait_for_ready",
    )
    # Slots left unset unless they apply (read with getattr): nothing to store per call.
    #: The outer request whose time left bounded ``timeout`` (see outer_bound).
    deadline_from: Origin
    #: The call's telemetry: None here, a slot of :class:`_TracedCall` (a channel with
    #: telemetry). A class attribute, so a call without telemetry stores nothing.
    trace: CallTrace | None = None

    def __init__(
        self,
        core: _Controller,
        plan: _Plan,
        method: Any,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
    ) -> None:
        self.core = core
        self.plan = plan
        self.method = method
        self.timeout, origin = call_timeout(plan, timeout)
        if origin is not None:
            self.deadline_from = origin
        self.started = time.monotonic()
        self.state = CallState()
        budget = core.orchestrator.retry_budget
        if budget is not None:  # every call's first attempt pays into the shared retry budget
            budget.deposit()
        self.strategy = plan.strategy
        self.wait_for_ready = wait_for_ready if wait_for_ready is not None else plan.wait_for_ready
        self.base_md = _strip_attempts(metadata)
        self.credentials = credentials
        self.buffered = 0
        #: True while the call waits in the orchestrator for its next attempt.
        self.in_backoff = False
        #: Whether the channel was READY (or unknown) when the current attempt started.
        self.ready_at_start = True
        self._request: Request | None = None

    @classmethod
    def from_details(cls, core: _Controller, plan: _Plan, details: Any) -> _Call:
        """A call from an interceptor's ``ClientCallDetails``."""
        return cls(
            core,
            plan,
            details.method,
            details.timeout,
            details.metadata,
            details.credentials,
            details.wait_for_ready,
        )

    @property
    def name(self) -> str:
        name = self.plan.name
        if not name:
            method = self.method
            name = method.decode() if isinstance(method, bytes) else str(method)
        return name

    @property
    def request(self) -> Request:
        """The call's Request, built on first use (the first failure needs it)."""
        request = self._request
        if request is None:
            # Built with no outer request in view: the call's timeout already holds the
            # outer request's bound, taken when the call started. Inherited again here,
            # on a clock dated back to that start, the time since would count twice.
            token = _DISPATCHING.set(None)
            try:
                request = self._new_request()
            finally:
                _DISPATCHING.reset(token)
            origin = getattr(self, "deadline_from", None)
            if origin is not None:  # its error context names the outer request, as inheriting does
                request._deadline_from = origin
            request._first_dispatch()  # its first attempt already paid the budget, above
        return request

    def _new_request(self) -> Request:
        request = self._request = Request(
            name=self.name,
            # A6: a method's retryPolicy is the service owner's word that its
            # retryableStatusCodes are safe to send again, answered or not (the
            # core never re-sends a non-idempotent request that may have been
            # applied). Without one, only transparent retries (never sent) remain.
            idempotent=self.strategy.policy is not None,
            timeout=self.timeout,
            retry_strategy=self.strategy,
            client_context={CALL_STATE_KEY: self.state},
            clock=_Since(self.started),
        )
        return request

    def time_left(self) -> float | None:
        timeout = self.timeout
        if timeout is None:
            return None
        left = self.started + timeout - time.monotonic()
        return left if left > 0.0 else 0.0

    def next_attempt(self) -> Any:
        """Count the next attempt; its metadata (with the previous-attempts header)."""
        st = self.state
        st.attempts += 0 if st.transparent is not None else 1
        st.transparent = None
        previous = st.attempts - 1
        core = self.core
        # It sends: close(grace) waits for it until release() (registered here, not when
        # made, so that a call whose making raised is never waited for).
        core._live.add(self)
        if core.transparent_retries and core._channel is not None:
            state = core._connectivity()
            self.ready_at_start = state is None or state is _READY
        return self.base_md if previous == 0 else _with_attempts(self.base_md, previous)

    def next_details(self) -> Any:
        """Call details for the next attempt (time left, previous-attempts header)."""
        md = self.next_attempt()
        return aio.ClientCallDetails(
            self.method, self.time_left(), md, self.credentials, self.wait_for_ready
        )

    def buffer_unary(self, size: int) -> None:
        """Account a unary request of ``size`` bytes (``core.message_size``, read by the
        caller before the call's state was made: a size that raises leaves no call, no
        request and no telemetry behind) in the replay buffer; commit if it does not fit."""
        if self.core._hold(size):
            self.buffered = size
        else:
            self.state.committed = True
            self.state.commit_why = BUFFER_FULL

    def release(self) -> None:
        """The call sends no attempt more (it ended, or its stream committed): its replay
        buffer goes back to the channel, and ``close(grace)`` stops waiting for it."""
        core = self.core
        if self.buffered:
            core._release(self.buffered)
            self.buffered = 0
        core._stopped_sending(self)

    def sent(self) -> None:
        """The attempt's grpc.aio call is made: the call's request, once it exists (a
        retried call, or one with telemetry), has an attempt in flight (booked maybe
        applied if a cancellation cuts it, see :meth:`ended`)."""
        request = self._request
        if request is not None:
            request._begin_attempt(request._clock())

    def cancel_in_flight(self) -> None:
        """``call.cancel()``: a retried call's attempt in flight is cut by the application,
        so its request ends cancelled via context (``Request.cancel()``), as ``call.cancel()``
        in the backoff ends it; :meth:`ended` then books the attempt and logs it."""
        request = self._request
        if (
            request is not None
            and request.retry_attempts > 0
            and request.in_flight
            and not self.in_backoff
        ):
            request.cancel()

    def ended(self, error: BaseException | None) -> None:
        """The call ended in flight (cancelled, or its stream failed).

        The call shapes call it on the endings :meth:`failed` never sees. A retried call
        (one its orchestrator already scheduled a retry for) cut in flight by a
        cancellation ends its request as a core door does: the attempt cut is booked
        maybe applied and ``retry.cancelled`` is logged (:func:`sdkcore._failing.finish_by`;
        rfc/0003, "How one call runs"). :class:`_TracedCall` also ends the call's telemetry.
        """
        request = self._request
        if (
            request is not None
            and error is not None
            and not isinstance(error, Exception)
            and request.retry_attempts > 0
        ):
            _failing.finish_by(request, error)

    def succeeded(self) -> None:
        request = self._request
        if request is not None:
            self.core.orchestrator.succeed(request)
        throttler = self.core.throttler
        if throttler is not None:
            throttler.record_success()

    async def failed(self, err: Any, owner: Any = None) -> None:
        """Decide on a failed attempt: return to retry after the delay, or raise the final error.

        ``owner``: the call object the application holds, when closing the channel
        helper's channel must cancel it while it waits (``_Controller._close_calls``).
        Passed here, not kept: a call that points back at its owner is a reference
        cycle, every call's objects then freed by the garbage collector (15 objects
        per OK call, 33 per retried call; bench/README, "bench_grpc_cpu.py").
        """
        st = self.state
        core = self.core
        code = err.code()
        st.code = code.value[0]
        if err.initial_metadata():
            st.committed = True
        elif not st.committed and answered(err):
            st.committed = True
            st.commit_why = ANSWERED
        trailing = err.trailing_metadata()
        st.pushback = parse_pushback(trailing.get_all(PUSHBACK_KEY)) if trailing else None
        kind = None
        never_left = False  # no connection: the attempt was not sent (its effect)
        if isinstance(err, LocalRefusal):
            # The channel's limiter or throttle refused the attempt: it never left the
            # client (A6 case 1; rfc/0009), re-sent transparently unless those are off.
            st.local_refusals += 1
            shed = err.__cause__
            by = shed.reason.name if isinstance(shed, RetryableError) else "refused"
            if by not in st.refused_by:
                st.refused_by += (by,)
            if core.transparent_retries:
                kind = TransparentKind.NEVER_SENT
            else:
                never_left = True
        elif (
            not self.ready_at_start
            and not st.committed
            and code is _UNAVAILABLE
            and not trailing
            and core._connectivity() is _TRANSIENT_FAILURE
        ):
            # From facts the server cannot set: the channel had no connection when the
            # attempt started and is failing to connect now, and nothing at all came back
            # (no headers, no trailers): it never reached a transport. grpc C-core fails
            # such an RPC at once without wait_for_ready (fail fast), and its retry policy
            # takes the UNAVAILABLE as any attempt's: so does this channel (rfc/0003,
            # "Fail fast"), knowing that nothing was sent.
            never_left = True
        # A failed retry attempt is counted once, when it is over: a transparent
        # re-send continues the same A6 attempt.
        if kind is None:
            self._attempt_failed()
            policy = self.strategy.policy
            if policy is None or st.code not in policy.retryable_status_codes:
                # An ordinary answer, not a retry decision: the call fails with it and
                # the orchestrator (and its retry log) never sees it.
                throttler = core.throttler
                if throttler is not None and costs_token(
                    st.code,
                    NO_CODES if policy is None else policy.retryable_status_codes,
                    st.pushback,
                ):
                    # a "don't retry" pushback, whatever the status and the method's policy
                    # (A6: every RPC; a method without a retryPolicy too, as grpc-java)
                    throttler.record_failure()
                final = self._final(err)
                request = self._request
                if request is None:
                    # The first attempt's answer (a NOT_FOUND, say) on a call without
                    # telemetry: no Request exists, and none is built only to be failed.
                    raise final
                # DEADLINE_EXCEEDED at the call's deadline: the request's timeout
                timeout = time_out_at_deadline(request, final)
                core.orchestrator.fail(request, final)
                if self._retried():
                    # The channel's own attempts, for an outer request's context (rfc/0003).
                    if final is err:
                        final = self._final(err, copy=True)
                    raise final from self._answer_context(request, err, timeout)
                raise final
        first = self._request is None  # built now, at the first attempt's failure
        request = self.request
        st.transparent = kind
        committed = st.committed
        if kind is None:
            # The server answered: whatever the status, it may have applied the call.
            reason = status_reason(st.code)
            effect = AttemptEffect.NOT_SENT if never_left else AttemptEffect.MAYBE_APPLIED
        else:
            reason, effect = REASON_TRANSPARENT, AttemptEffect.NOT_SENT
            refusal = err.__cause__
            if isinstance(err, LocalRefusal) and isinstance(refusal, RetryableError):
                reason = refusal.reason  # the limiter's or throttle's: the client shed it
        if owner is not None:
            if core._closing:
                # The channel is closing: it takes no new attempt. The call ends as
                # grpc.aio ends the calls in flight, cancelled, without waiting.
                if kind is not None:
                    self._attempt_failed()
                request.cancel()
                owner.cancel()
                raise asyncio.CancelledError()
            core._waiting.add(owner)
        self.in_backoff = True
        try:
            # The attempt's AioRpcError is the cause: logged as caused_by, the context's
            # last_error, and the __cause__ of the orchestrator's refusal.
            pushback = st.pushback  # A6 server pushback, the same hint as any server's
            hint: Any = None if pushback is None or pushback < 0 else pushback / 1000.0
            if hint is None and isinstance(err, LocalRefusal):
                # the limiter's or throttle's own hint (an adaptive limiter's last round
                # trip), as the core doors take it from the refusal (rfc/0009)
                refused = err.__cause__
                if isinstance(refused, RetryableError):
                    hint = refused.retry_after
            if first:
                # Sent at the call's start (the first reading of the request's clock,
                # _Since): booked with its duration, as every later attempt is (sent()
                # begins those).
                request._begin_attempt(self.started)
            await core.orchestrator.maybe_retry(
                request, reason, cause=err, effect=effect, retry_after=hint
            )
        except TimeoutException as exc:
            if kind is not None:
                self._attempt_failed()
            if exc.context is not None:  # the channel's attempts, as for a status answer
                extra = dict(exc.context.extra)
                extra.update(grpc_status=err.code().name, grpc_attempts=st.attempts)
                exc.context = exc.context.evolve(extra=extra)
            raise self._deadline(err) from exc
        except CouchbaseException as exc:
            if kind is not None:
                self._attempt_failed()
            if st.committed and not committed:
                raise self._final(err, copy=True) from self._committed_while_waiting(exc, reason)
            raise self._final(err, copy=True) from exc
        finally:
            self.in_backoff = False
            if owner is not None:
                core._waiting.discard(owner)
        if st.committed:
            # Committed while waiting (replay buffer overflow): A6 allows no more attempts.
            if kind is not None:
                self._attempt_failed()
            raise self._final(err, copy=True) from self._committed_while_waiting(err, reason)
        if st.transparent is None:  # the strategy may hand a transparent case to the policy
            core.stats.record_retry(self.name, st.attempts)
        else:
            core.stats.record_transparent_retry(self.name)

    def _retried(self) -> bool:
        st = self.state
        return st.attempts > 1 or st.transparent_retries > 0 or st.refused_retries > 0

    def _answer_context(
        self, request: Request, err: Any, timeout: TimeoutException | None = None
    ) -> BaseException:
        """An answer that ends a retried call: sdkcore's context of every attempt.

        ``timeout``: the request's timeout when the answer was its deadline
        (:func:`time_out_at_deadline`): that exception, with the same extras, so the
        context names the attempt cut in flight, not a status no attempt had."""
        st = self.state
        extra = {"grpc_status": err.code().name, "grpc_attempts": st.attempts}
        exc: CouchbaseException
        if timeout is not None and timeout.context is not None:
            timeout.context = timeout.context.evolve(extra={**timeout.context.extra, **extra})
            exc = timeout
        else:
            exc = CouchbaseException(
                f"gRPC call ended with {err.code().name} after {st.attempts} attempt(s)",
                context=request.error_context(status_reason(st.code), extra=extra),
            )
        exc.__cause__ = err
        return exc

    def _attempt_failed(self) -> None:
        if self.state.attempts > 1:
            self.core.stats.record_failed_retry(self.name)

    def _committed_while_waiting(
        self, cause: BaseException | None, reason: RetryReason
    ) -> BaseException:
        why = "the call committed while waiting to retry (replay buffer limit reached)"
        context = self.request.error_context(
            reason, extra={"not_retried_because": why, "grpc_attempts": self.state.attempts}
        )
        exc = RequestCanceledException(f"not retried: {why}", context=context)
        exc.__cause__ = cause
        return exc

    def _final(self, err: Any, *, copy: bool = False) -> Any:
        """The error the application gets for the last attempt's ``err``.

        ``copy``: always a new AioRpcError (when it is raised from an exception whose
        cause chain holds ``err``, so the chain has no cycle). After retries, the copy's
        debug string starts with the channel's attempt count (rfc/0003).
        """
        previous = max(self.state.attempts - 1, 0)
        trailing = err.trailing_metadata()
        md = _client_trailing(trailing, previous)
        note = self._note()
        if md is trailing and not copy and not note:
            return err
        return aio.AioRpcError(
            err.code(),
            err.initial_metadata(),
            md,
            err.details(),
            note + (err.debug_error_string() or ""),
        )

    def _note(self) -> str:
        """``"sdkcore: N attempts; "`` when the channel retried the call, else ``""``.

        Then A6's transparent re-sends (a refused stream sent again) and the local
        refusals (tries the channel's limiter or throttle refused: nothing was sent, so
        not re-sends), with their reasons: ``"sdkcore: 1 attempt, 3 local refusals
        (CONCURRENCY_LIMITED, not sent); "``."""
        st = self.state
        if not self._retried():
            return ""
        note = f"sdkcore: {count(st.attempts, 'attempt')}"
        if st.refused_retries:
            note += f", {count(st.refused_retries, 'transparent re-send')}"
        if st.local_refusals:
            by = ", ".join(st.refused_by)
            note += f", {count(st.local_refusals, 'local refusal')} ({by}, not sent)"
        return note + "; "

    def _deadline(self, err: Any) -> Any:
        previous = max(self.state.attempts - 1, 0)
        return aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            err.initial_metadata(),
            _client_trailing(err.trailing_metadata(), previous),
            "Deadline Exceeded",
            f"{self._note()}deadline reached while waiting to retry after {err.code().name}: "
            f"{err.details()}",
        )


class _TracedCall(_Call):
    """A call on a channel with telemetry (rfc/0008, "gRPC metrics and spans").

    Its Request is built when the call starts (the call's span is that request's), and
    its :class:`CallTrace` sees each attempt start and end and the call end. A channel
    without telemetry makes plain :class:`_Call` objects: none of this costs them anything.
    """

    __slots__ = ("trace",)
    trace: CallTrace

    def __init__(
        self,
        core: _Controller,
        plan: _Plan,
        method: Any,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: bool | None,
    ) -> None:
        super().__init__(core, plan, method, timeout, metadata, credentials, wait_for_ready)
        tel = core._tel
        assert tel is not None
        self.trace = tel.call(method, self.request, self.started)

    def next_attempt(self) -> Any:
        transparent = self.state.transparent is not None
        md = super().next_attempt()
        self.trace.attempt(self.state.attempts - 1, transparent)
        return md

    def succeeded(self) -> None:
        super().succeeded()
        self.trace.end(None)

    def ended(self, error: BaseException | None) -> None:
        super().ended(error)
        self.trace.end(error)

    async def failed(self, err: Any, owner: Any = None) -> None:
        trace = self.trace
        trace.attempt_end(trace.current, err)  # the attempt is over, whatever comes next
        try:
            await super().failed(err, owner)
        except BaseException as exc:
            trace.end(exc)  # the call is over: exc is what the application gets
            raise


class Continuation:
    """grpc.aio's multi-callable ``inner`` as an attempt loop's continuation (what an
    interceptor's ``continuation`` is): each attempt one call of it, with the attempt's
    details (time left, previous-attempts header) and the call's ``compression``. The
    streaming shapes' direct path and hedged calls use it."""

    __slots__ = ("_compression", "_inner")

    def __init__(self, inner: Any, compression: Any) -> None:
        self._inner = inner
        self._compression = compression

    async def __call__(self, details: Any, request: Any) -> Any:
        return self._inner(
            request,
            timeout=details.timeout,
            metadata=details.metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
            compression=self._compression,
        )
