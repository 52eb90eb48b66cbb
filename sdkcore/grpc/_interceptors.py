"""grpc.aio client interceptors that run A6 retries on the sdkcore RetryOrchestrator.

Each application call becomes one :class:`sdkcore.Request` (name = the full
method, timeout = the call's deadline and/or the method config's timeout) whose
``retry_strategy`` is the method's :class:`A6RetryStrategy`. Every failed attempt
is handed to ``RetryOrchestrator.maybe_retry``; its refusals and timeouts are
translated back into ``grpc.aio.AioRpcError`` for the application, with the
sdkcore exception (and its ErrorContext) chained as ``__cause__``.

What grpc.aio lets an interceptor observe, and how it is used, is documented in
rfc/0003-grpc-retry-design.md.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from typing import Any

import grpc
from grpc import aio
from grpc.aio import _base_call

from .._context import AttemptEffect
from .._errors import CouchbaseException, RequestCanceledException, TimeoutException
from .._orchestrator import RetryOrchestrator
from .._reason import RetryReason
from .._request import Request
from ._policy import (
    CALL_STATE_KEY,
    PUSHBACK_DONT_RETRY,
    PUSHBACK_KEY,
    REASON_TRANSPARENT,
    A6RetryStrategy,
    BackoffJitter,
    CallState,
    TransparentKind,
    parse_pushback,
    status_reason,
)
from ._service_config import DEFAULT_MAX_ATTEMPTS_CAP, MethodConfig, ServiceConfig
from ._stats import RetryStats
from ._throttle import RetryThrottler, _nothing
from ._throttle import _acquire as _acquire_throttler

__all__ = [
    "DEFAULT_CHANNEL_BUFFER_LIMIT",
    "DEFAULT_PER_CALL_BUFFER_LIMIT",
    "PREVIOUS_ATTEMPTS_KEY",
    "RetryController",
    "RetryStreamStreamInterceptor",
    "RetryStreamUnaryInterceptor",
    "RetryUnaryStreamInterceptor",
    "RetryUnaryUnaryInterceptor",
    "default_message_size",
    "previous_rpc_attempts",
]

#: A6 "Exposed Retry Metadata" header.
PREVIOUS_ATTEMPTS_KEY = "grpc-previous-rpc-attempts"
#: Per-call replay buffer limit (A6 ``per_rpc_buffer_limit_in_bytes``).
DEFAULT_PER_CALL_BUFFER_LIMIT = 256 * 1024
#: Per-channel replay buffer limit (A6 ``retry_buffer_size_in_bytes``).
DEFAULT_CHANNEL_BUFFER_LIMIT = 16 * 1024 * 1024

_EOF = aio.EOF
_OK = grpc.StatusCode.OK
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_READY = grpc.ChannelConnectivity.READY
_TRANSIENT_FAILURE = grpc.ChannelConnectivity.TRANSIENT_FAILURE

_OPT_SERVICE_CONFIG = "grpc.service_config"
_OPT_ENABLE_RETRIES = "grpc.enable_retries"
_OPT_NO_RESOLVED_CONFIG = "grpc.service_config_disable_resolution"


def default_message_size(message: Any) -> int:
    """Bytes a request message takes in the replay buffer.

    ``len`` for bytes-like values, ``ByteSize()`` for protobuf messages, else
    ``sys.getsizeof`` (pass ``message_size=`` for anything more precise).
    """
    if isinstance(message, (bytes, bytearray)):
        return len(message)
    if isinstance(message, memoryview):
        return message.nbytes
    byte_size = getattr(message, "ByteSize", None)
    if callable(byte_size):
        return int(byte_size())
    return sys.getsizeof(message)


def previous_rpc_attempts(error_or_metadata: Any) -> int:
    """How many attempts preceded the final one (0 when the first attempt decided).

    A plain function. Pass the ``AioRpcError`` a call raised, or the trailing
    metadata of a finished call: ``previous_rpc_attempts(await
    call.trailing_metadata())`` (grpc.aio makes a call's metadata awaitable; the
    count in it is not). A call object itself raises TypeError saying so.

    The count is the client's own: on a call that sdkcore retries (a method with a
    plan: a retryPolicy, transparent retries, throttling or a method timeout),
    sdkcore replaces any ``grpc-previous-rpc-attempts`` the server put in its
    trailing metadata, and sets it only when retries happened. A value that is
    not a non-negative integer of at most 10 digits counts as 0.
    """
    md = error_or_metadata
    trailing = getattr(md, "trailing_metadata", None)
    if trailing is not None:
        if inspect.iscoroutinefunction(trailing):
            raise TypeError(
                "previous_rpc_attempts(call): a call's trailing metadata must be awaited; "
                "pass `await call.trailing_metadata()` (or the AioRpcError the call raised)"
            )
        md = trailing()
    if not md:
        return 0
    value: Any = None
    for key, v in md:
        if key == PREVIOUS_ATTEMPTS_KEY:
            value = v
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 10:
        return 0
    return int(value)


def _truthy(value: Any) -> bool:
    """A grpc integer channel argument as a switch."""
    if isinstance(value, str):
        return value.strip() not in ("", "0")
    return bool(value)


def _with_attempts(md: Any, previous: int) -> aio.Metadata:
    """``md`` without any ``grpc-previous-rpc-attempts``, plus sdkcore's count if > 0."""
    out = aio.Metadata(*[(k, v) for k, v in (md or ()) if k != PREVIOUS_ATTEMPTS_KEY])
    if previous > 0:
        out.add(PREVIOUS_ATTEMPTS_KEY, str(previous))
    return out


def _client_trailing(md: Any, previous: int) -> Any:
    """Trailing metadata for the application: the previous-attempts count is the client's."""
    if previous > 0 or (md and any(k == PREVIOUS_ATTEMPTS_KEY for k, _ in md)):
        return _with_attempts(md, previous)
    return md


class _Plan:
    """What a method gets: its strategy and the method config's call settings."""

    __slots__ = ("strategy", "timeout", "wait_for_ready")

    def __init__(self, strategy: A6RetryStrategy, mc: MethodConfig | None) -> None:
        self.strategy = strategy
        self.timeout = None if mc is None or mc.timeout is None else mc.timeout.total_seconds()
        self.wait_for_ready = None if mc is None else mc.wait_for_ready


class RetryController:
    """The retry machinery shared by one channel's interceptors.

    * ``service_config``: a :class:`ServiceConfig` (or its JSON / a Mapping); None
      means no retry policies (transparent retries only). It is never handed to
      grpcio: grpc C-core runs no retry policy of its own on these channels.
    * ``target``: the server name; picks the process-wide throttler.
    * ``orchestrator``: the :class:`RetryOrchestrator` every retry goes through.
    * ``enabled``: False turns every kind of retry off (A6 "Disabling Retries").
    * ``max_attempts_cap``: the client cap on maxAttempts (A6 default 5).
    * ``backoff_jitter``: :class:`BackoffJitter` (the 2017 text or the 2024 amendment).
    * ``per_call_buffer_limit`` / ``channel_buffer_limit``: replay buffer limits in bytes.
    * ``transparent_retries``: A6 transparent retries when no connection could be
      made (needs :meth:`bind_channel`; see rfc/0003).
    * ``stats``: a :class:`RetryStats` to record into (a new one by default).
    * ``message_size``: bytes of a request message (default :func:`default_message_size`).
    """

    def __init__(
        self,
        target: str,
        service_config: ServiceConfig | str | bytes | Any | None = None,
        *,
        orchestrator: RetryOrchestrator | None = None,
        enabled: bool = True,
        max_attempts_cap: int = DEFAULT_MAX_ATTEMPTS_CAP,
        backoff_jitter: BackoffJitter = BackoffJitter.FULL,
        per_call_buffer_limit: int = DEFAULT_PER_CALL_BUFFER_LIMIT,
        channel_buffer_limit: int = DEFAULT_CHANNEL_BUFFER_LIMIT,
        transparent_retries: bool = True,
        transparent_retry_limit: int = 10,
        stats: RetryStats | None = None,
        message_size: Callable[[Any], int] | None = None,
    ) -> None:
        # Every argument is checked before any shared state (the process-wide
        # throttler of the target) is touched: a rejected controller changes nothing.
        if not isinstance(target, str):
            raise TypeError(
                f"RetryController(target) must be a str (the server name), got {target!r}"
            )
        if service_config is not None and not isinstance(service_config, ServiceConfig):
            service_config = ServiceConfig.from_json(service_config)
        for name, value in (
            ("per_call_buffer_limit", per_call_buffer_limit),
            ("channel_buffer_limit", channel_buffer_limit),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"RetryController({name}=...) must be an integer >= 0 bytes, got {value!r}"
                )
        for name, value in (("enabled", enabled), ("transparent_retries", transparent_retries)):
            if not isinstance(value, bool):
                raise TypeError(f"RetryController({name}=...) must be a bool, got {value!r}")
        if not isinstance(backoff_jitter, BackoffJitter):
            raise TypeError(
                "RetryController(backoff_jitter=...) must be a BackoffJitter (FULL or "
                f"PROPORTIONAL), got {backoff_jitter!r}"
            )
        if stats is not None and not isinstance(stats, RetryStats):
            raise TypeError(f"RetryController(stats=...) must be a RetryStats, got {stats!r}")
        if message_size is not None and not callable(message_size):
            raise TypeError(
                "RetryController(message_size=...) must be a callable returning bytes, "
                f"got {message_size!r}"
            )
        # max_attempts_cap and transparent_retry_limit, with the strategy's own messages.
        A6RetryStrategy(
            None,
            max_attempts_cap=max_attempts_cap,
            jitter=backoff_jitter,
            transparent_retry_limit=transparent_retry_limit,
        )
        self.target = target
        self.service_config: ServiceConfig | None = service_config
        self.orchestrator = orchestrator if orchestrator is not None else RetryOrchestrator()
        self.enabled = enabled
        self.stats = stats if stats is not None else RetryStats()
        self.per_call_buffer_limit = per_call_buffer_limit
        self.channel_buffer_limit = channel_buffer_limit
        self.transparent_retries = transparent_retries and enabled
        self.message_size = message_size or default_message_size
        self._buffered = 0
        self._buffer_lock = threading.Lock()
        throttling = None if service_config is None else service_config.retry_throttling
        self.throttler: RetryThrottler | None = None
        self._abandon: Callable[[], None] = _nothing
        if throttling is not None and enabled:  # last: the one shared state a controller changes
            self.throttler, self._abandon = _acquire_throttler(
                target, throttling.max_tokens, throttling.token_ratio
            )
        self._strategy_args: dict[str, Any] = {
            "throttler": self.throttler,
            "max_attempts_cap": max_attempts_cap,
            "jitter": backoff_jitter,
            "transparent_retry_limit": transparent_retry_limit,
        }
        self._plans: dict[Any, _Plan | None] = {}
        self._channel: weakref.ref[Any] | None = None

    # -- the channel ----------------------------------------------------------------
    def channel_options(
        self, options: Sequence[tuple[str, Any]] | None = None
    ) -> list[tuple[str, Any]]:
        """``options`` plus what grpc C-core needs on a channel that uses these interceptors.

        grpc C-core never gets a retry policy: a ``grpc.service_config`` option is
        refused (pass ``service_config=`` instead) and resolver-provided configs are
        ignored (``grpc.service_config_disable_resolution`` 1). Its retry filter is
        off (``grpc.enable_retries`` 0) unless ``options`` asks for it with
        ``("grpc.enable_retries", 1)``: then C-core also does A6 transparent retries
        of streams the server never saw, but it replaces the
        ``grpc-previous-rpc-attempts`` header of every attempt, so servers no
        longer see sdkcore's retry count (rfc/0003). That opt-in needs retries and
        transparent retries on. Raises ValueError for a conflicting option.
        """
        native = 0
        out: list[tuple[str, Any]] = []
        for item in options or ():
            try:
                key, value = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"channel options must be (key, value) pairs, got {item!r}"
                ) from None
            if key == _OPT_SERVICE_CONFIG:
                raise ValueError(
                    f"the {_OPT_SERVICE_CONFIG!r} channel option is not allowed on an sdkcore "
                    "channel: grpc C-core would run its own retries with it. Pass the config "
                    "as service_config=... instead."
                )
            if key == _OPT_ENABLE_RETRIES:
                if _truthy(value) and not self.transparent_retries:
                    raise ValueError(
                        f"channel option ({key!r}, {value!r}) conflicts with "
                        "retries_enabled=False / transparent_retries=False: it would turn "
                        "grpc C-core's transparent retries on"
                    )
                native = 1 if _truthy(value) else 0
                continue
            if key == _OPT_NO_RESOLVED_CONFIG:
                if not _truthy(value):
                    raise ValueError(
                        f"channel option ({key!r}, {value!r}) is not allowed on an sdkcore "
                        "channel: a service config from the name resolver could give grpc "
                        "C-core a retry policy of its own (sdkcore sets it to 1)"
                    )
                continue
            out.append((key, value))
        out.append((_OPT_ENABLE_RETRIES, native))
        out.append((_OPT_NO_RESOLVED_CONFIG, 1))
        return out

    def bind_channel(self, channel: Any) -> None:
        """Tell the controller which channel its interceptors run on.

        The channel helpers do this. It lets the interceptor see the channel's
        connectivity state, which is what recognises "no connection could be
        made" (A6 transparent retry case 1); without it that case goes to the
        retry policy like any other UNAVAILABLE.
        """
        self._channel = weakref.ref(channel)

    def _connectivity(self) -> Any:
        ref = self._channel
        channel = None if ref is None else ref()
        if channel is None:
            return None
        try:
            return channel.get_state(try_to_connect=False)
        except Exception:  # a closed channel, or an object without get_state
            return None

    # -- per-method plans ------------------------------------------------------
    def plan(self, method: Any) -> _Plan | None:
        """The plan for a method (bytes or str), or None when nothing is retried."""
        try:
            return self._plans[method]
        except KeyError:
            pass
        name = method.decode() if isinstance(method, bytes) else str(method)
        mc = None if self.service_config is None else self.service_config.method_config(name)
        policy = mc.retry_policy if mc is not None and self.enabled else None
        plan: _Plan | None = None
        # With retries off, a method config's timeout / waitForReady still apply; with
        # throttling, every successful call feeds the throttler (A6), policy or not.
        if (
            policy is not None
            or self.transparent_retries
            or self.throttler is not None
            or (mc is not None and (mc.timeout is not None or mc.wait_for_ready is not None))
        ):
            plan = _Plan(A6RetryStrategy(policy, **self._strategy_args), mc)
        self._plans[method] = plan
        return plan

    # -- channel-wide replay buffer ------------------------------------------------
    @property
    def buffered_bytes(self) -> int:
        """Bytes currently held for replay by all calls of the channel."""
        return self._buffered

    def _reserve(self, size: int) -> bool:
        with self._buffer_lock:
            if self._buffered + size > self.channel_buffer_limit:
                return False
            self._buffered += size
            return True

    def _release(self, size: int) -> None:
        if size:
            with self._buffer_lock:
                self._buffered -= size

    def interceptors(self) -> list[aio.ClientInterceptor]:
        """The four interceptors (unary-unary, unary-stream, stream-unary, stream-stream)."""
        return [
            RetryUnaryUnaryInterceptor(self),
            RetryUnaryStreamInterceptor(self),
            RetryStreamUnaryInterceptor(self),
            RetryStreamStreamInterceptor(self),
        ]


class _Call:
    """One application call: its Request, state and the attempt bookkeeping."""

    __slots__ = (
        "base_md",
        "buffered",
        "core",
        "details",
        "in_backoff",
        "method",
        "name",
        "ready_at_start",
        "request",
        "state",
        "strategy",
        "wait_for_ready",
    )

    def __init__(self, core: RetryController, plan: _Plan, details: Any) -> None:
        self.core = core
        self.details = details
        self.method = details.method
        name = self.method
        self.name: str = name.decode() if isinstance(name, bytes) else str(name)
        timeout = details.timeout
        if plan.timeout is not None and (timeout is None or plan.timeout < timeout):
            timeout = plan.timeout
        self.state = CallState()
        self.strategy = plan.strategy
        self.request = Request(
            name=self.name,
            timeout=None if timeout is None else max(timeout, 1e-6),
            retry_strategy=plan.strategy,
            client_context={CALL_STATE_KEY: self.state},
        )
        self.wait_for_ready = (
            details.wait_for_ready if details.wait_for_ready is not None else plan.wait_for_ready
        )
        md = details.metadata
        if md and any(k == PREVIOUS_ATTEMPTS_KEY for k, _ in md):
            md = aio.Metadata(*[(k, v) for k, v in md if k != PREVIOUS_ATTEMPTS_KEY])
        self.base_md = md
        self.buffered = 0
        #: True while the call waits in the orchestrator for its next attempt.
        self.in_backoff = False
        #: Whether the channel was READY (or unknown) when the current attempt started.
        self.ready_at_start = True

    def next_details(self) -> Any:
        """Call details for the next attempt (time left, previous-attempts header)."""
        st = self.state
        st.attempts += 0 if st.transparent is not None else 1
        st.transparent = None
        previous = st.attempts - 1
        md = self.base_md if previous == 0 else _with_attempts(self.base_md, previous)
        core = self.core
        if core.transparent_retries and core._channel is not None:
            state = core._connectivity()
            self.ready_at_start = state is None or state is _READY
        left = self.request.time_left
        return aio.ClientCallDetails(
            self.method,
            None if left is None else left.total_seconds(),
            md,
            self.details.credentials,
            self.wait_for_ready,
        )

    def buffer_unary(self, message: Any) -> None:
        """Account a unary request in the replay buffer; commit if it does not fit."""
        core = self.core
        size = core.message_size(message)
        if size > core.per_call_buffer_limit or not core._reserve(size):
            self.state.committed = True
        else:
            self.buffered = size

    def release(self) -> None:
        self.core._release(self.buffered)
        self.buffered = 0

    def succeeded(self) -> None:
        self.core.orchestrator.succeed(self.request)
        throttler = self.core.throttler
        if throttler is not None:
            throttler.record_success()

    async def failed(self, err: Any) -> None:
        """Decide on a failed attempt: return to retry after the delay, or raise the final error."""
        st = self.state
        core = self.core
        code = err.code()
        st.code = code.value[0]
        if err.initial_metadata():
            st.committed = True
        trailing = err.trailing_metadata()
        st.pushback = parse_pushback(trailing.get_all(PUSHBACK_KEY)) if trailing else None
        kind = None
        if (
            not self.ready_at_start
            and not st.committed
            and code is _UNAVAILABLE
            and not trailing
            and core._connectivity() is _TRANSIENT_FAILURE
        ):
            # A6 case 1, from facts the server cannot set: the channel had no connection
            # when the attempt started and is failing to connect now, and nothing at all
            # came back (no headers, no trailers). grpc C-core fails such an RPC at once
            # without wait_for_ready; it never reached a transport.
            kind = TransparentKind.NEVER_SENT
        # A failed retry attempt is counted once, when it is over: a transparent
        # re-send continues the same A6 attempt.
        if kind is None:
            self._attempt_failed()
            policy = self.strategy.policy
            if policy is None or st.code not in policy.retryable_status_codes:
                # An ordinary answer, not a retry decision: the call fails with it and
                # the orchestrator (and its retry log) never sees it.
                if st.pushback == PUSHBACK_DONT_RETRY and policy is not None:
                    throttler = core.throttler
                    if throttler is not None:  # A6: counts for throttling whatever the status
                        throttler.record_failure()
                raise core.orchestrator.fail(self.request, self._final(err))
        st.transparent = kind
        committed = st.committed
        if kind is None:
            # The server answered: whatever the status, it may have applied the call.
            reason, effect = status_reason(st.code), AttemptEffect.MAYBE_APPLIED
        else:
            reason, effect = REASON_TRANSPARENT, AttemptEffect.NOT_SENT
        self.in_backoff = True
        try:
            # The attempt's AioRpcError is the cause: logged as caused_by, the context's
            # last_error, and the __cause__ of the orchestrator's refusal.
            await core.orchestrator.maybe_retry(self.request, reason, cause=err, effect=effect)
        except TimeoutException as exc:
            if kind is not None:
                self._attempt_failed()
            raise self._deadline(err) from exc
        except CouchbaseException as exc:
            if kind is not None:
                self._attempt_failed()
            if st.committed and not committed:
                raise self._final(err, copy=True) from self._committed_while_waiting(exc, reason)
            raise self._final(err, copy=True) from exc
        finally:
            self.in_backoff = False
        if st.committed:
            # Committed while waiting (replay buffer overflow): A6 allows no more attempts.
            if kind is not None:
                self._attempt_failed()
            raise self._final(err, copy=True) from self._committed_while_waiting(err, reason)
        if st.transparent is None:  # the strategy may hand a transparent case to the policy
            core.stats.record_retry(self.name, st.attempts)
        else:
            core.stats.record_transparent_retry(self.name)

    def _attempt_failed(self) -> None:
        if self.state.attempts > 1:
            self.core.stats.record_failed_retry(self.name)

    def _committed_while_waiting(
        self, cause: BaseException | None, reason: RetryReason
    ) -> BaseException:
        why = "the call committed while waiting to retry (replay buffer limit reached)"
        self.state.refusal = why
        context = self.request.error_context(
            reason, extra={"not_retried_because": why, "grpc_attempts": self.state.attempts}
        )
        exc = RequestCanceledException(f"not retried: {why}", context=context)
        exc.__cause__ = cause
        return exc

    def _final(self, err: Any, *, copy: bool = False) -> Any:
        """The error the application gets for the last attempt's ``err``.

        ``copy``: always a new AioRpcError (when it is raised from an exception whose
        cause chain holds ``err``, so the chain has no cycle).
        """
        previous = max(self.state.attempts - 1, 0)
        trailing = err.trailing_metadata()
        md = _client_trailing(trailing, previous)
        if md is trailing and not copy:
            return err
        return aio.AioRpcError(
            err.code(), err.initial_metadata(), md, err.details(), err.debug_error_string()
        )

    def _deadline(self, err: Any) -> Any:
        previous = max(self.state.attempts - 1, 0)
        return aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            err.initial_metadata(),
            _client_trailing(err.trailing_metadata(), previous),
            "Deadline Exceeded",
            f"deadline reached while waiting to retry after {err.code().name}: {err.details()}",
        )


class _FinishedUnaryCall(_base_call.UnaryUnaryCall):  # type: ignore[misc]
    """A finished successful call, reporting how many attempts preceded it."""

    def __init__(self, call: Any, previous: int) -> None:
        self._call = call
        self._previous = previous

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)

    def time_remaining(self) -> float | None:
        return None

    async def initial_metadata(self) -> Any:
        return await self._call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        return _with_attempts(await self._call.trailing_metadata(), self._previous)

    async def code(self) -> Any:
        return await self._call.code()

    async def details(self) -> str:
        return str(await self._call.details())

    async def debug_error_string(self) -> str | None:
        return await self._call.debug_error_string()  # type: ignore[no-any-return]

    async def wait_for_connection(self) -> None:
        return None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._call.__await__()  # type: ignore[no-any-return]


class _Interceptor:
    def __init__(self, controller: RetryController) -> None:
        if not isinstance(controller, RetryController):
            raise TypeError(
                f"{type(self).__name__}(controller) takes a RetryController, got {controller!r}"
            )
        self.controller = controller

    async def _streaming(
        self,
        call_class: type[_RetryingCall],
        continuation: Callable[..., Any],
        details: Any,
        request: Any,
        *,
        request_streaming: bool,
        response_streaming: bool,
    ) -> Any:
        """A retrying call for a streaming method with a plan, else the plain call."""
        plan = self.controller.plan(details.method)
        if plan is None:
            return await continuation(details, request)
        return call_class(
            _Call(self.controller, plan, details),
            continuation,
            request,
            request_streaming=request_streaming,
            response_streaming=response_streaming,
        )


class RetryUnaryUnaryInterceptor(_Interceptor, aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Retries unary-unary calls (A6) through the sdkcore orchestrator."""

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        core = self.controller
        if core.service_config is not None:  # A6 hedgingPolicy (rfc/0004)
            from ._hedging import hedge_plan, hedged_unary_unary

            hedging = hedge_plan(core, client_call_details.method)
            if hedging is not None:
                return await hedged_unary_unary(
                    core, hedging, continuation, client_call_details, request
                )
        plan = core.plan(client_call_details.method)
        if plan is None:
            return await continuation(client_call_details, request)
        c = _Call(core, plan, client_call_details)
        if plan.strategy.policy is not None:
            c.buffer_unary(request)
        try:
            while True:
                call = await continuation(c.next_details(), request)
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
        finally:
            c.release()


class _Outcome:
    """How the driver ended: committed to ``call`` (maybe with a first message), or finished."""

    __slots__ = ("call", "error", "first", "has_first")

    def __init__(self, call: Any = None, error: Any = None) -> None:
        self.call = call
        self.error = error
        self.first: Any = None
        self.has_first = False


class _ReplayBuffer:
    """Request messages of a client-streaming call, kept for replay until commit."""

    def __init__(self, c: _Call, source: Any) -> None:
        self.c = c
        self.items: list[Any] = []
        self.base = 0  # absolute index of items[0]
        self.consumed = 0  # absolute index of the next item for the live attempt
        self.generation = 0
        self.done = False
        #: What the application's request iterator (or message_size) raised, if anything.
        self.error: Exception | None = None
        self.committed = False
        self.event = asyncio.Event()
        self.drained = asyncio.Event()
        self.source = source
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._pump())

    def commit(self) -> None:
        if self.committed:
            return
        self.committed = True
        c = self.c
        c.state.committed = True
        c.release()
        if c.in_backoff:
            # No attempt is live: end the wait now; the call fails with the last error.
            c.request.cancel()
        drop = self.consumed - self.base
        if drop > 0:
            del self.items[:drop]
            self.base = self.consumed
        if not self.items:
            self.drained.set()

    def _append(self, message: Any) -> None:
        if not self.committed:
            core = self.c.core
            size = core.message_size(message)
            if self.c.buffered + size > core.per_call_buffer_limit or not core._reserve(size):
                self.commit()
            else:
                self.c.buffered += size
        self.items.append(message)
        self.drained.clear()
        self.event.set()

    def detach(self) -> None:
        """The live attempt failed: it takes no more messages, and none count as sent."""
        self.generation += 1
        self.consumed = self.base
        self.event.set()

    async def _pump(self) -> None:
        source = self.source
        try:
            if hasattr(source, "__aiter__"):
                async for message in source:
                    self._append(message)
                    if self.committed and self.items:
                        await self.drained.wait()
            else:
                for message in source:
                    self._append(message)
                    if self.committed and self.items:
                        await self.drained.wait()
        except Exception as exc:
            # Like grpc.aio: the RPC is cancelled (not half-closed). The live attempt's
            # request stream re-raises it; grpc cancels that attempt and logs it.
            self.error = exc
            if self.c.in_backoff:
                self.c.request.cancel()
        finally:
            self.done = True
            self.event.set()

    async def attempt_messages(self) -> AsyncIterator[Any]:
        """The request stream of one attempt: a replay of the buffer, then new messages."""
        self.generation += 1
        generation = self.generation
        i = self.base
        self.consumed = i
        while generation == self.generation:
            k = i - self.base
            if k < len(self.items):
                message = self.items[k]
                i += 1
                self.consumed = i
                if self.committed:
                    del self.items[: i - self.base]
                    self.base = i
                    if not self.items:
                        self.drained.set()
                yield message
            elif self.done:
                if self.error is not None:
                    raise self.error
                return
            else:
                self.event.clear()
                await self.event.wait()

    @property
    def source_done(self) -> bool:
        return self.done

    def close(self) -> None:
        self.generation += 1
        task = self.task
        if task is not None and not task.done():
            task.cancel()


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
    ) -> None:
        self._c = c
        self._continuation = continuation
        self._request = request
        self._response_streaming = response_streaming
        self._replay: _ReplayBuffer | None = None
        if request_streaming:
            self._replay = _ReplayBuffer(c, request)
            self._replay.start()
        elif c.strategy.policy is not None:
            c.buffer_unary(request)
        self._current: Any = None
        self._started = asyncio.Event()
        self._reader: AsyncIterator[Any] | None = None
        self._accounting: asyncio.Task[None] | None = None
        self._accounted = False
        self._cancelled = False
        self._callbacks: list[Callable[[Any], None]] = []
        self._driver: asyncio.Task[_Outcome] = asyncio.get_running_loop().create_task(self._drive())
        self._driver.add_done_callback(self._driver_done)

    # -- the attempt loop ------------------------------------------------------------
    async def _drive(self) -> _Outcome:
        c = self._c
        replay = self._replay
        try:
            while True:
                if replay is not None and replay.error is not None:
                    raise self._source_failed()
                source = self._request if replay is None else replay.attempt_messages()
                call = await self._continuation(c.next_details(), source)
                self._current = call
                self._started.set()
                try:
                    if self._response_streaming:
                        md = await call.initial_metadata()
                        if md:
                            return self._commit(call)
                        message = await call.read()
                        if message is not _EOF:
                            out = self._commit(call)
                            out.first = message
                            out.has_first = True
                            return out
                        await call.code()
                    else:
                        await call
                except aio.AioRpcError as err:
                    if replay is not None:
                        replay.detach()
                        if replay.error is not None:
                            raise self._source_failed() from None
                        if replay.committed:
                            c.state.committed = True
                    await c.failed(err)
                    continue
                if replay is not None and replay.error is not None:
                    raise self._source_failed()
                c.succeeded()
                return _Outcome(call)
        except aio.AioRpcError as err:
            if replay is not None and replay.error is not None:
                raise self._source_failed() from None
            return _Outcome(error=err)
        except BaseException:
            if self._current is not None:
                self._current.cancel()
            raise
        finally:
            if replay is not None and (self._current is None or self._current.done()):
                replay.close()

    def _source_failed(self) -> asyncio.CancelledError:
        """The application's request iterator raised: the call ends cancelled, as in grpc.aio."""
        self._cancelled = True
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

    async def _account_committed(self, call: Any) -> None:
        if self._accounted:
            return
        code = await call.code()
        if code is _OK:
            self._account_end(code, None, None)
            return
        trailing = await call.trailing_metadata()
        error = aio.AioRpcError(code, await call.initial_metadata(), trailing, await call.details())
        self._account_end(code, trailing, error)

    def _account_end(self, code: Any, trailing: Any, error: BaseException | None) -> None:
        """How a committed call ended, for the request, throttler and stats (once per call)."""
        if self._accounted:
            return
        self._accounted = True
        c = self._c
        if code is _OK:
            c.succeeded()  # completes the request and feeds the throttler
            return
        if self._cancelled:  # the application cancelled the call
            c.request.cancel()
        elif error is not None:
            c.core.orchestrator.fail(c.request, error)
        if c.state.attempts > 1:
            c.core.stats.record_failed_retry(c.name)
        policy = c.strategy.policy
        throttler = c.core.throttler
        if throttler is not None and policy is not None:
            # The same rule as for an attempt that can still be retried (_policy._status).
            pushback = parse_pushback(trailing.get_all(PUSHBACK_KEY)) if trailing else None
            if code.value[0] in policy.retryable_status_codes or pushback == PUSHBACK_DONT_RETRY:
                throttler.record_failure()

    def _driver_done(self, task: asyncio.Task[_Outcome]) -> None:
        self._c.release()
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

    # -- grpc.aio Call interface -------------------------------------------------------
    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancelled = True
        if not self._driver.done():
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
        left = self._c.request.time_left
        return None if left is None else left.total_seconds()

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
        return _client_trailing(await out.call.trailing_metadata(), self._c.state.attempts - 1)

    async def code(self) -> Any:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return grpc.StatusCode.CANCELLED
        if out.error is not None:
            return out.error.code()
        return await out.call.code()

    async def details(self) -> str:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return "Locally cancelled by application!"
        if out.error is not None:
            return str(out.error.details())
        return str(await out.call.details())

    async def debug_error_string(self) -> str | None:
        out = await self._settled()
        if out is None:  # the call was cancelled
            return ""
        if out.error is not None:
            return out.error.debug_error_string()  # type: ignore[no-any-return]
        return await out.call.debug_error_string()  # type: ignore[no-any-return]

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
        out = await self._outcome()
        if out.error is not None:
            raise out.error
        if out.has_first:
            message, out.first, out.has_first = out.first, None, False
            yield message
        call = out.call
        while True:
            try:
                message = await call.read()
            except aio.AioRpcError as err:
                self._account_end(err.code(), err.trailing_metadata(), err)
                raise self._c._final(err) from None
            if message is _EOF:
                await self._account_committed(call)
                return
            yield message

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

    def _final_response(self) -> Generator[Any, None, Any]:
        out = yield from asyncio.shield(self._driver).__await__()
        if out.error is not None:
            raise out.error
        response = yield from out.call.__await__()
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
        return self._replay is not None and self._replay.source_done


class _RetryingUnaryStreamCall(_RetryingCall, _base_call.UnaryStreamCall):  # type: ignore[misc]
    pass


class _RetryingStreamUnaryCall(_RetryingCall, _base_call.StreamUnaryCall):  # type: ignore[misc]
    def __await__(self) -> Generator[Any, None, Any]:
        return self._final_response()


class _RetryingStreamStreamCall(_RetryingCall, _base_call.StreamStreamCall):  # type: ignore[misc]
    pass


class RetryUnaryStreamInterceptor(_Interceptor, aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Retries server-streaming calls until the first response headers or message arrive."""

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await self._streaming(
            _RetryingUnaryStreamCall,
            continuation,
            client_call_details,
            request,
            request_streaming=False,
            response_streaming=True,
        )


class RetryStreamUnaryInterceptor(_Interceptor, aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """Retries client-streaming calls, replaying buffered request messages."""

    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._streaming(
            _RetryingStreamUnaryCall,
            continuation,
            client_call_details,
            request_iterator,
            request_streaming=True,
            response_streaming=False,
        )


class RetryStreamStreamInterceptor(_Interceptor, aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Retries bidirectional calls: replays requests, commits on headers or first response."""

    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._streaming(
            _RetryingStreamStreamCall,
            continuation,
            client_call_details,
            request_iterator,
            request_streaming=True,
            response_streaming=True,
        )
