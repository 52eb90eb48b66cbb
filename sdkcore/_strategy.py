"""The built-in strategies (RFC 0049 "Retry Strategies"); the RetryStrategy protocol is re-exported.

The built-ins decide synchronously in their public ``decide(request, reason)``;
``retry_after`` is the protocol's coroutine wrapping it. Every door calls
``decide`` directly when a strategy's ``retry_after`` is a built-in's (see
:func:`sync_decide`), so a retry allocates no coroutine, and a synchronous subclass refines
a built-in by overriding ``decide`` and calling ``super().decide(...)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._action import RetryAction
from ._backoff import Backoff, best_effort_backoff
from ._callables import sync_callable
from ._context import ErrorContext
from ._duration import to_seconds
from ._errors import (
    AuthenticationFailureException,
    CollectionNotFoundException,
    CouchbaseException,
    ScopeNotFoundException,
)
from ._reason import RetryReason, suggest_member
from ._request import Request, RetryStrategy
from ._untrusted import show

__all__ = [
    "BUILTIN_RETRY_AFTER",
    "BestEffortRetryStrategy",
    "FailFastRetryStrategy",
    "FastFailOnTerminalErrorRetryStrategy",
    "RetryStrategy",
    "sync_decide",
]


# Precomputed actions for the default backoff: no allocation per attempt.
_DEFAULT_ACTIONS = tuple(RetryAction.with_duration(best_effort_backoff(n)) for n in range(64))
_DEFAULT_LAST = _DEFAULT_ACTIONS[-1]
_NO_RETRY = RetryAction.no_retry()
_UNSET = object()


class BestEffortRetryStrategy:
    """Retry while it is safe, until the request times out (RFC 0049 "Best Effort").

    Retries when ``request.idempotent`` or ``reason.allows_non_idempotent_retry``,
    after ``backoff(request.retry_attempts)``. The default backoff is 1 ms,
    doubling, capped at 500 ms.

    To refine it, subclass and override ``decide`` (synchronous, calling
    ``super().decide(request, reason)``: works on every door, ``execute_sync``
    included) or ``retry_after`` (``async``, calling ``await super().retry_after(...)``).
    """

    __slots__ = ("_backoff", "_memo")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that refines under a name sdkcore never calls is told at once (one
        that also defines ``decide`` or ``retry_after`` may call it from there: no word)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "decide" in own or "retry_after" in own:
            return
        for name in _NOT_CALLED:
            if name in own:
                warnings.warn(
                    f"{cls.__name__}.{name}() is never called by sdkcore: override "
                    "decide(request, reason) (synchronous, every door) or retry_after("
                    "request, reason) (may be async) instead",
                    stacklevel=2,
                )

    def __init__(self, backoff: Backoff | None = None) -> None:
        sync_callable(
            backoff,
            f"{type(self).__name__}(backoff=...)",
            "(attempt: int) -> timedelta | float",
            optional=True,
        )
        self._backoff = backoff
        # The last (delay, action) built from a custom backoff: constant or capped
        # backoffs then reuse one RetryAction instead of building one per attempt.
        self._memo: tuple[object, RetryAction] = (_UNSET, _NO_RETRY)

    @property
    def backoff(self) -> Backoff:
        return best_effort_backoff if self._backoff is None else self._backoff

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        """The :class:`RetryStrategy` protocol: :meth:`decide`, as a coroutine."""
        return self.decide(request, reason)

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        """The synchronous decision every door uses (override it to refine the strategy)."""
        if type(reason) is not RetryReason or not isinstance(request, Request):
            raise _bad_arguments(self, request, reason)
        # RFC 0049's BestEffort text. The orchestrator enforces the same flag whatever a
        # strategy answers (``_decision.decide``, rule 3): a refinement cannot relax it.
        if request.idempotent or reason.allows_non_idempotent_retry:
            attempt = request.retry_attempts
            try:
                backoff = self._backoff
            except AttributeError:
                raise _not_initialised(self) from None
            if backoff is None:
                return _DEFAULT_ACTIONS[attempt] if attempt < 64 else _DEFAULT_LAST
            delay = backoff(attempt)
            memo = self._memo
            if delay == memo[0] and type(delay) is type(memo[0]):
                return memo[1]
            if delay is None:
                raise TypeError(
                    f"{type(self).__name__}: backoff({attempt}) returned None; a backoff must "
                    "return a timedelta or seconds >= 0 (to stop retrying, return "
                    "RetryAction.no_retry() from decide (or retry_after) instead)"
                )
            # Checked here for both types, so a bad delay is named as the backoff's.
            seconds = to_seconds(delay, f"{type(self).__name__}: backoff({attempt})")
            action = (
                RetryAction(delay)
                if isinstance(delay, timedelta)
                else RetryAction.with_duration(seconds)
            )
            self._memo = (delay, action)
            return action
        return _NO_RETRY

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}(backoff={self._backoff!r})"
        except AttributeError:  # its __init__ did not call super().__init__()
            return f"{type(self).__name__}(<not initialised>)"


#: Method names a refinement may mistake for sdkcore's (RFC 0049's Java spelling, the
#: other libraries'): a subclass defining one is warned (:meth:`__init_subclass__`).
_NOT_CALLED = ("should_retry", "shouldRetry", "retryAfter", "decide_async")


def _not_initialised(strategy: object) -> TypeError:
    name = type(strategy).__name__
    return TypeError(
        f"{name}.__init__ did not call super().__init__(): BestEffortRetryStrategy's state "
        f"(its backoff) is not set; add super().__init__() (or super().__init__(backoff=...)) "
        f"to {name}.__init__"
    )


def _bad_arguments(strategy: object, request: object, reason: object) -> TypeError:
    """The TypeError for a ``decide`` (or ``retry_after``) called with a bad argument."""
    name = f"{type(strategy).__name__}.decide(request, reason)"
    if not isinstance(request, Request):
        return TypeError(f"{name}: request must be an sdkcore.Request, got {show(request)}")
    return TypeError(
        f"{name}: reason must be an sdkcore.RetryReason member, got {show(reason)}"
        + suggest_member(reason, RetryReason)
    )


class FailFastRetryStrategy:
    """Never retries. **Internal**: for SDK-internal requests such as config polling.

    Always-retry reasons (e.g. KV_NOT_MY_VBUCKET) are still retried: the
    orchestrator does not consult a strategy for them.
    """

    __slots__ = ()

    async def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        return _NO_RETRY

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        return _NO_RETRY

    def __repr__(self) -> str:
        return "FailFastRetryStrategy()"


_AUTH = RetryAction.no_retry(AuthenticationFailureException)


def _tls_error(context: ErrorContext) -> CouchbaseException:
    return CouchbaseException(
        "TLS error (RetryReason.TLS_ERROR), not retried: check the client's certificates "
        "and the cluster's TLS settings",
        context=context,
    )


def _bucket_access_error(context: ErrorContext) -> CouchbaseException:
    return CouchbaseException(
        "bucket access error (RetryReason.BUCKET_ACCESS_ERROR), not retried: check that "
        "the bucket exists and that the user may use it",
        context=context,
    )


# CouchbaseException as the RFC says, with a message naming the problem (its default,
# "operation failed", named nothing: a review).
_TLS = RetryAction.no_retry(_tls_error)
_BUCKET_ACCESS = RetryAction.no_retry(_bucket_access_error)
_SCOPE = RetryAction.no_retry(ScopeNotFoundException)
_COLLECTION = RetryAction.no_retry(CollectionNotFoundException)


class FastFailOnTerminalErrorRetryStrategy(BestEffortRetryStrategy):
    """Best effort, but fails at once on terminal errors. **The default strategy.**

    AUTHENTICATION_ERROR -> AuthenticationFailureException; TLS_ERROR and
    BUCKET_ACCESS_ERROR -> CouchbaseException; SCOPE_NOT_FOUND ->
    ScopeNotFoundException; COLLECTION_NOT_FOUND -> CollectionNotFoundException
    (checked in that order); any other reason as BestEffortRetryStrategy.

    **Volatile**: its mapping may grow in later releases to keep giving the best
    experience. To pin the behaviour, copy the class.
    """

    __slots__ = ()

    def decide(self, request: Request, reason: RetryReason) -> RetryAction:
        # The RFC's order; identity checks are cheaper than hashing the enum.
        if reason is RetryReason.AUTHENTICATION_ERROR:
            return _AUTH
        if reason is RetryReason.TLS_ERROR:
            return _TLS
        if reason is RetryReason.BUCKET_ACCESS_ERROR:
            return _BUCKET_ACCESS
        if reason is RetryReason.SCOPE_NOT_FOUND:
            return _SCOPE
        if reason is RetryReason.COLLECTION_NOT_FOUND:
            return _COLLECTION
        return super().decide(request, reason)  # the next in the MRO: a mixin's too


#: The built-ins' ``retry_after``: a strategy whose ``retry_after`` is one of these
#: decides through ``decide`` (no coroutine per retry).
BUILTIN_RETRY_AFTER = frozenset(
    {
        BestEffortRetryStrategy.retry_after,
        FailFastRetryStrategy.retry_after,
    }
)


def sync_decide(strategy: object) -> Callable[[Request, RetryReason], RetryAction] | None:
    """The strategy's synchronous ``decide`` when its ``retry_after`` is a built-in's
    (every door then calls ``decide``: no coroutine per retry), else None (it is asked
    through ``retry_after``). The one place that rule is written."""
    if getattr(getattr(strategy, "retry_after", None), "__func__", None) in BUILTIN_RETRY_AFTER:
        decide: Callable[[Request, RetryReason], RetryAction] = strategy.decide  # type: ignore[attr-defined]
        return decide
    return None
