"""Channel helpers: grpc.aio channels whose calls are retried by sdkcore."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc import aio
from grpc.aio import _channel as _aio_channel

from .._adaptive_limiter import AdaptiveConcurrencyLimiter
from .._budget import RetryBudget
from .._latency import LatencyQuantile
from .._limiter import ConcurrencyLimiter
from .._orchestrator import RetryOrchestrator
from .._telemetry import Telemetry
from .._throttle import AdaptiveThrottle
from .._untrusted import show as _show
from ._gate import GatedMultiCallable
from ._hedged_call import _HedgedCall, _TracedHedgedCall
from ._interceptors import (
    DEFAULT_CHANNEL_BUFFER_LIMIT,
    DEFAULT_PER_CALL_BUFFER_LIMIT,
    RetryController,
)
from ._policy import BackoffJitter
from ._service_config import DEFAULT_MAX_ATTEMPTS_CAP, ServiceConfig
from ._stats import RetryStats
from ._streaming import (
    StreamStreamMultiCallable,
    StreamUnaryMultiCallable,
    UnaryStreamMultiCallable,
)
from ._unary import (
    BoundedMultiCallable,
    DirectMultiCallable,
    FirstAttemptMultiCallable,
    _TracedUnaryCall,
)

__all__ = ["insecure_channel", "retry_controller", "retry_stats", "secure_channel"]

_controllers: weakref.WeakKeyDictionary[Any, RetryController] = weakref.WeakKeyDictionary()


class _Channel(_aio_channel.Channel):  # type: ignore[misc]
    """A grpc.aio channel whose calls sdkcore drives directly, every call shape.

    A retried or hedged method gets sdkcore's multi-callable around grpc.aio's own (the
    application's interceptors run inside, once per attempt), and the application holds
    sdkcore's call object itself: no interceptor task stands between them (with one, a
    cancellation of the reading task in the turn that task ended reached no call: the
    RPC ran on; rfc/0003). A unary-unary method with no plan gets grpc.aio's
    multi-callable behind a thin one that only bounds the timeout of a call made inside
    an sdkcore request's send by that request's time left (a streaming method's
    multi-callable does the same). The channel's limiter and throttle wrap grpc.aio's
    multi-callables (``GatedMultiCallable``): every attempt of every shape (rfc/0009).
    Measured in bench/bench_grpc_cpu.py.

    ``close()`` (and ``async with``) also cancel the calls waiting between attempts,
    which grpc.aio does not track (see ``_Controller._close_calls``); ``close(grace)``
    first lets sdkcore's calls retry and hedge within the grace (``_Controller._drain``).
    """

    def __init__(
        self,
        controller: RetryController,
        target: str,
        options: Sequence[tuple[str, Any]],
        credentials: Any,
        compression: grpc.Compression | None,
        interceptors: Sequence[aio.ClientInterceptor],
    ) -> None:
        super().__init__(target, options, credentials, compression, list(interceptors))
        self._sdkcore = controller

    def unary_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        inner = super().unary_unary(
            method, request_serializer, response_deserializer, _registered_method
        )
        core = self._sdkcore
        if core.gate is not None:  # the channel's limiter / throttle around every attempt
            inner = GatedMultiCallable(core.gate, inner)
        if _registered_method and core._tel is not None:
            core._tel.register(method)  # a generated stub's method: grpc.method is its name
        if core.service_config is not None:
            hedging = core.hedge_plan(method)
            if hedging is not None:
                hedged = _HedgedCall if core._tel is None else _TracedHedgedCall
                return DirectMultiCallable(core, hedging, inner, method, hedged)
        plan = core.plan(method)
        if plan is None:  # grpc.aio's own calls, within an outer request's deadline
            return BoundedMultiCallable(core, inner)
        if core._tel is not None:  # the telemetry of every call (rfc/0008)
            return DirectMultiCallable(core, plan, inner, method, _TracedUnaryCall)
        if plan.strategy.policy is None and core.gate is None and core.throttler is None:
            # Never sent again: no retryPolicy, and no gate whose refusal is re-sent.
            return FirstAttemptMultiCallable(core, plan, inner, method)
        return DirectMultiCallable(core, plan, inner, method)

    def unary_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        self._registered(method, _registered_method)
        inner = super().unary_stream(
            method, request_serializer, response_deserializer, _registered_method
        )
        return UnaryStreamMultiCallable(self._sdkcore, inner, method)

    def stream_unary(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        self._registered(method, _registered_method)
        inner = super().stream_unary(
            method, request_serializer, response_deserializer, _registered_method
        )
        return StreamUnaryMultiCallable(self._sdkcore, inner, method)

    def stream_stream(
        self,
        method: str,
        request_serializer: Any = None,
        response_deserializer: Any = None,
        _registered_method: bool | None = False,
    ) -> Any:
        self._registered(method, _registered_method)
        inner = super().stream_stream(
            method, request_serializer, response_deserializer, _registered_method
        )
        return StreamStreamMultiCallable(self._sdkcore, inner, method)

    def _registered(self, method: str, registered: bool | None) -> None:
        tel = self._sdkcore._tel
        if registered and tel is not None:
            tel.register(method)

    async def close(self, grace: float | None = None) -> None:
        core = self._sdkcore
        if grace is not None and grace > 0 and not core._closing:
            # As grpcio's own retries: sdkcore's calls keep retrying and hedging within
            # the grace (new calls are refused), then grpc.aio's close gets what is left.
            grace = await core._drain(grace)
        if grace is None or not grace < 0:  # grpc.aio refuses a negative grace (NaN: it closes)
            core._close_calls()
        await super().close(grace)

    async def __aexit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Any:
        self._sdkcore._close_calls()
        return await super().__aexit__(exc_type, exc_val, exc_tb)


#: grpcio's own replay buffer options, and the limits they set on a channel the helpers
#: build (rfc/0003).
_OPT_BUFFERS = {
    "grpc.per_rpc_retry_buffer_size": ("per_call_buffer_limit", DEFAULT_PER_CALL_BUFFER_LIMIT),
    "grpc.retry_buffer_size": ("channel_buffer_limit", DEFAULT_CHANNEL_BUFFER_LIMIT),
}


def _buffer_options(options: Any, retry_options: dict[str, Any]) -> None:
    """grpcio's replay buffer options (``grpc.per_rpc_retry_buffer_size``,
    ``grpc.retry_buffer_size``) set the channel's limits: C-core's retry filter is off, so
    they would do nothing, and a channel ported from grpcio would lose its limits. A
    keyword given with another value than the default is a conflict. Checked before the
    controller is made: a refused option changes nothing."""
    for item in options or ():
        if not isinstance(item, tuple) or len(item) != 2 or item[0] not in _OPT_BUFFERS:
            continue  # the controller checks every option's shape
        key, value = item
        field, default = _OPT_BUFFERS[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"channel option ({key!r}, {value!r}) must be a number of bytes, an int >= 0"
            )
        current = retry_options[field]
        if current != default and current != value:
            raise ValueError(
                f"channel option ({key!r}, {value!r}) conflicts with {field}={current}: "
                "give one of them"
            )
        retry_options[field] = value


def _build(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    service_config: ServiceConfig | str | bytes | Any | None,
    orchestrator: RetryOrchestrator | None,
    options: Sequence[tuple[str, Any]] | None,
    compression: grpc.Compression | None,
    interceptors: Sequence[aio.ClientInterceptor] | None,
    retry_options: dict[str, Any],
    retry_budget: RetryBudget | None = None,
) -> aio.Channel:
    if compression is not None and not isinstance(compression, grpc.Compression):
        raise TypeError(
            "compression must be a grpc.Compression (NoCompression, Deflate or Gzip) or None, "
            f"got {_show(compression)}"
        )
    if retry_budget is not None:
        if not isinstance(retry_budget, RetryBudget):
            raise TypeError(f"retry_budget must be an sdkcore.RetryBudget, got {retry_budget!r}")
        if orchestrator is None:
            orchestrator = RetryOrchestrator(
                retry_budget=retry_budget, telemetry=retry_options.get("telemetry")
            )
        elif orchestrator.retry_budget is not retry_budget:
            raise ValueError(
                "give the retry budget to the orchestrator (RetryOrchestrator(retry_budget=...)) "
                "or to the channel, not a different one to each"
            )
    _buffer_options(options, retry_options)
    controller = RetryController(target, service_config, orchestrator=orchestrator, **retry_options)
    try:
        channel_options = controller.channel_options(options)
        channel = _Channel(
            controller,
            target,
            channel_options,
            None if credentials is None else credentials._credentials,
            compression,
            list(interceptors or ()),
        )
    except BaseException:
        # A rejected option, interceptor or compression: other channels to the target
        # keep the throttler they had.
        controller._abandon()
        raise
    controller.bind_channel(channel)
    _controllers[channel] = controller
    return channel


def insecure_channel(
    target: str,
    *,
    service_config: ServiceConfig | str | bytes | Any | None = None,
    orchestrator: RetryOrchestrator | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    compression: grpc.Compression | None = None,
    interceptors: Sequence[aio.ClientInterceptor] | None = None,
    retries_enabled: bool = True,
    max_attempts_cap: int = DEFAULT_MAX_ATTEMPTS_CAP,
    backoff_jitter: BackoffJitter = BackoffJitter.FULL,
    per_call_buffer_limit: int = DEFAULT_PER_CALL_BUFFER_LIMIT,
    channel_buffer_limit: int = DEFAULT_CHANNEL_BUFFER_LIMIT,
    transparent_retries: bool = True,
    transparent_retry_limit: int = 10,
    stats: RetryStats | None = None,
    message_size: Callable[[Any], int] | None = None,
    retry_budget: RetryBudget | None = None,
    telemetry: Telemetry | None = None,
    hedge_delay: Callable[[str], LatencyQuantile | None] | None = None,
    limiter: ConcurrencyLimiter | AdaptiveConcurrencyLimiter | None = None,
    throttle: AdaptiveThrottle | None = None,
) -> aio.Channel:
    """A ``grpc.aio`` insecure channel whose calls are retried by sdkcore (A6).

    ``service_config`` supplies the retry policies and throttling, which sdkcore
    runs and never hands to grpcio; grpcio gets the rest (load balancing, message
    size limits: ``ServiceConfig.for_grpc``), and a ``grpc.service_config`` option is
    rejected; grpcio's own retries are off (see
    :meth:`RetryController.channel_options` for the one opt-in). A config with keys
    nothing applies (A6 ignores unknown keys, so ``retryPolicyy`` turns retries off) is
    accepted, and the channel logs them once, as the warning ``grpc.config_ignored``.
    ``retries_enabled=False`` turns every retry off. ``interceptors`` run inside
    the retry loop, once per attempt. ``retry_budget``: an :class:`sdkcore.RetryBudget`
    shared with other channels and orchestrators (each call's first attempt deposits,
    on every method sdkcore runs: all of them unless ``transparent_retries=False``
    leaves a method without a method config to grpc.aio alone; each retry withdraws;
    A6 ``retryThrottling`` still applies when the config sets it).
    ``telemetry``: an :class:`sdkcore.Telemetry`; the channel records gRPC's standard
    metrics (A66 ``grpc.client.attempt.*``/``grpc.client.call.duration``, A96
    ``grpc.client.call.retries``/``transparent_retries``/``hedges``/``retry_delay``) and
    A72 spans (``Sent.<service>.<method>``, one ``Attempt.`` child per attempt) for every
    call, and its orchestrator the ``sdkcore.*`` ones (rfc/0008). None (the default): the
    orchestrator's telemetry, if it has one; nothing is recorded without. A telemetry
    given here and a different one on the orchestrator is a ValueError.
    ``hedge_delay``: ``(method) -> LatencyQuantile | None``, an sdkcore option beside
    A6's fixed ``hedgingDelay``: a hedged method whose function gives a
    :class:`sdkcore.LatencyQuantile` sends its next copy at the learned delay (none
    before the quantile has ``min_samples``), and every call feeds it (rfc/0009).
    ``limiter`` (a :class:`sdkcore.ConcurrencyLimiter` or
    :class:`sdkcore.AdaptiveConcurrencyLimiter`) and ``throttle`` (an
    :class:`sdkcore.AdaptiveThrottle`): taken, throttle first, around every attempt
    the channel sends, of every call shape (unary-unary, unary-stream, stream-unary,
    stream-stream; retries, transparent re-sends and hedged copies included), and held
    until the attempt ends: its status is known (for a stream, once it is read to its
    end or fails), it is cancelled, its deadline passes or the channel closes. The
    throttle records that status (RESOURCE_EXHAUSTED and UNAVAILABLE are rejections;
    a cancelled attempt counts nothing). No permit is held between attempts. A refusal
    sends nothing and is retried transparently, as A6's "never left the client" (backoff,
    NOT_SENT); a call still refused at the end fails UNAVAILABLE (rfc/0009, "On gRPC
    channels").
    See :class:`RetryController` for the other options.
    """
    return _build(
        target,
        None,
        service_config,
        orchestrator,
        options,
        compression,
        interceptors,
        {
            "enabled": retries_enabled,
            "max_attempts_cap": max_attempts_cap,
            "backoff_jitter": backoff_jitter,
            "per_call_buffer_limit": per_call_buffer_limit,
            "channel_buffer_limit": channel_buffer_limit,
            "transparent_retries": transparent_retries,
            "transparent_retry_limit": transparent_retry_limit,
            "stats": stats,
            "message_size": message_size,
            "telemetry": telemetry,
            "hedge_delay": hedge_delay,
            "limiter": limiter,
            "throttle": throttle,
        },
        retry_budget,
    )


def secure_channel(
    target: str,
    credentials: grpc.ChannelCredentials,
    *,
    service_config: ServiceConfig | str | bytes | Any | None = None,
    orchestrator: RetryOrchestrator | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    compression: grpc.Compression | None = None,
    interceptors: Sequence[aio.ClientInterceptor] | None = None,
    retries_enabled: bool = True,
    max_attempts_cap: int = DEFAULT_MAX_ATTEMPTS_CAP,
    backoff_jitter: BackoffJitter = BackoffJitter.FULL,
    per_call_buffer_limit: int = DEFAULT_PER_CALL_BUFFER_LIMIT,
    channel_buffer_limit: int = DEFAULT_CHANNEL_BUFFER_LIMIT,
    transparent_retries: bool = True,
    transparent_retry_limit: int = 10,
    stats: RetryStats | None = None,
    message_size: Callable[[Any], int] | None = None,
    retry_budget: RetryBudget | None = None,
    telemetry: Telemetry | None = None,
    hedge_delay: Callable[[str], LatencyQuantile | None] | None = None,
    limiter: ConcurrencyLimiter | AdaptiveConcurrencyLimiter | None = None,
    throttle: AdaptiveThrottle | None = None,
) -> aio.Channel:
    """Like :func:`insecure_channel`, with channel ``credentials`` (TLS)."""
    if not isinstance(credentials, grpc.ChannelCredentials):
        # None would build an insecure channel without a word (grpc.aio's secure_channel
        # fails on it): a caller asking for TLS must get TLS or an error.
        raise TypeError(
            "secure_channel(target, credentials): credentials must be grpc.ChannelCredentials "
            f"(e.g. grpc.ssl_channel_credentials()), got {credentials!r}"
        )
    return _build(
        target,
        credentials,
        service_config,
        orchestrator,
        options,
        compression,
        interceptors,
        {
            "enabled": retries_enabled,
            "max_attempts_cap": max_attempts_cap,
            "backoff_jitter": backoff_jitter,
            "per_call_buffer_limit": per_call_buffer_limit,
            "channel_buffer_limit": channel_buffer_limit,
            "transparent_retries": transparent_retries,
            "transparent_retry_limit": transparent_retry_limit,
            "stats": stats,
            "message_size": message_size,
            "telemetry": telemetry,
            "hedge_delay": hedge_delay,
            "limiter": limiter,
            "throttle": throttle,
        },
        retry_budget,
    )


def retry_controller(channel: Any) -> RetryController:
    """The :class:`RetryController` of a channel made by this module."""
    try:
        return _controllers[channel]
    except (KeyError, TypeError):
        raise ValueError(
            f"{channel!r} was not created by sdkcore.grpc.insecure_channel/secure_channel"
        ) from None


def retry_stats(channel: Any) -> RetryStats:
    """The per-method retry statistics of a channel made by this module."""
    return retry_controller(channel).stats
