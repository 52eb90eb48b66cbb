"""sdkcore: the retry brain of a database/RPC SDK core.

Couchbase RFC 0049 (SDK3 retry handling) and the gRPC A6 retry design. Public
names live here; everything in ``sdkcore._*`` is private.

The classes a request needs only when the application built one (the hedging policy
and the learned hedging delay, limiters, the throttle, the breaker, the budget,
telemetry and the reporters) are imported at
their first use, ``sdkcore.X`` or ``from sdkcore import X`` (PEP 562 ``__getattr__``):
``import sdkcore`` loads the request path only.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._action import ExceptionFactory, RetryAction
from ._backoff import Backoff, best_effort_backoff, controlled_backoff, exponential_backoff
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
from ._orchestrator import DEFAULT_MAX_REQUESTS_IN_RETRY, RetryOrchestrator
from ._reason import RetryReason
from ._request import DEFAULT_TIMEOUT, DispatchInfo, Request, RequestState, dispatch_unsent
from ._strategy import (
    BestEffortRetryStrategy,
    FastFailOnTerminalErrorRetryStrategy,
    RetryStrategy,
)
from ._strategy import (
    FailFastRetryStrategy as FailFastRetryStrategy,  # internal (RFC 0049): not in __all__
)
from ._version import __version__

if TYPE_CHECKING:  # imported at first use (``_LAZY``); for type checkers and IDEs here
    from ._adaptive_limiter import AdaptiveConcurrencyLimiter
    from ._breaker import CircuitBreaker, CircuitState
    from ._budget import RetryBudget
    from ._hedge_policy import HedgePolicy, HedgeThrottler
    from ._latency import LatencyQuantile
    from ._limiter import ConcurrencyLimiter
    from ._orphans import OrphanReporter
    from ._telemetry import Telemetry
    from ._threshold import ThresholdReporter
    from ._throttle import AdaptiveThrottle, default_is_rejection

#: Public name -> the private module that defines it, imported when the name is first used.
_LAZY = {
    "AdaptiveConcurrencyLimiter": "_adaptive_limiter",
    "AdaptiveThrottle": "_throttle",
    "CircuitBreaker": "_breaker",
    "CircuitState": "_breaker",
    "ConcurrencyLimiter": "_limiter",
    "HedgePolicy": "_hedge_policy",
    "HedgeThrottler": "_hedge_policy",
    "LatencyQuantile": "_latency",
    "OrphanReporter": "_orphans",
    "RetryBudget": "_budget",
    "Telemetry": "_telemetry",
    "ThresholdReporter": "_threshold",
    "default_is_rejection": "_throttle",
}

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
    "default_is_rejection",
    "describe_error",
    "dispatch_unsent",
    "exponential_backoff",
]


def _name_public_classes() -> None:
    """Public classes show as ``sdkcore.X`` in tracebacks, reprs and ``help()``.

    Only classes: their ``__qualname__`` is unchanged, and ``sdkcore.X`` is where
    pickle finds them. The lazy ones (``_LAZY``) are named at their first use here.
    """
    for name in __all__:
        if name not in _LAZY:
            _name(globals()[name])
    _name(FailFastRetryStrategy)  # public as sdkcore.FailFastRetryStrategy, though not in __all__


def _name(obj: Any) -> None:
    # issubclass of type(obj): a generic alias (e.g. ``Backoff``) passes isinstance(obj,
    # type) on Python 3.10 but is not a class, and its __module__ is read-only
    if issubclass(type(obj), type):
        obj.__module__ = __name__


def _load(name: str) -> Any:
    """A public class of ``_LAZY``, imported at its first use, then kept here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    obj = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    _name(obj)
    globals()[name] = obj
    return obj


if not TYPE_CHECKING:  # type checkers see the imports above, and an unknown name as an error
    __getattr__ = _load  # PEP 562: asked for a name this module does not hold (yet)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_name_public_classes()
