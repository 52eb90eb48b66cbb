"""grpc.aio client interceptors that run A6 retries on the sdkcore RetryOrchestrator.

Each application call on a retried method keeps one per-call state (``_call``);
from its first failed attempt on, one :class:`sdkcore.Request` (name = the full
method, timeout = the call's deadline and/or the method config's timeout) whose
``retry_strategy`` is the method's :class:`A6RetryStrategy`. Every failed attempt
is handed to ``RetryOrchestrator.maybe_retry``; its refusals and timeouts are
translated back into ``grpc.aio.AioRpcError`` for the application, with the
sdkcore exception (and its ErrorContext) chained as ``__cause__``.

The modules by call shape: ``_unary`` (unary-unary, interceptor and direct paths),
``_hedging`` (hedgingPolicy), ``_streaming`` and ``_replay`` (the three streaming
shapes). This module holds the public names. What grpc.aio lets an interceptor
observe, and how it is used, is documented in rfc/0003-grpc-retry-design.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpc import aio

from ._controller import _Controller
from ._gate import (
    GatedContinuation,
    RefusedCall,
    RefusedStreamStreamCall,
    RefusedStreamUnaryCall,
    RefusedUnaryStreamCall,
    RefusedUnaryUnaryCall,
)
from ._metadata import (
    DEFAULT_CHANNEL_BUFFER_LIMIT,
    DEFAULT_PER_CALL_BUFFER_LIMIT,
    PREVIOUS_ATTEMPTS_KEY,
    default_message_size,
    previous_rpc_attempts,
)
from ._streaming import (
    _RetryingStreamStreamCall,
    _RetryingStreamUnaryCall,
    _RetryingUnaryStreamCall,
    streaming_call,
)
from ._unary import unary_unary_call

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


class RetryController(_Controller):
    """The retry machinery shared by one channel's interceptors.

    * ``service_config``: a :class:`ServiceConfig` (or its JSON / a Mapping); None
      means no retry policies (transparent retries only). It is never handed to
      grpcio: grpc C-core runs no retry policy of its own on these channels. Keys
      nothing applies (A6 ignores unknown keys: ``retryPolicyy``) are logged once, when
      the controller is made, as the warning ``grpc.config_ignored`` (rfc/0003).
    * ``target``: the server name; picks the process-wide throttler.
    * ``orchestrator``: the :class:`RetryOrchestrator` every retry goes through.
    * ``enabled``: False turns every kind of retry off (A6 "Disabling Retries").
    * ``max_attempts_cap``: the client cap on maxAttempts (A6 default 5).
    * ``backoff_jitter``: :class:`BackoffJitter` (the 2017 text or the 2024 amendment).
    * ``per_call_buffer_limit`` / ``channel_buffer_limit``: replay buffer limits in bytes.
    * ``transparent_retries``: A6 transparent retries of attempts the channel's gate
      refused (they never left the client); a call that finds no connection fails fast
      (needs :meth:`bind_channel` to know it was not sent; rfc/0003, "Fail fast").
    * ``stats``: a :class:`RetryStats` to record into (a new one by default).
    * ``message_size``: bytes of a request message (default :func:`default_message_size`).
    * ``telemetry``: an :class:`sdkcore.Telemetry` for gRPC's standard metrics and spans
      (A66, A96, A72; rfc/0008); None: the orchestrator's, if any.
    * ``limiter`` / ``throttle``: the target's :class:`sdkcore.ConcurrencyLimiter` (or
      :class:`sdkcore.AdaptiveConcurrencyLimiter`) / :class:`sdkcore.AdaptiveThrottle`,
      taken around every attempt of every call shape (rfc/0009). The interceptors take
      them around each attempt they make through their ``continuation``, so a channel
      built by hand with :meth:`interceptors` is covered too.
    """

    def interceptors(self) -> list[aio.ClientInterceptor]:
        """The four interceptors (unary-unary, unary-stream, stream-unary, stream-stream)."""
        return [
            RetryUnaryUnaryInterceptor(self),
            RetryUnaryStreamInterceptor(self),
            RetryStreamUnaryInterceptor(self),
            RetryStreamStreamInterceptor(self),
        ]


class _Interceptor:
    def __init__(self, controller: RetryController) -> None:
        if not isinstance(controller, RetryController):
            raise TypeError(
                f"{type(self).__name__}(controller) takes a RetryController, got {controller!r}"
            )
        self.controller = controller

    def _gated(self, continuation: Callable[..., Any], refused: type[RefusedCall]) -> Any:
        """``continuation``, with the channel's limiter and throttle around each attempt.

        The one place the streaming shapes (and a hand-built channel's unary-unary calls)
        are gated: every call sdkcore makes through ``continuation`` is an attempt
        (rfc/0009). The channel helpers gate their direct unary-unary path themselves
        (``GatedMultiCallable``): that path never comes through these interceptors.
        """
        gate = self.controller.gate
        if gate is None:
            return continuation
        return GatedContinuation(gate, continuation, refused)


class RetryUnaryUnaryInterceptor(_Interceptor, aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Retries unary-unary calls (A6) through the sdkcore orchestrator."""

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await unary_unary_call(
            self.controller,
            self._gated(continuation, RefusedUnaryUnaryCall),
            client_call_details,
            request,
        )


class RetryUnaryStreamInterceptor(_Interceptor, aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Retries server-streaming calls until the first response headers or message arrive."""

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await streaming_call(
            self.controller,
            _RetryingUnaryStreamCall,
            self._gated(continuation, RefusedUnaryStreamCall),
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
        return await streaming_call(
            self.controller,
            _RetryingStreamUnaryCall,
            self._gated(continuation, RefusedStreamUnaryCall),
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
        return await streaming_call(
            self.controller,
            _RetryingStreamStreamCall,
            self._gated(continuation, RefusedStreamStreamCall),
            client_call_details,
            request_iterator,
            request_streaming=True,
            response_streaming=True,
        )
