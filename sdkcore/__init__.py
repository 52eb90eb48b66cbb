"""sdkcore: the retry brain of a database/RPC SDK core.

Couchbase RFC 0049 (SDK3 retry handling) and the gRPC A6 retry design. Public
names live here; everything in ``sdkcore._*`` is private.
"""

from ._action import ExceptionFactory, RetryAction
from ._adaptive_limiter import AdaptiveConcurrencyLimiter
from ._backoff import Backoff, best_effort_backoff, controlled_backoff, exponential_backoff
from ._breaker import CircuitBreaker, CircuitState
from ._budget import RetryBudget
from ._context import (
    AttemptEffect,
    AttemptRecord,
    CancellationReason,
    ErrorContext,
    describe_error,
)
from ._errors import (
    AmbiguousTimeoutException,
    AuthenticationFailureException,
    CasMismatchException,
    CollectionNotFoundException,
    CouchbaseException,
    DocumentExistsException,
    DocumentLockedException,
    DocumentNotFoundException,
    FeatureNotAvailableException,
    InternalServerFailureException,
    InvalidArgumentException,
    QuotaLimitedException,
    RateLimitedException,
    RequestCanceledException,
    RetryableError,
    ScopeNotFoundException,
    ServiceNotAvailableException,
    TemporaryFailureException,
    TimeoutException,
    UnambiguousTimeoutException,
)
from ._hedge import HedgePolicy, HedgeThrottler
from ._latency import LatencyQuantile
from ._limiter import ConcurrencyLimiter
from ._orchestrator import DEFAULT_MAX_REQUESTS_IN_RETRY, RetryOrchestrator
from ._orphans import OrphanReporter
from ._reason import RetryReason
from ._request import DEFAULT_TIMEOUT, DispatchInfo, Request, RequestState
from ._strategy import (
    BestEffortRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    RetryStrategy,
)
from ._strategy import (
    FailFastRetryStrategy as FailFastRetryStrategy,  # internal (RFC 0049): not in __all__
)
from ._telemetry import Telemetry
from ._threshold import ThresholdReporter
from ._throttle import AdaptiveThrottle
from ._version import __version__

__all__ = [
    "DEFAULT_MAX_REQUESTS_IN_RETRY",
    "DEFAULT_TIMEOUT",
    "AdaptiveConcurrencyLimiter",
    "AdaptiveThrottle",
    "AmbiguousTimeoutException",
    "AttemptEffect",
    "AttemptRecord",
    "AuthenticationFailureException",
    "Backoff",
    "BestEffortRetryStrategy",
    "CancellationReason",
    "CasMismatchException",
    "CircuitBreaker",
    "CircuitState",
    "CollectionNotFoundException",
    "ConcurrencyLimiter",
    "CouchbaseException",
    "DispatchInfo",
    "DocumentExistsException",
    "DocumentLockedException",
    "DocumentNotFoundException",
    "ErrorContext",
    "ExceptionFactory",
    "FastFailOnTerminalErrorRetryStrategy",
    "FeatureNotAvailableException",
    "HedgePolicy",
    "HedgeThrottler",
    "InternalServerFailureException",
    "InvalidArgumentException",
    "LatencyQuantile",
    "OrphanReporter",
    "QuotaLimitedException",
    "RateLimitedException",
    "Request",
    "RequestCanceledException",
    "RequestState",
    "RetryAction",
    "RetryBudget",
    "RetryOrchestrator",
    "RetryReason",
    "RetryStrategy",
    "RetryableError",
    "ScopeNotFoundException",
    "ServiceNotAvailableException",
    "Telemetry",
    "TemporaryFailureException",
    "ThresholdReporter",
    "TimeoutException",
    "UnambiguousTimeoutException",
    "__version__",
    "best_effort_backoff",
    "controlled_backoff",
    "describe_error",
    "exponential_backoff",
]


def _name_public_classes() -> None:
    """Public classes show as ``sdkcore.X`` in tracebacks, reprs and ``help()``.

    Only classes: their ``__qualname__`` is unchanged, and ``sdkcore.X`` is where
    pickle finds them.
    """
    for name in __all__:
        obj = globals()[name]
        # issubclass of type(obj): a generic alias (e.g. ``Backoff``) passes isinstance(obj,
        # type) on Python 3.10 but is not a class, and its __module__ is read-only
        if issubclass(type(obj), type):
            obj.__module__ = __name__


_name_public_classes()
