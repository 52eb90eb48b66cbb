"""The A6 retry policy as an sdkcore RetryStrategy, plus server pushback parsing.

One :class:`A6RetryStrategy` serves every call of a method; the per-call facts
it decides on (last status, pushback, commit, attempts) live in a
:class:`CallState` kept in ``request.client_context[CALL_STATE_KEY]``.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Iterable
from typing import Any

from .. import _failing
from .._action import RetryAction
from .._context import ErrorContext
from .._errors import RequestCanceledException, TimeoutException
from .._reason import RetryReason
from .._request import Request, RequestState
from .._untrusted import show as _show
from ..mapping._grpc_status import STATUS_REASONS, GrpcCode
from ._service_config import DEFAULT_MAX_ATTEMPTS_CAP, RetryPolicy
from ._status import status_name
from ._throttle import RetryThrottler

__all__ = [
    "CALL_STATE_KEY",
    "NO_CODES",
    "PUSHBACK_DONT_RETRY",
    "PUSHBACK_KEY",
    "REASON_STATUS",
    "REASON_TRANSPARENT",
    "A6RetryStrategy",
    "BackoffJitter",
    "CallState",
    "TransparentKind",
    "costs_token",
    "parse_pushback",
    "status_reason",
    "time_out_at_deadline",
]

#: Trailing metadata key of A6 server pushback.
PUSHBACK_KEY = "grpc-retry-pushback-ms"
#: :func:`parse_pushback` result meaning "the server asked not to retry".
PUSHBACK_DONT_RETRY = -1
#: Key of the per-call :class:`CallState` in ``Request.client_context``.
CALL_STATE_KEY = "sdkcore.grpc.call"
#: The reason a failed attempt with a status is handed to the orchestrator for,
#: except UNAVAILABLE (SERVICE_NOT_AVAILABLE): see :func:`status_reason`.
REASON_STATUS = RetryReason.SERVICE_RESPONSE_CODE_INDICATED
#: The reason of a transparent retry the channel cannot name better (a refused stream a
#: caller marks ``TransparentKind.REFUSED``); an attempt the channel's limiter or throttle
#: refused is retried under the refusal's own reason (``CONCURRENCY_LIMITED``,
#: ``CLIENT_THROTTLED``), so logs and ``sdkcore.retries`` say the client shed it. The
#: strategy tells a transparent case by the call's state, not by the reason.
REASON_TRANSPARENT = RetryReason.SOCKET_NOT_AVAILABLE

# By status number, from the one table the Couchbase mapping uses too.
_REASON_BY_CODE: tuple[RetryReason, ...] = tuple(
    STATUS_REASONS.get(code, REASON_STATUS) for code in GrpcCode
)


def status_reason(code: int) -> RetryReason:
    """The RetryReason a failed attempt with status number ``code`` is retried for.

    The table is ``sdkcore.mapping``'s (``grpc_failure`` names the same reason for
    the same status): SERVICE_NOT_AVAILABLE for UNAVAILABLE, else
    SERVICE_RESPONSE_CODE_INDICATED.
    """
    return _REASON_BY_CODE[code] if 0 <= code < len(_REASON_BY_CODE) else REASON_STATUS


_INT32_MAX = 2**31 - 1
_INT32_DIGITS = len(str(_INT32_MAX))
_PUSHBACK_VALUE = re.compile(r"-?[0-9]+")


_DEADLINE_EXCEEDED = GrpcCode.DEADLINE_EXCEEDED.value


def time_out_at_deadline(
    request: Any, error: BaseException, *, book: bool = True
) -> TimeoutException | None:
    """End a call's ``request`` as timed out when ``error`` is the call's own deadline.

    DEADLINE_EXCEEDED once the request's time is up is its timeout, not a failure: the
    request ends CANCELLED with TIMEOUT (telemetry's outcome ``timeout``, as a deadline
    reached in the backoff), logged as ``retry.timed_out`` as on the core's doors, and
    the timeout's exception is returned (its context for the call's error, rfc/0003).
    ``book``: record ``error`` as the last attempt's failure first: the attempt the
    deadline cut in flight (maybe applied). Anything else (a server's own
    DEADLINE_EXCEEDED with time left included) leaves the request for the caller to
    fail, and returns None.
    """
    if request.state is not RequestState.PENDING:
        return None
    code = getattr(error, "code", None)
    if not callable(code):
        return None
    try:
        value = code().value[0]
    except Exception:  # not a grpc status
        return None
    if value == _DEADLINE_EXCEEDED and request.deadline - request.clock() <= 0.0:
        return _failing.timed_out(
            request,
            request.last_reason,
            _failing.strategy_of(request),
            request.clock(),
            in_flight=book,
            error=error if book else None,
        )
    return None


#: ``costs_token``'s ``retried`` for a method without a policy: no status of its own
#: costs a token, a "don't retry" pushback does.
NO_CODES: frozenset[int] = frozenset()


def costs_token(status: int, retried: frozenset[int], pushback: int | None) -> bool:
    """A6's throttling rule: whether a failed attempt costs the channel a token.

    It does when its status is one the method's policy retries (``retried``: a
    retryPolicy's retryableStatusCodes, a hedgingPolicy's nonFatalStatusCodes) or
    when the server's pushback asked not to retry, whatever the status. Every other
    answer (and an OK call) is a success for the throttler. The one statement of the
    rule: retried, hedged and streaming calls all ask it.
    """
    return status in retried or pushback == PUSHBACK_DONT_RETRY


def _bad_values(values: object) -> TypeError:
    return TypeError(
        "parse_pushback(values) must be an iterable of the metadata values "
        f"(metadata.get_all({PUSHBACK_KEY!r}), possibly empty), got {_show(values)}"
    )


def parse_pushback(values: Iterable[str | bytes]) -> int | None:
    """Interpret the ``grpc-retry-pushback-ms`` values of one response.

    ``None`` when absent; the delay in ms (``0`` included: retry at once) for a
    single non-negative 32-bit integer in ASCII decimal; :data:`PUSHBACK_DONT_RETRY`
    for a negative, unparsable, out-of-range (however many digits) or repeated
    value (A6: the server asks not to retry). Never raises for what a server sends;
    ``values`` itself must be an iterable of values (``metadata.get_all(key)``), not a
    single str or bytes (TypeError naming it).
    """
    found: list[str | bytes]
    if type(values) is list:  # metadata.get_all()
        found = values
    else:
        if isinstance(values, (str, bytes)):
            raise _bad_values(values)
        try:
            found = list(values)
        except TypeError:
            raise _bad_values(values) from None
    if not found:
        return None
    if len(found) > 1:
        return PUSHBACK_DONT_RETRY
    raw = found[0]
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return PUSHBACK_DONT_RETRY
    if not isinstance(raw, str) or _PUSHBACK_VALUE.fullmatch(raw) is None:
        return PUSHBACK_DONT_RETRY
    if raw[0] == "-":
        return PUSHBACK_DONT_RETRY
    # Out of range is decided on the digits: int() of a long text would raise.
    digits = raw.lstrip("0") or "0"
    if len(digits) > _INT32_DIGITS:
        return PUSHBACK_DONT_RETRY
    ms = int(digits)
    if ms > _INT32_MAX:
        return PUSHBACK_DONT_RETRY
    return ms


class BackoffJitter(enum.Enum):
    """How a retry's delay is drawn from the bound ``b``.

    ``b = min(initialBackoff * backoffMultiplier**(n-1), maxBackoff)`` for the
    ``n``-th retry since the last server pushback.
    """

    #: ``random(0, b)``: the A6 text as published in 2017 (the default).
    FULL = "full"
    #: ``b * random(0.8, 1.2)``: the 2024 A6 amendment (what grpc C-core does today).
    PROPORTIONAL = "proportional"


class TransparentKind(enum.Enum):
    """Which A6 transparent-retry case a failure is (see rfc/0003)."""

    #: The RPC never left the client: the channel's limiter or throttle refused it (an
    #: attempt that finds no connection fails fast instead: rfc/0003, "Fail fast").
    NEVER_SENT = "never_sent"
    #: The RPC reached the server's gRPC library but not the application (stream refused).
    REFUSED = "refused"


class CallState:
    """Per-call retry facts, updated by the interceptor after each attempt."""

    __slots__ = (
        "attempts",
        "backoff_n",
        "code",
        "commit_why",
        "committed",
        "local_refusals",
        "pushback",
        "refused_by",
        "refused_retries",
        "transparent",
        "transparent_retries",
    )

    def __init__(self) -> None:
        #: A6 attempts started (transparent retries excluded).
        self.attempts = 0
        #: Retries since the last pushback: the ``n - 1`` in the backoff formula.
        self.backoff_n = 0
        #: Status code (int) of the last failed attempt.
        self.code = -1
        #: ``parse_pushback`` of the last failed attempt.
        self.pushback: int | None = None
        #: True once response headers or a message reached the application, or the
        #: replay buffer overflowed: no more retries of any kind.
        self.committed = False
        #: Why the call committed, when not for response headers or messages.
        self.commit_why = ""
        #: The transparent-retry case of the last failure, if any.
        self.transparent: TransparentKind | None = None
        #: Transparent retries of attempts that never left the client (NEVER_SENT).
        self.transparent_retries = 0
        #: Transparent retries of refused streams (REFUSED): A6's re-sends.
        self.refused_retries = 0
        #: Attempts the channel's limiter or throttle refused before sending, and their
        #: reasons' names, each once in the order first seen (the error's debug string).
        self.local_refusals = 0
        self.refused_by: tuple[str, ...] = ()


def _refusal(why: str, state: CallState) -> RetryAction:
    code = state.code

    def build(context: ErrorContext) -> BaseException:
        extra = dict(context.extra)
        extra.update(
            grpc_status=status_name(code) if code >= 0 else None,
            grpc_attempts=state.attempts,
            grpc_pushback_ms=state.pushback,
            not_retried_because=why,
        )
        return RequestCanceledException(f"not retried: {why}", context=context.evolve(extra=extra))

    return RetryAction.no_retry(build, why=why)


_TRANSPARENT_MAX_DELAY = 1.0
_TRANSPARENT_FIRST_DELAY = 0.01


class A6RetryStrategy:
    """A6 retry policy decisions: transparent retries (the call's state says the attempt
    never left the client), and status failures (every other attempt).

    * Status failures: retry a status in ``retryableStatusCodes`` while fewer than
      ``min(maxAttempts, max_attempts_cap)`` attempts were made, the call is not
      committed, the throttler allows it and the server did not push back with
      "don't retry". The delay is the pushback when there is one (and the
      exponent then restarts at ``initialBackoff``), else the backoff drawn as
      ``jitter`` says. Only failures with a retryable status or a "don't retry"
      pushback take a throttling token.
    * Transparent retries never count toward ``maxAttempts`` nor the throttler:
      a stream refused before the server application saw it
      (``TransparentKind.REFUSED``, set only by a caller that knows it: the channel
      never does, a refused stream is an ordinary UNAVAILABLE for it, rfc/0003) is
      retried once at once (a second refusal goes to the retry policy like any
      status failure, as A6 says); an RPC that never left the client (the channel's
      limiter or throttle refused it) is retried with a short backoff
      (10 ms doubling to 1 s) until the deadline, or at most
      ``transparent_retry_limit`` times when the call has no deadline.

    ``policy`` may be None (no retryPolicy for the method): then only
    transparent retries happen.
    """

    __slots__ = (
        "_initial",
        "_jitter",
        "_max",
        "_max_attempts",
        "_mult",
        "_policy",
        "_random",
        "_throttler",
        "_transparent_limit",
    )

    def __init__(
        self,
        policy: RetryPolicy | None,
        *,
        throttler: RetryThrottler | None = None,
        max_attempts_cap: int = DEFAULT_MAX_ATTEMPTS_CAP,
        jitter: BackoffJitter = BackoffJitter.FULL,
        transparent_retry_limit: int = 10,
        rng: random.Random | None = None,
    ) -> None:
        if (
            isinstance(max_attempts_cap, bool)
            or not isinstance(max_attempts_cap, int)
            or max_attempts_cap < 1
        ):
            raise ValueError(
                f"max_attempts_cap must be an integer >= 1, got {_show(max_attempts_cap)}"
            )
        if not isinstance(jitter, BackoffJitter):
            raise TypeError(f"jitter must be a BackoffJitter, got {jitter!r}")
        if (
            isinstance(transparent_retry_limit, bool)
            or not isinstance(transparent_retry_limit, int)
            or transparent_retry_limit < 0
        ):
            raise ValueError(
                "transparent_retry_limit must be an integer >= 0, got "
                f"{_show(transparent_retry_limit)}"
            )
        if policy is not None and not isinstance(policy, RetryPolicy):
            raise TypeError(
                "A6RetryStrategy(policy) must be an sdkcore.grpc.RetryPolicy (a method's "
                f"retryPolicy) or None (transparent retries only), got {_show(policy)}"
            )
        if throttler is not None and not isinstance(throttler, RetryThrottler):
            raise TypeError(
                "A6RetryStrategy(throttler) must be an sdkcore.grpc.RetryThrottler or None, "
                f"got {_show(throttler)}"
            )
        if rng is not None and (
            isinstance(rng, type) or not callable(getattr(rng, "random", None))
        ):
            raise TypeError(
                "A6RetryStrategy(rng) must be a random.Random instance (anything with a "
                f"random() -> float method) or None, got {_show(rng)}"
            )
        self._policy = policy
        self._throttler = throttler
        self._jitter = jitter
        self._transparent_limit = transparent_retry_limit
        self._random = rng.random if rng is not None else random.random
        if policy is not None:
            self._max_attempts = policy.effective_max_attempts(max_attempts_cap)
            self._initial = policy.initial_backoff.total_seconds()
            self._max = policy.max_backoff.total_seconds()
            self._mult = policy.backoff_multiplier
        else:
            self._max_attempts = 1
            self._initial = self._max = 0.0
            self._mult = 1.0

    @property
    def policy(self) -> RetryPolicy | None:
        return self._policy

    @property
    def max_attempts(self) -> int:
        """The effective maximum number of attempts (maxAttempts capped by the client)."""
        return self._max_attempts

    @property
    def throttler(self) -> RetryThrottler | None:
        return self._throttler

    def backoff_bound(self, n: int) -> float:
        """``min(initialBackoff * multiplier**n, maxBackoff)`` in seconds (``n`` 0-based)."""
        try:
            bound = self._initial * self._mult**n
        except OverflowError:
            return self._max
        return bound if bound < self._max else self._max

    def draw_backoff(self, n: int) -> float:
        bound = self.backoff_bound(n)
        if self._jitter is BackoffJitter.FULL:
            return bound * self._random()
        return bound * (0.8 + 0.4 * self._random())

    def retry_after(self, request: Request, reason: RetryReason) -> RetryAction:
        state: CallState = request.client_context[CALL_STATE_KEY]
        if state.transparent is not None:  # never left the client (see REASON_TRANSPARENT)
            return self._transparent(request, state)
        return self._status(state)

    def _status(self, state: CallState) -> RetryAction:
        policy = self._policy
        if policy is None:
            return _refusal("the method has no retryPolicy", state)
        code = state.code
        retryable = code in policy.retryable_status_codes
        pushback = state.pushback
        allowed = True
        throttler = self._throttler
        if throttler is not None and costs_token(code, policy.retryable_status_codes, pushback):
            allowed = throttler.record_failure()
        if not retryable:
            return _refusal(f"status {status_name(code)} is not in retryableStatusCodes", state)
        if pushback == PUSHBACK_DONT_RETRY:
            return _refusal("the server's grpc-retry-pushback-ms asked not to retry", state)
        if not allowed:
            assert throttler is not None  # allowed is False only from its record_failure
            throttler.note_refusal()
            return _refusal(
                "retries are throttled (retryThrottling tokens at or below half)", state
            )
        if state.committed:
            why = state.commit_why or "response headers or messages received"
            return _refusal(f"the call is committed ({why})", state)
        if state.attempts >= self._max_attempts:
            used = self._max_attempts
            if policy.max_attempts > used:  # not the number in the config: say where it came from
                return _refusal(
                    f"all {used} attempts used (maxAttempts {policy.max_attempts}, capped at "
                    f"{used} by the channel's max_attempts_cap)",
                    state,
                )
            return _refusal(f"all {used} attempts (maxAttempts) used", state)
        if pushback is not None:
            state.backoff_n = 0
            delay = pushback / 1000.0
        else:
            delay = self.draw_backoff(state.backoff_n)
            state.backoff_n += 1
        return RetryAction.with_duration(delay)

    def _transparent(self, request: Request, state: CallState) -> RetryAction:
        if state.committed:
            return _refusal("the call is committed", state)
        if state.transparent is TransparentKind.REFUSED:
            if state.refused_retries >= 1:
                # A6: after one transparent retry, the configured policy handles it,
                # and the next attempt counts toward maxAttempts.
                state.transparent = None
                return self._status(state)
            state.refused_retries += 1
            return RetryAction.with_duration(0.0)
        n = state.transparent_retries
        if request.timeout is None and n >= self._transparent_limit:
            return _refusal(
                f"still refused locally after {n} transparent retries and the call has no deadline",
                state,
            )
        state.transparent_retries = n + 1
        delay = _TRANSPARENT_FIRST_DELAY * (2.0 ** min(n, 16))
        return RetryAction.with_duration(min(delay, _TRANSPARENT_MAX_DELAY))

    def __repr__(self) -> str:
        return (
            f"A6RetryStrategy(max_attempts={self._max_attempts}, jitter={self._jitter.name}, "
            f"throttled={self._throttler is not None})"
        )
