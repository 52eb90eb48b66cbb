"""gRPC A6 retries on the sdkcore orchestrator (needs grpcio: the ``grpc`` extra).

Service config parsing (:class:`ServiceConfig`), the throttler
(:class:`RetryThrottler`), the policy (:class:`A6RetryStrategy`) and statistics
(:class:`RetryStats`) do not need grpcio. The channel helpers and interceptors
do; they are imported on first use, so ``import sdkcore.grpc`` works without
grpcio installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._install import install_hint
from ._duration import parse_duration
from ._policy import (
    PUSHBACK_DONT_RETRY,
    PUSHBACK_KEY,
    A6RetryStrategy,
    BackoffJitter,
    CallState,
    TransparentKind,
    parse_pushback,
)
from ._service_config import (
    DEFAULT_MAX_ATTEMPTS_CAP,
    HedgingPolicy,
    MethodConfig,
    MethodName,
    RetryPolicy,
    RetryThrottlingPolicy,
    ServiceConfig,
    ServiceConfigError,
    ServiceConfigViolation,
)
from ._stats import HISTOGRAM_BUCKETS, MethodRetryStats, RetryStats
from ._throttle import RetryThrottler, throttler_for_target

if TYPE_CHECKING:
    from ._call import call_context
    from ._channel import insecure_channel, retry_controller, retry_stats, secure_channel
    from ._interceptors import (
        RetryController,
        RetryStreamStreamInterceptor,
        RetryStreamUnaryInterceptor,
        RetryUnaryStreamInterceptor,
        RetryUnaryUnaryInterceptor,
    )
    from ._metadata import (
        DEFAULT_CHANNEL_BUFFER_LIMIT,
        DEFAULT_PER_CALL_BUFFER_LIMIT,
        PREVIOUS_ATTEMPTS_KEY,
        default_message_size,
        previous_rpc_attempts,
    )

_LAZY = {
    "call_context": "_call",
    "insecure_channel": "_channel",
    "secure_channel": "_channel",
    "retry_controller": "_channel",
    "retry_stats": "_channel",
    "DEFAULT_CHANNEL_BUFFER_LIMIT": "_metadata",
    "DEFAULT_PER_CALL_BUFFER_LIMIT": "_metadata",
    "PREVIOUS_ATTEMPTS_KEY": "_metadata",
    "RetryController": "_interceptors",
    "RetryStreamStreamInterceptor": "_interceptors",
    "RetryStreamUnaryInterceptor": "_interceptors",
    "RetryUnaryStreamInterceptor": "_interceptors",
    "RetryUnaryUnaryInterceptor": "_interceptors",
    "default_message_size": "_metadata",
    "previous_rpc_attempts": "_metadata",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sdkcore.grpc' has no attribute {name!r}")
    import importlib

    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "grpc":
            raise ImportError(f"sdkcore.grpc.{name} needs grpcio: {install_hint('grpc')}") from exc
        raise
    value = getattr(mod, name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_CHANNEL_BUFFER_LIMIT",
    "DEFAULT_MAX_ATTEMPTS_CAP",
    "DEFAULT_PER_CALL_BUFFER_LIMIT",
    "HISTOGRAM_BUCKETS",
    "PREVIOUS_ATTEMPTS_KEY",
    "PUSHBACK_DONT_RETRY",
    "PUSHBACK_KEY",
    "A6RetryStrategy",
    "BackoffJitter",
    "CallState",
    "HedgingPolicy",
    "MethodConfig",
    "MethodName",
    "MethodRetryStats",
    "RetryController",
    "RetryPolicy",
    "RetryStats",
    "RetryStreamStreamInterceptor",
    "RetryStreamUnaryInterceptor",
    "RetryThrottler",
    "RetryThrottlingPolicy",
    "RetryUnaryStreamInterceptor",
    "RetryUnaryUnaryInterceptor",
    "ServiceConfig",
    "ServiceConfigError",
    "ServiceConfigViolation",
    "TransparentKind",
    "call_context",
    "default_message_size",
    "insecure_channel",
    "parse_duration",
    "parse_pushback",
    "previous_rpc_attempts",
    "retry_controller",
    "retry_stats",
    "secure_channel",
    "throttler_for_target",
]
